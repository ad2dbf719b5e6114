"""Adapters for torchvision's ``VisionTransformer`` and ``SwinTransformer`` (v1: swin_t/s/b; v2: swin_v2_t/s/b)."""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torchvision.models import swin_transformer as tv_swin
from torchvision.models import vision_transformer as tv_vit

from vitlab.models.adapter import BlockView, Embeddings, FamilyAdapter, _pair, conv_embeddings, plain_type

__all__ = ["TorchvisionSwinAdapter", "TorchvisionSwinV2Adapter", "TorchvisionViTAdapter"]

DEFAULT_IMAGE_SIZE = 224


class TorchvisionViTAdapter(FamilyAdapter):
    """torchvision ``VisionTransformer`` (vit_b_16 ... vit_h_14) with a patchify ``conv_proj``."""

    family = "torchvision-vit"
    description = "torchvision VisionTransformer (vit_b_16, vit_b_32, vit_l_16, vit_l_32, vit_h_14)"
    library = "torchvision"
    classes = "VisionTransformer"
    examples = "`vit_b_16`, `vit_l_16`, `vit_h_14`"
    notes = "per-head weights asked from `nn.MultiheadAttention` while recording; grayscale input repeats the channel"
    part_names = {"norm1": "ln_1", "mixer": "self_attention", "norm2": "ln_2", "mlp": "mlp"}
    input_conv = "conv_proj"
    mlp_act_name = "1"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return (isinstance(model, tv_vit.VisionTransformer) and isinstance(model.conv_proj, nn.Conv2d)
                and all(block.self_attention._qkv_same_embed_dim for block in model.encoder.layers))

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return 1

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(model.image_size)

    def _grid(self, model: nn.Module) -> tuple[int, int]:
        side = model.image_size // model.patch_size
        return (side, side)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        grid, views = self._grid(model), []
        for index, (child_name, block) in enumerate(model.encoder.layers.named_children()):
            attn = block.self_attention
            views.append(BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"encoder.layers.{child_name}", dim=attn.embed_dim, num_heads=attn.num_heads,
                head_dim=attn.head_dim, has_attention=True, window_size=None, shift_size=None,
                rel_pos_table=None, grid=grid, num_prefix_tokens=1,
            ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        patch_positions = model.encoder.pos_embedding.detach()[0, 1:]  # (N, D) without the class token row
        return conv_embeddings(model.conv_proj, self._grid(model), pos_embed=patch_positions,
                               cls_token=model.class_token.detach()[0, 0], num_prefix_tokens=1)

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        return block.self_attention.in_proj_weight, block.self_attention.in_proj_bias

    def out_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        return block.self_attention.out_proj.weight, block.self_attention.out_proj.bias

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        attended, _ = block.self_attention(h, h, h, need_weights=False)
        return block.dropout(attended)

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.mlp(h)

    @contextmanager
    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]) -> Iterator[None]:
        # ask nn.MultiheadAttention for per-head weights (B, H, N, N); the block drops them again
        def want_weights(module, args, kwargs):
            return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

        attn = block.self_attention
        handles = [attn.register_forward_pre_hook(want_weights, with_kwargs=True),
                   attn.register_forward_hook(lambda module, args, output: sink(output[1]))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["conv_proj."], "pos_embed": ["encoder.pos_embedding"],
                "cls_token": ["class_token"], "norm": ["encoder.ln."], "head": ["heads."]}

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["conv_proj.", "class_token", "encoder.pos_embedding"]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        file_pos = state_dict.get("encoder.pos_embedding")
        if file_pos is not None and file_pos.shape != model.encoder.pos_embedding.shape and file_pos.ndim == 3:
            return tv_vit.interpolate_embeddings(model.image_size, model.patch_size, state_dict)
        return state_dict


class _SoftmaxRecorder(TorchFunctionMode):
    """Reports every ``F.softmax`` result computed while active."""

    def __init__(self, sink: Callable[[Tensor], None]):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is F.softmax:
            self.sink(result)
        return result


def _tv_swin_stages(model: nn.Module) -> list[tuple[int, nn.Sequential]]:
    """(position in ``model.features``, stage) for each stage of Swin blocks."""
    return [(position, module) for position, module in enumerate(model.features)
            if isinstance(module, nn.Sequential) and len(module) > 0
            and isinstance(module[0], tv_swin.SwinTransformerBlock)]


class TorchvisionSwinAdapter(FamilyAdapter):
    """torchvision ``SwinTransformer`` v1 (swin_t, swin_s, swin_b); patch merging between stages."""

    family = "torchvision-swin"
    description = "torchvision SwinTransformer v1 (swin_t, swin_s, swin_b)"
    library = "torchvision"
    classes = "SwinTransformer (v1 blocks)"
    examples = "`swin_t`, `swin_s`, `swin_b`"
    notes = "shifted windows as timm Swin; grayscale input repeats the channel"
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "features.0.0"
    mlp_act_name = "1"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        if not isinstance(model, tv_swin.SwinTransformer):
            return False
        blocks = [block for _, stage in _tv_swin_stages(model) for block in stage]
        return bool(blocks) and all(plain_type(block.attn) is tv_swin.ShiftedWindowAttention for block in blocks)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(getattr(model, "image_size", DEFAULT_IMAGE_SIZE))

    def block_views(self, model: nn.Module) -> list[BlockView]:
        height, width = self.image_size(model)
        patch = _pair(model.features[0][0].stride)
        grid = (height // patch[0], width // patch[1])
        views, global_index = [], 0
        for stage, (position, blocks) in enumerate(_tv_swin_stages(model)):
            if stage > 0:  # patch merging pads odd sizes, then halves
                grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
            for index, block in enumerate(blocks):
                attn = block.attn
                window, shift, _ = self.window_geometry(block, grid)
                views.append(BlockView(
                    name=f"stage{stage}.block{index}", stage=stage, index=index, global_index=global_index,
                    module=block, qualname=f"features.{position}.{index}", dim=attn.qkv.in_features,
                    num_heads=attn.num_heads, head_dim=attn.qkv.in_features // attn.num_heads,
                    has_attention=True, window_size=window, shift_size=shift,
                    rel_pos_table=getattr(attn, "relative_position_bias_table", None), grid=grid,
                    num_prefix_tokens=0,
                ))
                global_index += 1
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        conv = model.features[0][0]
        (height, width), patch = self.image_size(model), _pair(conv.stride)
        return conv_embeddings(conv, (height // patch[0], width // patch[1]))

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.stochastic_depth(block.attn(h))  # (B, H, W, C)

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.stochastic_depth(block.mlp(h))

    @contextmanager
    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]) -> Iterator[None]:
        # torchvision computes window attention functionally: catch its F.softmax (B*nW, H, w*w, w*w)
        attn = block.attn
        previous = attn.__dict__.get("forward")
        library_forward = attn.forward

        def recording_forward(module, x):
            with _SoftmaxRecorder(sink):
                return library_forward(x)

        attn.forward = types.MethodType(recording_forward, attn)
        try:
            yield
        finally:
            if previous is None:
                del attn.forward
            else:
                attn.forward = previous

    def window_geometry(self, block: nn.Module, grid: tuple[int, int]):
        window = _pair(block.attn.window_size)
        shift = list(_pair(block.attn.shift_size))
        for axis in range(2):  # torchvision drops the shift where one window covers the padded axis
            padded = -(-grid[axis] // window[axis]) * window[axis]
            if window[axis] >= padded:
                shift[axis] = 0
        return window, (shift[0], shift[1]), False

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["features.0."], "norm": ["norm."], "head": ["head."]}

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["features.0."]

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        entries, first_block = {}, 0
        for position, blocks in _tv_swin_stages(model):
            if position > 1:
                entries[f"features.{position - 1}."] = first_block
            first_block += len(blocks)
        return entries


class TorchvisionSwinV2Adapter(TorchvisionSwinAdapter):
    """torchvision ``SwinTransformer`` with ``SwinTransformerBlockV2`` (swin_v2_t/s/b): res-post-norm
    blocks, cosine attention with a learned logit scale and a 16 sigmoid(CPB MLP) position bias.

    torchvision zeroes the K third of ``qkv.bias`` inside the attention: :meth:`qkv_projection` returns
    that effective bias (a copy with a zero K part), while the weight stays a live view.
    """

    family = "torchvision-swinv2"
    description = "torchvision SwinTransformer v2 (swin_v2_t, swin_v2_s, swin_v2_b)"
    classes = "SwinTransformer (SwinTransformerBlockV2)"
    examples = "`swin_v2_t`, `swin_v2_s`, `swin_v2_b`"
    notes = ("res-post-norm; attention = cosine with logit scale + 16·sigmoid(CPB MLP) bias, "
                "K bias zeroed as torchvision does; QKSpectra: spectra of Wq^T Wk (un-normalised q·k)")
    norm_placement = "post"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        if not isinstance(model, tv_swin.SwinTransformer):
            return False
        blocks = [block for _, stage in _tv_swin_stages(model) for block in stage]
        return bool(blocks) and all(plain_type(block) is tv_swin.SwinTransformerBlockV2
                                    and plain_type(block.attn) is tv_swin.ShiftedWindowAttentionV2 for block in blocks)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        return [replace(view, attention_form="cosine") for view in super().block_views(model)]

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        qkv = block.attn.qkv
        if qkv.bias is None:
            return qkv.weight, None
        bias = qkv.bias.clone()
        width = bias.numel() // 3
        bias[width:2 * width] = 0.0
        return qkv.weight, bias

    def mixer_branch(self, block: nn.Module, h: Tensor, norm: Callable[[Tensor], Tensor], **kwargs) -> Tensor:
        return block.stochastic_depth(norm(block.attn(h)))

    def mlp_branch(self, block: nn.Module, h: Tensor, norm: Callable[[Tensor], Tensor]) -> Tensor:
        return block.stochastic_depth(norm(block.mlp(h)))
