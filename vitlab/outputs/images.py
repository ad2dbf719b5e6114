"""Images as TensorBoard's ``add_image`` takes them: a grid of images in one CHW uint8 array."""

from __future__ import annotations

import numpy as np
import torch


def image_grid(images: torch.Tensor, ncol: int | None = None, pad: int = 2) -> np.ndarray:
    """(N, C, H, W) float images in [0, 1] -> one CHW uint8 grid (grayscale repeated to RGB)."""
    from torchvision.utils import make_grid

    images = images.detach().float().cpu().clamp(0, 1)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    grid = make_grid(images, nrow=ncol or int(np.ceil(np.sqrt(len(images)))), padding=pad, pad_value=1.0)
    return (grid * 255).round().to(torch.uint8).numpy()
