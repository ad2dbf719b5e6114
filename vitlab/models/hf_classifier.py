"""The ``nn.Module`` vitlab wraps a Hugging Face ``transformers`` image classifier in, and its model types.

Split from :mod:`vitlab.models.hf_build` so that the Hugging Face family adapters
(:mod:`vitlab.models.hf_families`) can recognise an :class:`HFClassifier` without importing the builder
(which loads weights through the registry that lists those adapters). This module imports ``transformers``
only inside :func:`require_transformers`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["HF_MODEL_TYPES", "HFClassifier", "require_transformers"]

# model type -> (classification class, forward kwargs, default image mean/std)
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HF_MODEL_TYPES: dict[str, tuple[str, dict[str, Any], tuple]] = {
    "vit": ("ViTForImageClassification", {"interpolate_pos_encoding": True}, ((0.5,) * 3, (0.5,) * 3)),
    "dinov2": ("Dinov2ForImageClassification", {}, _IMAGENET),
    "dinov2_with_registers": ("Dinov2WithRegistersForImageClassification", {}, _IMAGENET),
    "swin": ("SwinForImageClassification", {"interpolate_pos_encoding": True}, _IMAGENET),
}
_NO_DECAY = {"position_embeddings", "cls_token", "register_tokens", "mask_token", "relative_position_bias_table"}
_INSTALL_HINT = 'Hugging Face models need the optional extra: pip install -e ".[hf]" (installs transformers)'


def require_transformers():
    """Imports ``transformers`` or raises one clear ImportError naming the extra to install."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"{_INSTALL_HINT}; import failed: {error}") from None
    return transformers


class HFClassifier(nn.Module):
    """A ``transformers`` ``*ForImageClassification`` model with a ``(B, C, H, W) -> (B, classes)`` forward.

    Attributes:
        hf: The library model (``hf.save_pretrained(folder)`` writes a folder that ``weights:`` reads back).
        pretrained_cfg: ``{"mean", "std"}`` of the model's image processor (read by
            :func:`vitlab.models.normalization`).
    """

    def __init__(self, hf_model: nn.Module, mean=None, std=None):
        super().__init__()
        self.hf = hf_model
        model_type = hf_model.config.model_type
        _, self._forward_kwargs, (default_mean, default_std) = HF_MODEL_TYPES[model_type]
        self.pretrained_cfg = {"mean": tuple(mean or default_mean), "std": tuple(std or default_std)}
        for name, param in self.named_parameters():
            if name.endswith("mask_token"):  # masked-image pretraining only: no gradient here (DDP-safe)
                param.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.hf(pixel_values=x, **self._forward_kwargs).logits

    def no_weight_decay(self) -> set[str]:
        """Position embeddings, class/register/mask tokens and Swin bias tables (read by parameter_groups)."""
        return {name for name, _ in self.named_parameters() if name.rsplit(".", 1)[-1] in _NO_DECAY}
