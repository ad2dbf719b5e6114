"""Fast array -> image rendering for TensorBoard (no matplotlib on the per-epoch hot path)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def colorize(
    matrix: torch.Tensor | np.ndarray,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    cell: int = 4,
) -> np.ndarray:
    """Map a 2-D array to an RGB image (3, H*cell, W*cell) uint8 (NaN -> grey), CHW for ``add_image``."""
    import matplotlib

    data = matrix.detach().cpu().double().numpy() if isinstance(matrix, torch.Tensor) else np.asarray(matrix, dtype=float)
    finite = np.isfinite(data)
    lo = float(np.min(data[finite])) if vmin is None and finite.any() else (vmin if vmin is not None else 0.0)
    hi = float(np.max(data[finite])) if vmax is None and finite.any() else (vmax if vmax is not None else 1.0)
    scaled = np.clip((data - lo) / (hi - lo if hi > lo else 1.0), 0.0, 1.0)
    rgb = (matplotlib.colormaps[cmap](scaled)[..., :3] * 255).astype(np.uint8)  # (H, W, 3)
    rgb[~finite] = 128
    rgb = np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def hstack_panels(panels: Sequence[np.ndarray], gap: int = 4, fill: int = 255) -> np.ndarray:
    """Place CHW uint8 panels side by side (top-aligned) with a white gap."""
    height = max(p.shape[1] for p in panels)
    parts = []
    for i, panel in enumerate(panels):
        pad = np.full((3, height, panel.shape[2]), fill, dtype=np.uint8)
        pad[:, : panel.shape[1]] = panel
        parts.append(pad)
        if i < len(panels) - 1:
            parts.append(np.full((3, height, gap), fill, dtype=np.uint8))
    return np.concatenate(parts, axis=2)


def vstack_panels(panels: Sequence[np.ndarray], gap: int = 4, fill: int = 255) -> np.ndarray:
    """Stack CHW uint8 panels vertically (left-aligned) with a white gap."""
    width = max(p.shape[2] for p in panels)
    parts = []
    for i, panel in enumerate(panels):
        pad = np.full((3, panel.shape[1], width), fill, dtype=np.uint8)
        pad[:, :, : panel.shape[2]] = panel
        parts.append(pad)
        if i < len(panels) - 1:
            parts.append(np.full((3, gap, width), fill, dtype=np.uint8))
    return np.concatenate(parts, axis=1)


def image_grid(images: torch.Tensor, ncol: int | None = None, pad: int = 2) -> np.ndarray:
    """(N, C, H, W) float images in [0, 1] -> one CHW uint8 grid (grayscale repeated to RGB)."""
    from torchvision.utils import make_grid

    images = images.detach().float().cpu().clamp(0, 1)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    grid = make_grid(images, nrow=ncol or int(np.ceil(np.sqrt(len(images)))), padding=pad, pad_value=1.0)
    return (grid * 255).round().to(torch.uint8).numpy()
