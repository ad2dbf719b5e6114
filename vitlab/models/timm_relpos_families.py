"""Adapters for timm's plain-token ViTs with their own position terms: Eva (EVA / EVA-02, rotary),
Beit (relative position bias) and VisionTransformerRelPos (``vit_relpos_*``, log-coordinate bias MLP).

All three are pre-norm ``x + drop_path(ls1 * attn(norm1(x)))``, ``x + drop_path(ls2 * mlp(norm2(x)))``
with the model passing position terms to each block as keyword arguments (``rope=`` for Eva,
``shared_rel_pos_bias=`` / ``shared_rel_pos=`` for shared biases), which the patched forward passes on.
Attention is recorded on timm's explicit path (``fused_attn`` off) at the input of ``attn_drop``: the
probabilities after the rotary / relative-position terms.

Q/K/V views: a fused ``qkv.weight`` is returned as a live view; Eva with separate ``q_proj`` / ``k_proj`` /
``v_proj`` and the biases of Eva / Beit (``q_bias``, a zero ``k_bias`` buffer, ``v_bias``) are
concatenated copies: (3C', C) and (3C',) as everywhere else.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn
from timm.layers import PatchEmbed
from timm.models import beit, eva, vision_transformer_relpos as relpos

from vitlab.models.adapter import BlockView, Embeddings, conv_embeddings, plain_type
from vitlab.models.timm_common import _explicit_attention, _fused_bias, _timm_filter, _TimmPlainBlocks

__all__ = ["TimmBeitAdapter", "TimmEvaAdapter", "TimmViTRelPosAdapter"]


def _scaled(gamma: Optional[Tensor], x: Tensor) -> Tensor:
    return x if gamma is None else gamma * x


def _qkv_shape(attn: nn.Module) -> tuple[int, int]:
    """(3C', C) of the fused Q/K/V projection, read from the layers' shapes (no tensor is made: the parameters may be
    shards of a sharded network)."""
    if getattr(attn, "qkv", None) is not None:
        return tuple(attn.qkv.weight.shape)
    return 3 * attn.q_proj.weight.shape[0], attn.q_proj.weight.shape[1]


class _TimmTokenViT(_TimmPlainBlocks):
    """Shared parts: flat ``blocks``, timm ``PatchEmbed``, class/register tokens, attention ``attn``."""

    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "patch_embed.proj"
    mlp_act_name = "drop1"  # the MLP hidden layer: act(fc1 x) (Mlp) or act(fc1_g x) * fc1_x x (SwiGLU / GLU)
    library = "timm"

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return int(model.num_prefix_tokens)

    def _rel_pos_table(self, block: nn.Module) -> Optional[nn.Parameter]:
        return None

    def block_views(self, model: nn.Module) -> list[BlockView]:
        grid, prefix = self._grid(model), self.num_prefix_tokens(model)
        views = []
        for index, block in enumerate(model.blocks):
            rows, dim = _qkv_shape(block.attn)
            heads = block.attn.num_heads
            views.append(BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"blocks.{index}", dim=dim, num_heads=heads,
                head_dim=rows // 3 // heads, has_attention=True, window_size=None, shift_size=None,
                rel_pos_table=self._rel_pos_table(block), grid=grid, num_prefix_tokens=prefix,
            ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        prefix = self.num_prefix_tokens(model)
        pos = None
        if getattr(model, "pos_embed", None) is not None:
            pos = model.pos_embed.detach()[0]  # (N, D)
            pos = pos if getattr(model, "no_embed_class", False) else pos[prefix:]
        cls_token = model.cls_token.detach()[0, 0] if getattr(model, "cls_token", None) is not None else None
        return conv_embeddings(model.patch_embed.proj, self._grid(model), pos, cls_token, prefix)

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        return _explicit_attention(block.attn, block.attn.attn_drop, use_output=False, sink=sink)

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        parts = {"patch_embed": ["patch_embed."], "norm": ["norm.", "fc_norm."], "head": ["head."]}
        if getattr(model, "pos_embed", None) is not None:
            parts["pos_embed"] = ["pos_embed"]
        if getattr(model, "cls_token", None) is not None:
            parts["cls_token"] = ["cls_token"]
        return parts


class TimmEvaAdapter(_TimmTokenViT):
    """timm ``Eva`` (EVA, EVA-02 and timm's rotary ViTs) with pre-norm ``EvaBlock`` / ``EvaAttention``."""

    family = "timm-eva"
    description = "timm Eva (eva02_*, eva_*)"
    classes = "Eva (EvaBlock, EvaAttention)"
    examples = "`eva02_tiny_patch14_224`, `eva02_base_patch14_224`, `eva_giant_patch14_224`"
    notes = ("Q/K/V fused or separate (separate: concatenated copies), rotary embedding recorded on "
                "the patch tokens, SwiGLU hidden = act(gate)·value; not post-norm or grouped-query blocks")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, eva.Eva) and isinstance(model.patch_embed, PatchEmbed) and all(
            plain_type(block) is eva.EvaBlock and plain_type(block.attn) is eva.EvaAttention for block in model.blocks)

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        attn = block.attn
        if attn.qkv is not None:
            return attn.qkv.weight, _fused_bias(attn)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        weight = torch.cat([proj.weight for proj in projections])
        if attn.q_proj.bias is None:
            return weight, None
        return weight, torch.cat([proj.bias if proj.bias is not None else torch.zeros_like(attn.q_proj.bias)
                                  for proj in projections])

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.drop_path1(_scaled(block.gamma_1, block.attn(h, **kwargs)))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path2(_scaled(block.gamma_2, block.mlp(h)))

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "cls_token", "reg_token", "pos_embed", "rope.", "norm_pre."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(eva.checkpoint_filter_fn, state_dict, model)


class TimmBeitAdapter(_TimmTokenViT):
    """timm ``Beit``: per-block (or shared) relative position bias over patches + class token, q/v
    biases without a k bias, LayerScale ``gamma_1`` / ``gamma_2``."""

    family = "timm-beit"
    description = "timm Beit (beit_*, beitv2_*)"
    classes = "Beit"
    examples = "`beit_base_patch16_224`, `beitv2_base_patch16_224`"
    notes = ("relative position bias table exposed as `BlockView.rel_pos_table`, zero K bias in "
                "`qkv` (copies of q/k/v biases)")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, beit.Beit) and isinstance(model.patch_embed, PatchEmbed) and all(
            plain_type(block) is beit.Block and plain_type(block.attn) is beit.Attention for block in model.blocks)

    def _rel_pos_table(self, block: nn.Module) -> Optional[nn.Parameter]:
        return block.attn.relative_position_bias_table

    def qkv_projection(self, block: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        return block.attn.qkv.weight, _fused_bias(block.attn)

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.drop_path1(_scaled(block.gamma_1, block.attn(h, **kwargs)))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path2(_scaled(block.gamma_2, block.mlp(h)))

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "cls_token", "pos_embed", "rel_pos_bias."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(beit.checkpoint_filter_fn, state_dict, model)


class TimmViTRelPosAdapter(_TimmTokenViT):
    """timm ``VisionTransformerRelPos`` with pre-norm ``RelPosBlock``: a per-block (or shared) relative
    position bias from ``RelPosBias`` tables or the log-coordinate ``RelPosMlp``."""

    family = "timm-vit-relpos"
    description = "timm VisionTransformerRelPos (vit_relpos_*, pre-norm blocks)"
    classes = "VisionTransformerRelPos (RelPosBlock)"
    examples = "`vit_relpos_small_patch16_224`, `vit_relpos_base_patch16_clsgap_224`"
    notes = "rel-pos bias MLP or table recorded in the probabilities; not the `*_rpn_*` post-norm blocks"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, relpos.VisionTransformerRelPos) and isinstance(model.patch_embed, PatchEmbed) \
            and all(plain_type(block) is relpos.RelPosBlock for block in model.blocks)

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.drop_path1(block.ls1(block.attn(h, **kwargs)))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path2(block.ls2(block.mlp(h)))

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "cls_token", "shared_rel_pos."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(relpos.checkpoint_filter_fn, state_dict, model)
