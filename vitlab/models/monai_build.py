"""MONAI's 3-D networks by name: ``monai:swin_unetr`` and ``monai:unetr``.

``build_model("monai:swin_unetr", num_classes, in_chans, **kwargs)`` is
``monai.networks.nets.SwinUNETR(in_channels=in_chans, out_channels=num_classes, **kwargs)`` and
``monai:unetr`` is ``UNETR(in_channels=in_chans, out_channels=num_classes, **kwargs)`` (which needs
``img_size``). MONAI is imported here, on the first MONAI build, and nowhere else in vitlab. MONAI's SwinUNETR
takes no input size (it pads to whole windows); vitlab takes ``img_size`` for it, checks it (every side a
multiple of ``patch_size ** 5``), and keeps it on the model as ``vitlab_img_size``: the configured size from
which :func:`vitlab.models.blocks` reports each block's token grid and window. MONAI publishes no weights
that vitlab could download, so ``pretrained=True`` fails in one line; ``weights=`` takes a local file
(see :meth:`vitlab.models.monai_families.MonaiSwinUNETRAdapter.filter_state_dict` for MONAI's
self-supervised Swin checkpoints).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vitlab.models.anatomy import check_volume_size
from vitlab.models.errors import PretrainedWeightsUnavailable

__all__ = ["MONAI_MODELS", "build_monai"]

MONAI_MODELS = ("swin_unetr", "unetr")
DEFAULT_SWIN_UNETR_SIZE = 96  # MONAI's usual region of interest


def _no_pretrained(name: str) -> PretrainedWeightsUnavailable:
    reason = "MONAI publishes no weights vitlab can download"
    error = PretrainedWeightsUnavailable(
        f"pretrained weights for {name!r} are not available ({reason}): set `model.weights: /path/to/file` (a "
        f"MONAI state dict, a SwinUNETR self-supervised swinViT checkpoint, a .safetensors file or a vitlab "
        f"checkpoint) or train from scratch with `model.pretrained: false`")
    error.reason = reason
    return error


def build_monai(name: str, arch: str, num_classes: int, in_chans: int, pretrained: bool,
                kwargs: dict[str, Any]) -> nn.Module:
    """Builds ``monai:swin_unetr`` or ``monai:unetr`` with random weights.

    Args:
        name: The full model name (for messages).
        arch: ``swin_unetr`` or ``unetr``.
        num_classes: Output channels (``out_channels``).
        in_chans: Input channels (``in_channels``).
        pretrained: Must be False (MONAI has no downloadable weights here).
        kwargs: Constructor arguments; for ``swin_unetr`` also ``img_size`` (int or (D, H, W), default 96):
            the volume size vitlab reports grids and windows for, checked against the model.

    Raises:
        PretrainedWeightsUnavailable: ``pretrained=True``.
        ValueError: an unknown name, a bad keyword argument, or a volume size the model cannot take.
        ImportError: MONAI is not installed.
    """
    if arch not in MONAI_MODELS:
        raise ValueError(f"unknown MONAI model {name!r}: use one of {', '.join('monai:' + m for m in MONAI_MODELS)}")
    if pretrained:
        raise _no_pretrained(name)
    try:
        from monai.networks.nets import UNETR, SwinUNETR
    except ImportError as error:
        raise ImportError(f"model {name!r} needs MONAI: pip install 'monai>=1.4' einops ({error})") from error
    kwargs = dict(kwargs)
    size = kwargs.pop("img_size", DEFAULT_SWIN_UNETR_SIZE) if arch == "swin_unetr" else kwargs.get("img_size")
    builder = SwinUNETR if arch == "swin_unetr" else UNETR
    try:
        model = builder(in_channels=in_chans, out_channels=num_classes, **kwargs)
    except TypeError as error:
        raise ValueError(f"bad keyword argument for MONAI model {name!r}: {error}") from error
    if size is not None:
        model.vitlab_img_size = check_volume_size(model, size)
    return model
