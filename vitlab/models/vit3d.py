"""The 3-D ViT: timm's ``VisionTransformer`` over volumes, with a Conv3d patch embedding (docs/models.md).

A volume (B, C, D, H, W) is cut into (pd, p, p) voxel patches by :class:`PatchEmbed3d`; its tokens come in
(d, h, w) raster order, token ``z * (h * w) + i * w + j`` being the patch at depth ``z``, row ``i``, column
``j`` of the (d, h, w) patch grid. The position embedding is timm's own learned one, (1, prefix + d*h*w, C),
and the blocks are timm's unchanged, so every Q/K/V view, recording and ablation of the 2-D ViT applies: a
block is a block. Its family adapter, :class:`vitlab.models.timm_families.Timm3DViTAdapter`, differs from the
2-D ViT's only in the grid (three numbers in ``BlockView.grid``), the input embedding and the weight
conversion. This module holds the layers and the conversion and imports no family module.

:func:`inflate_2d_state` turns 2-D ViT weights into weights of a 3-D ViT (the patch kernel divided by the
patch depth and repeated over it, the position embedding repeated over the depth grid). For a ViT without a
class token a volume of identical slices then gives exactly the 2-D model's output on that slice; the
adapter applies it whenever :func:`vitlab.models.load_weights` meets a 2-D patch kernel, so 2-D files,
vitlab checkpoints of 2-D models and timm's 2-D pretrained weights all load into a 3-D ViT.

Built with ``build_model("vit3d:<timm ViT name>", num_classes, img_size=(D, H, W), patch_size=(pd, p, p),
...)``; directly, ``VisionTransformer(embed_layer=PatchEmbed3d, img_size=(D, H, W), patch_size=(pd, p, p),
...)`` works too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.models import adapt_input_conv

from vitlab.models.adapter import unwrap_model
from vitlab.models.errors import WeightsMismatchError

__all__ = ["PatchEmbed3d", "adapt_in_chans", "in_plane_sizes", "inflate_2d_state"]

PATCH_KEY = "patch_embed.proj.weight"
Size3 = Union[int, Sequence[int]]


def _triple(value: Size3, what: str) -> tuple[int, int, int]:
    """An int (a cube) or a 3-sequence -> (d, h, w) of positive ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * 3
    try:
        triple = tuple(int(item) for item in value)
    except (TypeError, ValueError):
        triple = ()
    if len(triple) != 3 or min(triple) < 1:
        raise ValueError(f"3-D ViT {what} must be an int or (depth, height, width), got {value!r}")
    return triple  # type: ignore[return-value]


class PatchEmbed3d(nn.Module):
    """Volume to tokens: a Conv3d with kernel = stride = the patch, flattened in (d, h, w) raster order.

    Takes the arguments timm's ``VisionTransformer`` gives its ``embed_layer``. Inputs must have the
    configured size (the position embedding is fixed): ``dynamic_img_size`` and ``dynamic_img_pad`` are
    refused.

    Args:
        img_size: Volume size (D, H, W) in voxels, or one int for a cube.
        patch_size: Patch size (pd, ph, pw) in voxels, or one int; must divide ``img_size``.
        in_chans: Input channels.
        embed_dim: Token width C.
        norm_layer: Optional norm applied to the tokens (timm's ``embed_norm_layer``).
        flatten: Must stay True (tokens are (B, N, C)).
        output_fmt: Must stay None (timm asks for NHWC only with ``dynamic_img_size``).
        bias: Conv bias.
        strict_img_size: Must stay True.
        dynamic_img_pad: Must stay False.

    Attributes:
        img_size, patch_size, grid_size: (D, H, W), (pd, ph, pw) and the token grid (d, h, w).
        num_patches: d * h * w.
    """

    def __init__(self, img_size: Size3 = 224, patch_size: Size3 = 16, in_chans: int = 3, embed_dim: int = 768,
                 norm_layer: Optional[Callable[..., nn.Module]] = None, flatten: bool = True,
                 output_fmt: Optional[str] = None, bias: bool = True, strict_img_size: bool = True,
                 dynamic_img_pad: bool = False, device=None, dtype=None):
        super().__init__()
        if not flatten or output_fmt is not None or not strict_img_size or dynamic_img_pad:
            raise ValueError("the 3-D ViT takes volumes of its configured img_size only: dynamic_img_size, "
                             "dynamic_img_pad and other token layouts are not supported")
        self.img_size = _triple(img_size, "img_size")
        self.patch_size = _triple(patch_size, "patch_size")
        if any(size % patch for size, patch in zip(self.img_size, self.patch_size)):
            raise ValueError(f"3-D ViT patch_size {self.patch_size} must divide img_size {self.img_size}")
        self.grid_size = tuple(size // patch for size, patch in zip(self.img_size, self.patch_size))
        self.num_patches = math.prod(self.grid_size)
        self.flatten = True
        self.strict_img_size = True
        self.dynamic_img_pad = False
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias,
                              device=device, dtype=dtype)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    @classmethod
    def sized(cls, img_size: Size3, patch_size: Size3) -> Callable[..., "PatchEmbed3d"]:
        """An ``embed_layer`` that keeps this volume and patch size whatever 2-D sizes timm passes it
        (``timm.create_model`` checks ``img_size`` as (H, W), so the 3-D sizes travel here instead)."""
        return functools.partial(_sized_patch_embed, _triple(img_size, "img_size"), _triple(patch_size, "patch_size"))

    def feat_ratio(self, as_scalar: bool = True) -> Union[int, tuple[int, int, int]]:
        """Voxels per token along each axis (timm's feature reduction; the largest when ``as_scalar``)."""
        return max(self.patch_size) if as_scalar else self.patch_size

    def forward(self, x: Tensor) -> Tensor:  # (B, C, D, H, W) -> (B, d*h*w, C)
        if x.ndim != 5 or tuple(x.shape[2:]) != self.img_size:
            raise ValueError(f"the 3-D ViT expects volumes (B, C, {', '.join(map(str, self.img_size))}), "
                             f"got {tuple(x.shape)}")
        x = self.proj(x)  # (B, C, d, h, w)
        return self.norm(x.flatten(2).transpose(1, 2))  # (B, d*h*w, C), index z*h*w + i*w + j


def _sized_patch_embed(volume_size: tuple[int, int, int], volume_patch: tuple[int, int, int], /, **kwargs
                       ) -> PatchEmbed3d:
    """:meth:`PatchEmbed3d.sized`'s factory (module level, so models pickle): drops timm's 2-D sizes."""
    kwargs.pop("img_size", None)
    kwargs.pop("patch_size", None)
    return PatchEmbed3d(volume_size, volume_patch, **kwargs)


def in_plane_sizes(img_size: Size3, patch_size: Size3) -> dict[str, tuple[int, int]]:
    """``img_size`` (H, W) and ``patch_size`` (ph, pw) of the 2-D ViT whose weights a 3-D ViT of these sizes
    inflates without resampling (its slice-wise twin)."""
    volume, patch = _triple(img_size, "img_size"), _triple(patch_size, "patch_size")
    return dict(img_size=volume[1:], patch_size=patch[1:])


# ---- inflation --------------------------------------------------------------------------------------

def adapt_in_chans(weight: Tensor, in_chans: int) -> Tensor:
    """A 2-D (C, in, p, p) or 3-D (C, in, pd, p, p) patch kernel converted to ``in_chans`` input channels as
    timm does (1 channel: the filters summed; more: repeated and rescaled)."""
    if weight.shape[1] == in_chans:
        return weight
    if weight.ndim == 5:  # fold depth into height: the conversion acts on the channel axis only
        out, _, depth, height, width = weight.shape
        flat = adapt_input_conv(in_chans, weight.reshape(out, -1, depth * height, width), base_chans=weight.shape[1])
        return flat.reshape(out, in_chans, depth, height, width)
    return adapt_input_conv(in_chans, weight, base_chans=weight.shape[1])


def _prefix_rows(state: Mapping[str, Tensor], model: nn.Module) -> int:
    """Prefix-token rows of the file's position embedding (class / register tokens, unless the model's
    variant adds the position embedding to the patch tokens only)."""
    if getattr(model, "no_embed_class", False):
        return 0
    registers = state.get("reg_token")
    return int("cls_token" in state) + (int(registers.shape[1]) if registers is not None else 0)


def _inflate_pos_embed(pos: Tensor, state: Mapping[str, Tensor], model: nn.Module) -> Tensor:
    """(1, prefix + h2*w2, C) -> (1, prefix + d*h*w, C): resampled to the model's (h, w), tiled over depth."""
    depth, height, width = model.patch_embed.grid_size
    prefix = _prefix_rows(state, model)
    patches = pos.shape[1] - prefix
    side = math.isqrt(max(patches, 0))
    if patches == height * width:
        old = (height, width)
    elif patches > 0 and side * side == patches:
        old = (side, side)
    else:
        raise WeightsMismatchError(f"2-D pos_embed {tuple(pos.shape)} holds {patches} patch positions after "
                                   f"{prefix} prefix tokens: no (h, w) grid to inflate to the 3-D model's "
                                   f"(d, h, w) = {(depth, height, width)}")
    if old != (height, width):
        pos = resample_abs_pos_embed(pos, new_size=[height, width], old_size=list(old), num_prefix_tokens=prefix)
    # token z*h*w + k of the volume takes the slice's position k, at every depth z
    return torch.cat([pos[:, :prefix], pos[:, prefix:].repeat(1, depth, 1)], dim=1)  # (1, prefix + d*h*w, C)


def _check_width_and_depth(state: Mapping[str, Tensor], model: nn.Module, weight: Tensor) -> None:
    """One-line errors for the mismatches inflation cannot bridge: token width and number of blocks."""
    target = model.patch_embed.proj.weight
    if weight.shape[0] != target.shape[0]:
        raise WeightsMismatchError(f"2-D weights of embed dim {weight.shape[0]} ({PATCH_KEY} {tuple(weight.shape)}) "
                                   f"do not inflate into this 3-D ViT of embed dim {target.shape[0]} "
                                   f"({PATCH_KEY} {tuple(target.shape)})")
    blocks_in_file = {int(key.split(".")[1]) for key in state if key.startswith("blocks.") and key.split(".")[1].isdigit()}
    if blocks_in_file and len(blocks_in_file) != len(model.blocks):
        raise WeightsMismatchError(f"2-D weights with {len(blocks_in_file)} blocks (blocks.0 ... "
                                   f"blocks.{max(blocks_in_file)}) do not inflate into this 3-D ViT of depth "
                                   f"{len(model.blocks)} (blocks.0 ... blocks.{len(model.blocks) - 1})")


def inflate_2d_state(state_2d: Mapping[str, Tensor], model_3d: nn.Module) -> dict[str, Tensor]:
    """Weights of a 2-D timm ViT as weights of the 3-D ViT ``model_3d``.

    The patch kernel W2 (C, in, p, p) becomes W3 (C, in, pd, p, p) = W2 / pd repeated over the patch depth
    pd, so a patch of identical slices embeds as the 2-D patch does; the 2-D position embedding (1, prefix +
    h*w, C) is repeated over the depth grid (token z*h*w + k takes position k at every depth z; the prefix
    tokens' rows are kept). With no class token (average pooling) a volume of identical slices then gives
    the 3-D model exactly the 2-D model's output on that slice: every key is repeated d times, which leaves
    each softmax-weighted average unchanged. A class token's own key is not repeated, so with one the
    identity does not hold. Where the 2-D model differs, the kernel is resampled to the model's in-plane
    patch (timm's ``resample_patch_embed``), converted to its input channels (as for grayscale 2-D models)
    and the position embedding resampled to its (h, w) grid (``resample_abs_pos_embed``). Other keys are
    copied; a state without a 2-D patch kernel is returned as it is.

    Args:
        state_2d: A timm ViT state dict (plain keys, e.g. ``read_state_dict`` of a timm file).
        model_3d: A 3-D ViT (:class:`PatchEmbed3d` patch embedding).

    Returns:
        A new state dict for ``model_3d`` (the tensors not converted are shared with ``state_2d``).

    Raises:
        ValueError: ``model_3d`` is not a 3-D ViT. WeightsMismatchError: the embed dim or the number of
            blocks differs, or the position embedding has no (h, w) grid.
    """
    model = unwrap_model(model_3d)
    if not isinstance(getattr(model, "patch_embed", None), PatchEmbed3d):
        raise ValueError(f"inflate_2d_state needs a 3-D ViT (PatchEmbed3d patch embedding), got "
                         f"{type(model).__name__}")
    state = dict(state_2d)
    weight = state.get(PATCH_KEY)
    if weight is None or weight.ndim != 4:
        return state
    _check_width_and_depth(state, model, weight)
    embed = model.patch_embed
    depth, height, width = embed.patch_size
    if tuple(weight.shape[-2:]) != (height, width):
        weight = resample_patch_embed(weight, [height, width])
    weight = adapt_in_chans(weight, embed.proj.in_channels)
    state[PATCH_KEY] = (weight / depth).unsqueeze(2).repeat(1, 1, depth, 1, 1)  # (C, in, pd, p, p)
    if state.get("pos_embed") is not None and model.pos_embed is not None:
        state["pos_embed"] = _inflate_pos_embed(state["pos_embed"], state, model)
    return state
