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

Building a SwinUNETR also makes MONAI's shifted-window attention masks once per grid instead of at every forward
(:func:`install_window_mask_cache`): the same masks, 13 % fewer operations for the host to dispatch a training step.
And it checks the input size with integers instead of MONAI's numpy arrays (:func:`install_input_check`): the same
sizes refused with the same message, and ``torch.compile`` sees the network as one graph instead of breaking it at
the check.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from vitlab.models.anatomy import check_volume_size
from vitlab.models.errors import PretrainedWeightsUnavailable

__all__ = ["MASK_CACHE_BYTES", "MONAI_MODELS", "build_monai", "cached_window_masks", "install_input_check",
           "install_window_mask_cache"]

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
    if arch == "swin_unetr":
        install_window_mask_cache()
        install_input_check()
    return model


MASK_CACHE_BYTES = 512 * 2**20  # the masks kept, all devices together (a SwinUNETR at 96^3 with 7^3 windows: 195 MB)


def cached_window_masks(compute: Callable, budget: int = MASK_CACHE_BYTES) -> Callable:
    """``compute`` (MONAI's ``swin_unetr.compute_mask(dims, window_size, shift_size, device)``) made once per
    argument set and then handed out again.

    MONAI's ``BasicLayer.forward`` builds its stage's shifted-window attention mask at every forward: a zero volume
    of the padded grid, one indexed fill per region (27 in 3-D), a window partition and two masked fills, about 140
    host operations a stage, 564 of the 2,667 of the network's forward and backward. The mask is a
    constant of the grid, the window and the shift (-100 between tokens of different regions, 0 elsewhere), so the
    one made first is returned to every later call with the same arguments, on the same device, with the same
    default dtype and inference mode: the same values, so the network computes the same numbers. MONAI's layers
    only read it (added to the attention logits or folded into SDPA's bias).

    The masks are kept least recently used first out, up to ``budget`` bytes in all (a larger one is made every
    time, as before). While ``torch.compile`` traces (the compiler folds the mask into its graph) or a CUDA graph
    is being captured (a tensor made there belongs to the graph's memory pool), ``compute`` is called as before.
    The original is ``__wrapped__``; the kept masks are ``.masks``.
    """
    masks: OrderedDict = OrderedDict()
    held = [0]
    lock = threading.Lock()

    @functools.wraps(compute)
    def compute_mask(dims, window_size, shift_size, device):
        device = torch.device(device)
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return compute(dims, window_size, shift_size, device)
        key = (tuple(int(side) for side in dims), tuple(int(side) for side in window_size),
               tuple(int(step) for step in shift_size), device, torch.get_default_dtype(),
               torch.is_inference_mode_enabled())
        with lock:
            mask = masks.get(key)
            if mask is not None:
                masks.move_to_end(key)
                return mask
        mask = compute(dims, window_size, shift_size, device)
        size = mask.numel() * mask.element_size()
        if size <= budget:
            with lock:
                if key not in masks:
                    masks[key] = mask
                    held[0] += size
                while held[0] > budget:
                    _, old = masks.popitem(last=False)
                    held[0] -= old.numel() * old.element_size()
        return mask

    compute_mask.masks = masks
    return compute_mask


def install_window_mask_cache() -> None:
    """Puts :func:`cached_window_masks` in the place of MONAI's ``swin_unetr.compute_mask``, once a process (every
    SwinUNETR of the process then shares the kept masks; ``compute_mask.__wrapped__`` is MONAI's own)."""
    from monai.networks.nets import swin_unetr

    if not hasattr(swin_unetr.compute_mask, "masks"):
        swin_unetr.compute_mask = cached_window_masks(swin_unetr.compute_mask)


def install_input_check() -> None:
    """Puts an integer check in the place of MONAI's ``SwinUNETR._check_input_size``, once a process. MONAI's tests
    the spatial sides with numpy arrays, whose data-dependent ``if`` makes dynamo break the graph there (before the
    network: a compiled SwinUNETR was two graphs per mode). The same sides are refused with the same message
    (``_check_input_size.__wrapped__`` is MONAI's own)."""
    from monai.networks.nets import swin_unetr

    cls = swin_unetr.SwinUNETR
    if hasattr(cls._check_input_size, "__wrapped__"):
        return
    monai_check = cls._check_input_size

    @torch.jit.unused
    def _check_input_size(self, spatial_shape):
        wrong_dims = [axis + 2 for axis, side in enumerate(spatial_shape) if int(side) % self.patch_size**5]
        if wrong_dims:
            raise ValueError(f"spatial dimensions {wrong_dims} of input image (spatial shape: {spatial_shape})"
                             f" must be divisible by {self.patch_size}**5.")

    _check_input_size.__wrapped__ = monai_check
    cls._check_input_size = _check_input_size
