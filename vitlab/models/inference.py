"""Whole-input inference of a segmenter, without Lightning: one forward pass, or MONAI's sliding window over a volume.

Training's validation / test (:meth:`vitlab.training.SegmentationModule.predict_logits`) and the probes
(``probe.py ablate`` on a 3-D segmenter) call the same function, so a probe's Dice is measured on the logits
validation measured it on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

__all__ = ["segment_logits"]

SIGMA_SCALE = 0.125  # MONAI's default: each axis's Gaussian sigma as a fraction of the window's side


def segment_logits(model: nn.Module, images: torch.Tensor, window: Optional[Sequence[int]] = None, overlap: float = 0.25,
                   sw_batch_size: int = 4) -> torch.Tensor:
    """Logits (B, K+1, *S) of ``model`` on ``images`` (B, C, *S): MONAI's ``sliding_window_inference`` (Gaussian
    weights, ``overlap`` of the window) over a volume (5-D input) when ``window`` (voxels along i, j, k) is given,
    else one forward pass."""
    if window is None or images.ndim != 5:
        return model(images)
    from monai.inferers import sliding_window_inference

    roi = tuple(int(n) for n in window)
    weights = None
    if all(n > 0 for n in roi):  # (a side <= 0 falls back to the volume's: MONAI makes that window's weights itself)
        weights = gaussian_weights(roi, images.device, images.dtype, torch.is_inference_mode_enabled())
    return sliding_window_inference(images, roi, sw_batch_size=sw_batch_size, predictor=model, overlap=overlap,
                                    mode="gaussian", sigma_scale=SIGMA_SCALE, roi_weight_map=weights)


@functools.lru_cache(maxsize=16)
def gaussian_weights(roi: tuple[int, ...], device: torch.device, dtype: torch.dtype, inference: bool) -> torch.Tensor:
    """(1, 1, *roi) Gaussian blending weights of a window: MONAI's ``compute_importance_map``, the map
    ``sliding_window_inference`` makes for each call, made once per window, device, dtype and inference mode (an
    inference tensor cannot serve autograd) and handed to it as ``roi_weight_map``. Making it reads its minimum off the
    device (``.item()``), so at every validation batch the host waited for the GPU; the values are the same."""
    from monai.data.utils import compute_importance_map

    return compute_importance_map(roi, mode="gaussian", sigma_scale=SIGMA_SCALE, device=device, dtype=dtype)[None, None]
