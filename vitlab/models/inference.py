"""Whole-input inference of a segmenter, without Lightning: one forward pass, or MONAI's sliding window over a volume.

Training's validation / test (:meth:`vitlab.training.SegmentationModule.predict_logits`) and the probes
(``probe.py ablate`` on a 3-D segmenter) call the same function, so a probe's Dice is measured on the logits
validation measured it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

__all__ = ["segment_logits"]


def segment_logits(model: nn.Module, images: torch.Tensor, window: Optional[Sequence[int]] = None, overlap: float = 0.25,
                   sw_batch_size: int = 4) -> torch.Tensor:
    """Logits (B, K+1, *S) of ``model`` on ``images`` (B, C, *S): MONAI's ``sliding_window_inference`` (Gaussian
    weights, ``overlap`` of the window) over a volume (5-D input) when ``window`` (voxels along i, j, k) is given,
    else one forward pass."""
    if window is None or images.ndim != 5:
        return model(images)
    from monai.inferers import sliding_window_inference

    return sliding_window_inference(images, tuple(int(n) for n in window), sw_batch_size=sw_batch_size, predictor=model,
                                    overlap=overlap, mode="gaussian")
