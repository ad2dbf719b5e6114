"""Adapters for timm's Swin Transformer V2 (``swinv2_*``) and V2-Cr (``swinv2_cr_*``).

Both are res-post-norm (``x = x + drop_path(norm1(attn(x)))``, ``x = x + drop_path(norm2(mlp(x)))``)
with scaled cosine attention: head h scores a window pair with
``exp(min(s_h, log 100)) * cos(q_i, k_j) + b_h(i - j) (+ shift mask)``, where ``s_h`` is the learned
logit scale and ``b_h`` the continuous position bias: ``16 * sigmoid(cpb_mlp(log-spaced coords))`` for
V2, ``meta_mlp(sign(d) log(1 + |d|))`` for V2-Cr. The Q/K/V views are the fused projection; V2 adds
``q_bias`` / ``v_bias`` and a zero K bias (the returned bias is a copy, not a view).
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn
from timm.models import swin_transformer_v2 as swin2
from timm.models import swin_transformer_v2_cr as swin2cr

from vitlab.models.adapter import BlockView, Embeddings, FamilyAdapter, _pair, conv_embeddings, plain_type
from vitlab.models.timm_common import _fused_bias, _hooked, _timm_filter

__all__ = ["TimmSwinV2Adapter", "TimmSwinV2CrAdapter"]


class _TimmSwinV2Base(FamilyAdapter):
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "patch_embed.proj"
    norm_placement = "post"
    library = "timm"
    stages_attr = "layers"

    def _stages(self, model: nn.Module) -> list[nn.Module]:
        return list(getattr(model, self.stages_attr))

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(model.patch_embed.img_size)

    def embeddings(self, model: nn.Module) -> Embeddings:
        return conv_embeddings(model.patch_embed.proj, _pair(model.patch_embed.grid_size))

    def _grid(self, block: nn.Module) -> tuple[int, int]:
        raise NotImplementedError

    def block_views(self, model: nn.Module) -> list[BlockView]:
        views, global_index = [], 0
        for stage, layer in enumerate(self._stages(model)):
            for index, block in enumerate(layer.blocks):
                attn = block.attn
                views.append(BlockView(
                    name=f"stage{stage}.block{index}", stage=stage, index=index, global_index=global_index,
                    module=block, qualname=f"{self.stages_attr}.{stage}.blocks.{index}", dim=block.dim,
                    num_heads=attn.num_heads, head_dim=attn.qkv.out_features // 3 // attn.num_heads,
                    has_attention=True, window_size=_pair(block.window_size), shift_size=_pair(block.shift_size),
                    rel_pos_table=None, grid=self._grid(block), num_prefix_tokens=0, attention_form="cosine",
                ))
                global_index += 1
        return views

    def mlp_branch(self, block: nn.Module, h: Tensor, norm: Callable[[Tensor], Tensor]) -> Tensor:
        return block.drop_path2(norm(block.mlp(h)))

    def to_mlp_layout(self, x: Tensor):
        batch, height, width, channels = x.shape
        return x.reshape(batch, -1, channels), lambda y: y.reshape(batch, height, width, channels)

    def window_geometry(self, block: nn.Module, grid: tuple[int, int]):
        return _pair(block.window_size), _pair(block.shift_size), True  # timm rolls, then pads

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["patch_embed."], "norm": ["norm."], "head": ["head."]}

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "absolute_pos_embed"]

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        entries, first_block = {}, 0
        for stage, layer in enumerate(self._stages(model)):
            entries[f"{self.stages_attr}.{stage}.downsample."] = first_block
            first_block += len(layer.blocks)
        return entries


class TimmSwinV2Adapter(_TimmSwinV2Base):
    """timm ``SwinTransformerV2``: res-post-norm blocks, cosine attention, CPB-MLP bias (16 sigmoid)."""

    family = "timm-swinv2"
    description = "timm SwinTransformerV2 (swinv2_*)"
    classes = "SwinTransformerV2"
    examples = "`swinv2_tiny_window8_256`, `swinv2_base_window12to16_192to256`"
    notes = ("res-post-norm (`ablate layernorm` drops the norm after each branch); attention = "
                "cosine with logit scale + 16·sigmoid(CPB MLP) bias; QKSpectra: spectra of Wq^T Wk "
                "(un-normalised q·k)")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, swin2.SwinTransformerV2) and all(
            plain_type(block) is swin2.SwinTransformerV2Block for layer in model.layers for block in layer.blocks)

    def _grid(self, block: nn.Module) -> tuple[int, int]:
        return _pair(block.input_resolution)

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        return block.attn.qkv.weight, _fused_bias(block.attn)

    def mixer_branch(self, block: nn.Module, h: Tensor, norm: Callable[[Tensor], Tensor], **kwargs) -> Tensor:
        return block.drop_path1(norm(block._attn(h)))  # (B, H, W, C)

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        # softmax output (B*nW, H, w*w, w*w): cosine logits * scale + 16 sigmoid(CPB) + shift mask
        return _hooked(block.attn.softmax, sink, use_output=True)

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(swin2.checkpoint_filter_fn, state_dict, model)


class TimmSwinV2CrAdapter(_TimmSwinV2Base):
    """timm ``SwinTransformerV2Cr``: stages ``stages[s]`` (downsample first), cosine attention with a
    log-coordinate meta-MLP bias. The main-branch ``norm3`` (last block of the model, and periodically in
    huge/giant) is kept by every ablation, like the final norm of other families."""

    family = "timm-swinv2-cr"
    description = "timm SwinTransformerV2Cr (swinv2_cr_*)"
    classes = "SwinTransformerV2Cr"
    examples = "`swinv2_cr_tiny_224`, `swinv2_cr_small_ns_224`"
    notes = ("res-post-norm (the main-branch `norm3` is never ablated); attention = "
                "cosine with logit scale + log-coordinate meta-MLP bias; QKSpectra: spectra of Wq^T Wk")
    stages_attr = "stages"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, swin2cr.SwinTransformerV2Cr) and all(
            plain_type(block) is swin2cr.SwinTransformerV2CrBlock for stage in model.stages for block in stage.blocks)

    def _grid(self, block: nn.Module) -> tuple[int, int]:
        return _pair(block.feat_size)

    def mixer_branch(self, block: nn.Module, h: Tensor, norm: Callable[[Tensor], Tensor], **kwargs) -> Tensor:
        return block.drop_path1(norm(block._shifted_window_attn(h)))

    def main_branch_norm(self, block: nn.Module, x: Tensor) -> Tensor:
        return block.norm3(x)

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        # softmax is functional here: the probabilities enter attn_drop (B*nW, H, w*w, w*w)
        return _hooked(block.attn.attn_drop, sink, use_output=False)

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["patch_embed."], "head": ["head."]}

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(swin2cr.checkpoint_filter_fn, state_dict, model)
