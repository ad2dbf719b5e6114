"""What DINO needs to know about a backbone: its pooled (pre-logits) features and their width."""

from __future__ import annotations

from torch import Tensor, nn

from vitlab.models.adapter import unwrap_model
from vitlab.models.registry import get_adapter


def _check(model: nn.Module) -> nn.Module:
    model = unwrap_model(model)
    if not (hasattr(model, "forward_features") and hasattr(model, "forward_head")):
        raise ValueError(f"DINO needs a timm model (forward_features / forward_head); {get_adapter(model).family} is not supported yet")
    return model


def feature_dim(model: nn.Module) -> int:
    """Width of :func:`pooled_features` (timm ``num_features``)."""
    return int(_check(model).num_features)


def pooled_features(model: nn.Module, images: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, D): the pooled representation before the classifier (ViT: class token or mean of
    patch tokens per the model's ``global_pool``; Swin / Mixer: mean of the tokens), timm's ``pre_logits``."""
    model = _check(model)
    return model.forward_head(model.forward_features(images), pre_logits=True)


def drop_classifier(model: nn.Module) -> nn.Module:
    """Remove the classifier head in place (timm ``reset_classifier(0)``): the model then returns pooled features
    and its state dict holds the backbone only (fine-tuning from it gets a new head)."""
    _check(model).reset_classifier(0)
    return model
