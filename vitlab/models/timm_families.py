"""Adapters for timm's VisionTransformer (ViT, DeiT; and over volumes, the 3-D ViT of
:mod:`vitlab.models.vit3d`), SwinTransformer (v1) and MlpMixer."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn
from timm.layers import Attention, PatchEmbed
from timm.models import mlp_mixer, swin_transformer, vision_transformer

from vitlab.models.adapter import BlockView, Embeddings, FamilyAdapter, _pair, conv_embeddings, plain_type
from vitlab.models.timm_common import _explicit_attention, _timm_filter, _TimmPlainBlocks
from vitlab.models.vit3d import PATCH_KEY, PatchEmbed3d, adapt_in_chans, inflate_2d_state

__all__ = ["Timm3DViTAdapter", "TimmMixerAdapter", "TimmSwinAdapter", "TimmViTAdapter"]


class TimmViTAdapter(_TimmPlainBlocks):
    """timm ``VisionTransformer`` with standard pre-norm ``Block`` and fused-QKV ``Attention``."""

    family = "timm-vit"
    description = "timm VisionTransformer (vit_*, deit_*)"
    library = "timm"
    classes = "VisionTransformer"
    examples = "`vit_base_patch16_224`, `deit3_small_patch16_224`, `vit_small_patch14_dinov2`, `vit_large_patch16_224` with `init_values`"
    notes = "class / register tokens, LayerScale; recording switches to the explicit (non-fused) attention path"
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "patch_embed.proj"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        if not isinstance(model, vision_transformer.VisionTransformer):
            return False
        return isinstance(model.patch_embed, PatchEmbed) and cls._standard_blocks(model)

    @staticmethod
    def _standard_blocks(model: nn.Module) -> bool:
        """Whether every block is timm's pre-norm ``Block`` with the plain (ungated) fused-QKV ``Attention``."""
        return all(
            plain_type(block) is vision_transformer.Block and plain_type(block.attn) is Attention
            and getattr(block.attn, "gate", None) is None
            for block in model.blocks
        )

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return int(model.num_prefix_tokens)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        grid, prefix = self._grid(model), self.num_prefix_tokens(model)
        views = []
        for index, block in enumerate(model.blocks):
            attn = block.attn
            views.append(BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"blocks.{index}", dim=attn.qkv.in_features, num_heads=attn.num_heads,
                head_dim=attn.head_dim, has_attention=True, window_size=None, shift_size=None,
                rel_pos_table=None, grid=grid, num_prefix_tokens=prefix,
            ))
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        return conv_embeddings(model.patch_embed.proj, self._grid(model), *self._tokens(model))

    def _tokens(self, model: nn.Module) -> tuple[Optional[Tensor], Optional[Tensor], int]:
        """(patch tokens' position embedding (N, D) or None, class token (D,) or None, prefix tokens)."""
        prefix, pos = self.num_prefix_tokens(model), None
        if model.pos_embed is not None:
            pos = model.pos_embed.detach()[0]  # (N, D)
            pos = pos if model.no_embed_class else pos[prefix:]
        cls_token = model.cls_token.detach()[0, 0] if model.cls_token is not None else None
        return pos, cls_token, prefix

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.drop_path1(block.ls1(block.attn(h, **kwargs)))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path2(block.ls2(block.mlp(h)))

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        # the explicit path passes the probabilities (B, H, N, N) through attn_drop
        return _explicit_attention(block.attn, block.attn.attn_drop, use_output=False, sink=sink)

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        parts = {"patch_embed": ["patch_embed."], "norm": ["norm.", "fc_norm."],
                 "head": ["head.", "head_dist."]}
        if model.pos_embed is not None:
            parts["pos_embed"] = ["pos_embed"]
        if model.cls_token is not None:
            parts["cls_token"] = ["cls_token"]
        return parts

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "cls_token", "reg_token", "dist_token", "pos_embed", "norm_pre."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(vision_transformer.checkpoint_filter_fn, state_dict, model)


class Timm3DViTAdapter(TimmViTAdapter):
    """timm ``VisionTransformer`` with a :class:`~vitlab.models.vit3d.PatchEmbed3d`: the 2-D ViT's blocks over
    a (d, h, w) token grid (docs/models.md)."""

    family = "timm-vit3d"
    description = "timm VisionTransformer with a Conv3d patch embedding (vit3d:vit_*)"
    classes = "VisionTransformer + PatchEmbed3d"
    examples = ("`vit3d:vit_base_patch16_224`, `vit3d:vit_small_patch16_224` (with `img_size=(D, H, W)`, "
                "`patch_size=(pd, p, p)`)")
    notes = ("volumes (B, C, D, H, W); tokens in (d, h, w) raster order, `BlockView.grid` = (d, h, w); 2-D ViT "
             "weights inflated on load (patch kernel / pd over depth, position embedding repeated over depth)")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return (isinstance(model, vision_transformer.VisionTransformer)
                and isinstance(model.patch_embed, PatchEmbed3d) and cls._standard_blocks(model))

    def image_size(self, model: nn.Module) -> tuple[int, int, int]:
        """Configured volume size (D, H, W) in voxels."""
        return tuple(model.patch_embed.img_size)

    def _grid(self, model: nn.Module) -> tuple[int, int, int]:
        return tuple(model.patch_embed.grid_size)

    def embeddings(self, model: nn.Module) -> Embeddings:
        conv = model.patch_embed.proj
        pos, cls_token, prefix = self._tokens(model)
        return Embeddings(
            patch_weight=conv.weight.detach(), patch_bias=None if conv.bias is None else conv.bias.detach(),
            pos_embed=pos, cls_token=cls_token, num_prefix_tokens=prefix, grid=self._grid(model),
            patch_size=tuple(model.patch_embed.patch_size),
        )

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        """2-D ViT weights are inflated (:func:`~vitlab.models.vit3d.inflate_2d_state`); 3-D ones get their
        input channels converted where they differ and are otherwise loaded as they are."""
        weight, target = state_dict.get(PATCH_KEY), model.patch_embed.proj.weight
        if weight is not None and weight.ndim == 4:
            return inflate_2d_state(state_dict, model)
        if weight is not None and weight.ndim == 5 and weight.shape[2:] == target.shape[2:]:
            state_dict = {**state_dict, PATCH_KEY: adapt_in_chans(weight, target.shape[1])}
        return state_dict


class TimmMixerAdapter(_TimmPlainBlocks):
    """timm ``MlpMixer`` with ``MixerBlock`` (token-mixing MLP over the transposed tokens)."""

    family = "timm-mixer"
    description = "timm MLP-Mixer (mixer_*)"
    library = "timm"
    classes = "MlpMixer"
    examples = "`mixer_s16_224`, `mixer_b16_224`"
    supports = "blocks, capture, ablate (`token_mixing` instead of `attention`), transplant, forward_until; no attention"
    mixer_name = "token_mixing"
    part_names = {"norm1": "norm1", "mixer": "mlp_tokens", "norm2": "norm2", "mlp": "mlp_channels"}
    input_conv = "stem.proj"
    embed_module = "stem"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, mlp_mixer.MlpMixer) and all(
            plain_type(block) is mlp_mixer.MixerBlock for block in model.blocks)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        grid = self._grid(model)
        return [
            BlockView(
                name=f"stage0.block{index}", stage=0, index=index, global_index=index, module=block,
                qualname=f"blocks.{index}", dim=block.norm1.normalized_shape[0], num_heads=None,
                head_dim=None, has_attention=False, window_size=None, shift_size=None, rel_pos_table=None,
                grid=grid, num_prefix_tokens=0,
            )
            for index, block in enumerate(model.blocks)
        ]

    def embeddings(self, model: nn.Module) -> Embeddings:
        return conv_embeddings(model.stem.proj, self._grid(model))

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        # (B, T, C) -> token MLP over T on (B, C, T) -> back to (B, T, C)
        return block.drop_path(block.mlp_tokens(h.transpose(1, 2)).transpose(1, 2))

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path(block.mlp_channels(h))

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["stem."], "norm": ["norm."], "head": ["head."]}

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["stem."]

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(mlp_mixer.checkpoint_filter_fn, state_dict, model)


class TimmSwinAdapter(FamilyAdapter):
    """timm ``SwinTransformer`` (v1): stages ``layers[s]`` (downsample at the stage start) of blocks."""

    family = "timm-swin"
    description = "timm SwinTransformer (swin_*)"
    library = "timm"
    classes = "SwinTransformer"
    examples = "`swin_tiny_patch4_window7_224`, `swin_base_patch4_window12_384`"
    notes = "shifted windows (`AttentionRecord.dense` scatters them to token order); rel-pos table in `BlockView`"
    part_names = {"norm1": "norm1", "mixer": "attn", "norm2": "norm2", "mlp": "mlp"}
    input_conv = "patch_embed.proj"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(model, swin_transformer.SwinTransformer)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(model.patch_embed.img_size)

    def block_views(self, model: nn.Module) -> list[BlockView]:
        views, global_index = [], 0
        for stage, layer in enumerate(model.layers):
            for index, block in enumerate(layer.blocks):
                attn = block.attn
                views.append(BlockView(
                    name=f"stage{stage}.block{index}", stage=stage, index=index, global_index=global_index,
                    module=block, qualname=f"layers.{stage}.blocks.{index}", dim=block.dim,
                    num_heads=attn.num_heads, head_dim=attn.qkv.out_features // 3 // attn.num_heads,
                    has_attention=True, window_size=_pair(block.window_size),
                    shift_size=_pair(block.shift_size), rel_pos_table=attn.relative_position_bias_table,
                    grid=_pair(block.input_resolution), num_prefix_tokens=0,
                ))
                global_index += 1
        return views

    def embeddings(self, model: nn.Module) -> Embeddings:
        return conv_embeddings(model.patch_embed.proj, _pair(model.patch_embed.grid_size))

    def mixer_branch(self, block: nn.Module, h: Tensor, **kwargs) -> Tensor:
        return block.drop_path1(block._attn(h))  # (B, H, W, C): roll, windows, attention, un-window, roll back

    def mlp_branch(self, block: nn.Module, h: Tensor) -> Tensor:
        return block.drop_path2(block.mlp(h))

    def to_mlp_layout(self, x: Tensor):
        batch, height, width, channels = x.shape
        return x.reshape(batch, -1, channels), lambda y: y.reshape(batch, height, width, channels)

    def attention_recorder(self, block: nn.Module, sink: Callable[[Tensor], None]):
        # softmax output: (B*nW, H, w*w, w*w), after the relative-position bias and the shift mask
        return _explicit_attention(block.attn, block.attn.softmax, use_output=True, sink=sink)

    def window_geometry(self, block: nn.Module, grid: tuple[int, int]):
        return _pair(block.window_size), _pair(block.shift_size), True

    def parts(self, model: nn.Module) -> dict[str, list[str]]:
        return {"patch_embed": ["patch_embed."], "norm": ["norm."], "head": ["head."]}

    def embedding_prefixes(self, model: nn.Module) -> list[str]:
        return ["patch_embed.", "absolute_pos_embed"]

    def stage_entry_prefixes(self, model: nn.Module) -> dict[str, int]:
        entries, first_block = {}, 0
        for stage, layer in enumerate(model.layers):
            entries[f"layers.{stage}.downsample."] = first_block
            first_block += len(layer.blocks)
        return entries

    def filter_state_dict(self, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
        return _timm_filter(swin_transformer.checkpoint_filter_fn, state_dict, model)
