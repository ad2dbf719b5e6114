"""Tiny models of every supported family and parameter randomisation, for tests across vitlab.

Default initialisation zeroes biases and sets LayerNorm gamma = 1, which makes many identities
trivially true; :func:`randomize_parameters` redraws every parameter so tests can fail.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vitlab.models.build import build_model

__all__ = ["TINY_IMAGE_SIZE", "TINY_MODELS", "TINY_MODELS_3D", "TINY_VOLUME_SIZE", "randomize_parameters",
           "tiny_model"]

TINY_IMAGE_SIZE = 32
TINY_VOLUME_SIZE = (8, 32, 32)  # (D, H, W) voxels of the tiny 3-D models' input

# family -> (name, constructor kwargs): embed dim <= 32, 32 px images, two blocks per stage
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "timm-vit": ("vit_tiny_patch16_224",
                 dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    "timm-swin": ("swin_tiny_patch4_window7_224",
                  dict(img_size=32, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)),
    "timm-mixer": ("mixer_s16_224", dict(img_size=32, patch_size=8, embed_dim=32, num_blocks=2)),
    "torchvision-vit": ("torchvision:vit_b_16",
                        dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)),
    "torchvision-swin": ("torchvision:swin_t",
                         dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                              window_size=4)),
    "timm-swinv2": ("swinv2_tiny_window8_256",
                    dict(img_size=32, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)),
    "timm-swinv2-cr": ("swinv2_cr_tiny_224",
                       dict(img_size=32, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)),
    "torchvision-swinv2": ("torchvision:swin_v2_t",
                           dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                                window_size=4)),
    "timm-eva": ("eva02_tiny_patch14_224",
                 dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    "timm-beit": ("beit_base_patch16_224",
                  dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    "timm-vit-relpos": ("vit_relpos_small_patch16_224",
                        dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
}

# 3-D families: inputs (B, C, *TINY_VOLUME_SIZE). Kept apart from TINY_MODELS, whose tests feed 2-D images.
# The 3-D ViT is the 2-D "timm-vit" over (4, 8, 8) voxel patches (grid (2, 4, 4)), pooled without a class
# token (the variant inflation keeps exact, docs/models.md); ``class_token=True, global_pool="token"`` adds one.
TINY_MODELS_3D: dict[str, tuple[str, dict[str, Any]]] = {
    "timm-vit3d": ("vit3d:vit_tiny_patch16_224",
                   dict(img_size=TINY_VOLUME_SIZE, patch_size=(4, 8, 8), embed_dim=32, depth=2, num_heads=2,
                        global_pool="avg", class_token=False)),
}


def tiny_model(family: str, num_classes: int = 3, in_chans: int = 3, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny model of ``family`` (a key of :data:`TINY_MODELS` or :data:`TINY_MODELS_3D`) with all parameters
    randomised, in eval mode.

    Args:
        family: e.g. ``"timm-vit"``, ``"timm-vit3d"``.
        num_classes: Classifier outputs.
        in_chans: Image channels.
        seed: Seed for the parameter draw.
        **overrides: Replace constructor kwargs (e.g. ``init_values=0.1`` for timm LayerScale).
    """
    known = {**TINY_MODELS, **TINY_MODELS_3D}
    if family not in known:
        raise ValueError(f"unknown tiny model family {family!r}: choose from {sorted(known)}")
    name, kwargs = known[family]
    model = build_model(name, num_classes, in_chans=in_chans, **{**kwargs, **overrides})
    return randomize_parameters(model, seed).eval()


@torch.no_grad()
def randomize_parameters(model: nn.Module, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Redraws every parameter: weights/biases ~ N(0, scale^2); 1-d norm weights ~ 1 + N(0, scale^2).

    Returns:
        ``model`` (modified in place).
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param)
        is_norm_weight = param.ndim == 1 and name.endswith("weight")
        is_gamma = name.endswith(".gamma")  # timm LayerScale
        param.copy_((1.0 if is_norm_weight else 0.0) + scale * noise if not is_gamma else 0.5 + scale * noise)
    return model
