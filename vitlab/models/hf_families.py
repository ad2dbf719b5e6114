"""Adapters for Hugging Face ``transformers`` ViT, DINOv2 (with and without registers) and Swin (v1).

They accept an :class:`~vitlab.models.hf_classifier.HFClassifier` (what ``build_model("hf:...")`` returns), a
``*ForImageClassification`` model or a bare ``ViTModel`` / ``Dinov2Model`` / ``Dinov2WithRegistersModel`` /
``SwinModel``; block ``qualname`` and part prefixes are relative to the model given. The Q/K/V views are the
separate ``q_proj`` / ``k_proj`` / ``v_proj`` weights. Attention is recorded by switching the recorded
block's attention module to the library's eager attention (its own per-module config copy) and reading
the probabilities it returns.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from torch import Tensor, nn

from vitlab.models.adapter import BlockView, Embeddings, FamilyAdapter, _pair, conv_embeddings
from vitlab.models.hf_classifier import HFClassifier, require_transformers

require_transformers()
from transformers.models.dinov2 import modeling_dinov2  # noqa: E402
from transformers.models.swin import modeling_swin  # noqa: E402
from transformers.models.vit import modeling_vit  # noqa: E402

try:  # newer transformers only
    from transformers.models.dinov2_with_registers import modeling_dinov2_with_registers as _dinov2_reg
except ImportError:  # pragma: no cover - depends on the installed version
    _dinov2_reg = None

__all__ = ["HFDinov2Adapter", "HFSwinAdapter", "HFViTAdapter"]


def _backbone(model: nn.Module, base_class) -> tuple[Optional[nn.Module], str, Optional[str]]:
    """(the bare ``*Model`` inside ``model``, its state-dict prefix, the prefix of the module holding the
    classifier or None for a bare model), or (None, "", None) when ``model`` holds no ``base_class``."""
    prefix = ""
    if isinstance(model, HFClassifier):
        model, prefix = model.hf, "hf."
    if isinstance(model, base_class):
        return model, prefix, None
    inner_name = getattr(model, "base_model_prefix", "")
    inner = getattr(model, inner_name, None) if inner_name else None
    if isinstance(inner, base_class):
        return inner, f"{prefix}{inner_name}.", prefix
    return None, "", None


@contextmanager
def _eager_attention(attn: nn.Module, sink: Callable[[Tensor], None]) -> Iterator[None]:
    """Run ``attn`` with the library's eager attention (it returns the probabilities) and report them."""
    config = attn.config
    eager = copy.copy(config)
    eager._attn_implementation = "eager"
    attn.config = eager
    handle = attn.register_forward_hook(lambda module, args, output: sink(output[1]))
    try:
        yield
    finally:
        attn.config = config
        handle.remove()


class _HFAdapter(FamilyAdapter):
    """Shared parts: patch embedding ``embeddings.patch_embeddings.projection``, ``o_proj`` output."""

    base_classes: tuple = ()
    head_prefixes: tuple[str, ...] = ("classifier.",)

    @classmethod
    def _find(cls, model: nn.Module) -> tuple[Optional[nn.Module], str, Optional[str]]:
        for base_class in cls.base_classes:
            found = _backbone(model, base_class)
            if found[0] is not None:
                return found
        return None, "", None

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return cls._find(model)[0] is not None

    def _base(self, model: nn.Module) -> tuple[nn.Module, str]:
        base, prefix, _ = self._find(model)
        return base, prefix

    def in_chans(self, model: nn.Module) -> int:
        return int(self._base(model)[0].embeddings.patch_embeddings.projection.in_channels)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(self._base(model)[0].config.image_size)

    def _grid(self, model: nn.Module) -> tuple[int, int]:
        (height, width), (ph, pw) = self.image_size(model), _pair(self._base(model)[0].config.patch_size)
        return (height // ph, width // pw)

    def qkv_projection(self, block: nn.Module):
        attn = self.part(block, "mixer")
        layers = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = None if attn.q_proj.bias is None else tuple(layer.bias for layer in layers)
        return tuple(layer.weight for layer in layers), biases

    def out_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        proj = self.part(block, "mixer").o_proj
        return proj.weight, proj.bias

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        return _eager_attention(self.part(block, "mixer"), sink)

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        base, prefix, outer = self._find(model)
        heads = [] if outer is None else [outer + head for head in self.head_prefixes]
        parts = {"patch_embed": [f"{prefix}embeddings.patch_embeddings."], "norm": [f"{prefix}layernorm."],
                 "head": heads + [f"{prefix}pooler."]}
        embeddings = base.embeddings
        if getattr(embeddings, "position_embeddings", None) is not None:
            parts["pos_embed"] = [f"{prefix}embeddings.position_embeddings"]
        if getattr(embeddings, "cls_token", None) is not None:
            parts["cls_token"] = [f"{prefix}embeddings.cls_token"]
        return parts

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return [f"{self._base(model)[1]}embeddings."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        # the input conv's state-dict name depends on the model given (wrapper, classifier or bare model);
        # load_weights reads ``input_conv`` after this call (one adapter instance per model)
        self.input_conv = f"{self._base(model)[1]}embeddings.patch_embeddings.projection"
        return state_dict


class _HFPlainAdapter(_HFAdapter):
    """ViT-like: one stage of layers, class (and register) tokens, learned absolute positions."""

    layers_path = ""

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return 1 + int(getattr(self._base(model)[0].config, "num_register_tokens", 0) or 0)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        base, prefix = self._base(model)
        grid, tokens = self._grid(model), self.num_prefix_tokens(model)
        views = []
        for index, block in enumerate(base.get_submodule(self.layers_path)):
            attn = self.part(block, "mixer")
            views.append(BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"{prefix}{self.layers_path}.{index}", dim=attn.q_proj.in_features,
                num_heads=attn.num_attention_heads, head_dim=attn.head_dim, has_attention=True, window_size=None,
                shift_size=None, rel_pos_table=None, grid=grid, num_prefix_tokens=tokens,
            ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        embeddings = self._base(model)[0].embeddings
        pos = embeddings.position_embeddings.detach()[0, 1:]  # (N, D): registers carry no position
        return conv_embeddings(embeddings.patch_embeddings.projection, self._grid(model), pos,
                               embeddings.cls_token.detach()[0, 0], self.num_prefix_tokens(model))

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """Resample the patch position embeddings of a file made for another image size (bicubic)."""
        from timm.layers import resample_abs_pos_embed

        state_dict = super().filter_state_dict(state_dict, model)
        key = self.parts(model)["pos_embed"][0]
        target = self._base(model)[0].embeddings.position_embeddings
        found = state_dict.get(key)
        if found is not None and found.ndim == 3 and found.shape[1] != target.shape[1]:
            old_side = int(round((found.shape[1] - 1) ** 0.5))
            if old_side * old_side == found.shape[1] - 1:
                state_dict[key] = resample_abs_pos_embed(found, list(self._grid(model)), [old_side, old_side],
                                                         num_prefix_tokens=1)
        return state_dict


class HFViTAdapter(_HFPlainAdapter):
    """transformers ``ViTModel`` / ``ViTForImageClassification`` (pre-norm layers, no LayerScale)."""

    family = "hf-vit"
    description = "Hugging Face transformers ViT (ViTModel, ViTForImageClassification; hf:vit, hf:<folder>)"
    library = "transformers (`.[hf]` extra)"
    classes = "ViTModel, ViTForImageClassification"
    examples = "`hf:vit`, `hf:<save_pretrained folder>`"
    notes = "separate q/k/v projections; Q/K/V callbacks and every probe"
    part_names = {"norm1": "layernorm_before", "mixer": "attention", "norm2": "layernorm_after", "mlp": "mlp"}
    mlp_act_name = "activation_fn"
    base_classes = (modeling_vit.ViTModel,)
    layers_path = "layers"

    def mixer_branch(self, block: nn.Module, h: Tensor, attention_mask=None, **kwargs) -> Tensor:
        return block.dropout(block.attention(h, attention_mask, **kwargs)[0])

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.dropout(block.mlp(h))


class HFDinov2Adapter(_HFPlainAdapter):
    """transformers ``Dinov2Model`` and ``Dinov2WithRegistersModel`` (LayerScale, optional SwiGLU MLP)."""

    family = "hf-dinov2"
    description = ("Hugging Face transformers DINOv2 with and without registers (Dinov2Model, "
                   "Dinov2WithRegistersModel; hf:dinov2, hf:dinov2_with_registers)")
    library = "transformers (`.[hf]` extra)"
    classes = "Dinov2Model, Dinov2WithRegistersModel"
    examples = "`hf:dinov2`, `hf:dinov2_with_registers`"
    notes = "LayerScale; registers as prefix tokens; SwiGLU `mlp_hidden` is the gate activation"
    part_names = {"norm1": "norm1", "mixer": "attention", "norm2": "norm2", "mlp": "mlp"}
    mlp_act_name = "activation_fn"
    base_classes = (modeling_dinov2.Dinov2Model,) + ((_dinov2_reg.Dinov2WithRegistersModel,) if _dinov2_reg else ())
    layers_path = "encoder.layer"

    def mixer_branch(self, block: nn.Module, h: Tensor, attention_mask=None, **kwargs) -> Tensor:
        return block.drop_path(block.layer_scale1(block.attention(h, attention_mask=attention_mask, **kwargs)[0]))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path(block.layer_scale2(block.mlp(h)))

    def mlp_activation(self, block: nn.Module) -> nn.Module:
        mlp = self.part(block, "mlp")  # SwiGLU: the gate activation (the hidden layer is act(gate) * up)
        return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn


class HFSwinAdapter(_HFAdapter):
    """transformers ``SwinModel`` / ``SwinForImageClassification`` (v1): stream (B, H*W, C), patch merging at
    the end of each stage, pad then roll (like torchvision), shift mask -100."""

    family = "hf-swin"
    description = "Hugging Face transformers Swin v1 (SwinModel, SwinForImageClassification; hf:swin)"
    library = "transformers (`.[hf]` extra)"
    classes = "SwinModel, SwinForImageClassification"
    examples = "`hf:swin`"
    notes = "windowed attention with the dense token x token form; padded windows"
    part_names = {"norm1": "layernorm_before", "mixer": "attention", "norm2": "layernorm_after", "mlp": "mlp"}
    mlp_act_name = "activation_fn"
    base_classes = (modeling_swin.SwinModel,)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        base, prefix = self._base(model)
        views, global_index = [], 0
        for stage, layer in enumerate(base.encoder.layers):
            for index, block in enumerate(layer.blocks):
                attn, grid = block.attention, _pair(block.input_resolution)
                window, shift, _ = self.window_geometry(block, grid)
                views.append(BlockView(
                    name=f"stage{stage}.block{index}", stage=stage, index=index, global_index=global_index,
                    module=block, qualname=f"{prefix}encoder.layers.{stage}.blocks.{index}",
                    dim=attn.q_proj.in_features, num_heads=attn.num_attention_heads, head_dim=attn.head_dim,
                    has_attention=True, window_size=window, shift_size=shift,
                    rel_pos_table=attn.relative_position_bias.relative_position_bias_table, grid=grid,
                    num_prefix_tokens=0,
                ))
                global_index += 1
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        return conv_embeddings(self._base(model)[0].embeddings.patch_embeddings.projection, self._grid(model))

    def mixer_branch(self, block: nn.Module, h: Tensor, input_dimensions, always_partition: bool = False,
                     **kwargs) -> Tensor:
        # the library's SwinLayer.forward between the first norm and the residual add, on (B, H*W, C)
        if not always_partition:
            block.set_shift_and_window_size(input_dimensions)
        height, width = input_dimensions
        batch_size, _, channels = h.size()
        h = h.view(batch_size, height, width, channels)
        h, pad_values = block.maybe_pad(h, height, width)
        _, height_pad, width_pad, _ = h.shape
        windows = modeling_swin.window_partition(block.cyclic_shift(h), block.window_size)
        windows = windows.view(-1, block.window_size * block.window_size, channels)
        mask = block.get_attn_mask(height_pad, width_pad, dtype=h.dtype, device=windows.device)
        out, _ = block.attention(windows, mask, **kwargs)
        out = block.dropout(out).view(-1, block.window_size, block.window_size, channels)
        out = block.cyclic_shift(modeling_swin.window_reverse(out, block.window_size, height_pad, width_pad),
                                 reverse=True)
        if pad_values[3] > 0 or pad_values[5] > 0:
            out = out[:, :height, :width, :].contiguous()
        return block.drop_path(out.view(batch_size, height * width, channels))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.dropout(block.mlp(h))

    def block_output(self, x: Tensor):
        return x, None  # SwinStage unpacks (hidden_states, attention weights)

    def runtime_grid(self, block: nn.Module, args: tuple) -> tuple[int, int]:
        return _pair(args[1])

    def window_geometry(self, block: nn.Module, grid: tuple[int, int]):
        window, shift = int(block.window_size), int(block.shift_size)
        if min(grid) <= window:  # the library's set_shift_and_window_size
            window, shift = min(grid), 0
        return (window, window), (shift, shift), False

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        base, prefix = self._base(model)
        entries, first_block = {}, 0
        for stage, layer in enumerate(base.encoder.layers):
            first_block += len(layer.blocks)
            if layer.downsample is not None:  # merging at the end of stage s feeds stage s + 1
                entries[f"{prefix}encoder.layers.{stage}.downsample."] = first_block
        return entries
