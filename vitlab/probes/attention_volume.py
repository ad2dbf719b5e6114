"""probe.py attention on 3-D models: attention of a query voxel's token drawn as three orthogonal planes through it
(axial, coronal, sagittal) over the volume, axes in mm."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch

from vitlab.analysis.attention_geometry import orthogonal_planes, query_token
from vitlab.analysis.rollout import window_query_rows

PLANES = ("axial", "coronal", "sagittal")
_PLANE_AXES = ((0, 1), (0, 2), (1, 2))  # volume axes (i, j, k) shown horizontally / vertically in each plane
_FIXED_AXIS = (2, 1, 0)  # the axis each plane holds fixed
_AXIS_NAMES = "ijk"


def query_voxel(query: Sequence[int] | None, size: Sequence[int]) -> tuple[int, int, int]:
    """``--query I J K`` checked against the model input (default: the centre voxel); one line naming the range."""
    if query is None:
        return tuple(n // 2 for n in size)  # type: ignore[return-value]
    if len(query) != 3 or any(not 0 <= int(v) < n for v, n in zip(query, size)):
        ranges = ", ".join(f"{a} in 0..{n - 1}" for a, n in zip("IJK", size))
        raise ValueError(f"--query I J K: voxel {tuple(query)} is outside the model input of {tuple(size)} voxels ({ranges})")
    return tuple(int(v) for v in query)  # type: ignore[return-value]


def query_maps(rec, view, voxel: Sequence[int], size: Sequence[int]) -> tuple[list[str], torch.Tensor, tuple[int, ...]]:
    """The attention maps a query-voxel montage draws: each head's and the head mean's attention of the query
    voxel's token to every patch token, and with prefix tokens the class token's (head mean). Swin rows come
    straight from the windows (no token x token matrix: 48^3 tokens in a 96^3 SwinUNETR's first stage).

    Args:
        rec: :class:`~vitlab.models.AttentionRecord` of the forward pass.
        view: the block (:class:`~vitlab.models.BlockView`).
        voxel: (i, j, k) query voxel of the model input.
        size: (I, J, K) model input in voxels.

    Returns:
        Row labels, (S, R, P) maps over the P patch tokens (rows of the dense form, original token order), and
        the query token's grid index.
    """
    grid, prefix = rec.grids[view.name], view.num_prefix_tokens
    token = query_token(voxel, size, grid)
    q = (token[0] * grid[1] + token[1]) * grid[2] + token[2]
    if view.window_size is not None:
        probs, slots = rec.patch_windows(view.name)  # (S*G, H, T, T), (G, T)
        rows, cls = window_query_rows(probs, slots, math.prod(grid), q), None  # (S, H, P)
    else:
        attention = rec.attentions[view.name]  # (S, H, N, N), prefix tokens first
        rows, cls = attention[:, :, prefix + q, prefix:], attention[:, :, 0, prefix:] if prefix else None
    maps = [rows, rows.mean(1, keepdim=True)]
    labels = [f"head {h}" for h in range(rows.shape[1])] + ["head mean"]
    if cls is not None:
        maps.append(cls.mean(1, keepdim=True))
        labels.append("class token (head mean)")
    return labels, torch.cat(maps, 1), token


def montage_figure(volume: torch.Tensor, maps: torch.Tensor, labels: list[str], grid: Sequence[int], token: Sequence[int],
                   voxel: Sequence[int], spacing: Sequence[float], title: str, colour_label: str = "attention weight"):
    """Rows: maps; columns: axial, coronal, sagittal slices of the volume through ``voxel`` with the map overlaid.

    Args:
        volume: (C, I, J, K) pixels in [0, 1] (channels averaged to grey).
        maps: (R, P) maps over the (gi, gj, gk) token grid.
        labels: R row labels.
        grid: token grid; token: the grid index the map planes pass through (the one holding ``voxel``).
        voxel: (i, j, k) voxel the image planes pass through, marked with a cross.
        spacing: mm per voxel along i, j, k (anisotropic voxels keep their true aspect).
        title: figure title.
        colour_label: what the colour bar measures.
    """
    grey = volume.float().mean(0).cpu()  # (I, J, K)
    size = grey.shape
    extent_mm = [n * s for n, s in zip(size, spacing)]
    images = (grey[:, :, voxel[2]], grey[:, voxel[1], :], grey[voxel[0], :, :])
    planes = orthogonal_planes(maps.double().cpu(), grid, token)  # 3 x (R, ., .)
    rows = maps.shape[0]
    height = 2.2 * rows + 1.1
    fig, axes = plt.subplots(rows, 3, figsize=(9.0, height), dpi=72, squeeze=False)  # no constrained layout: 10x slower
    fig.subplots_adjust(left=0.09, right=0.9, bottom=0.45 / height, top=1 - 0.95 / height, wspace=0.32, hspace=0.38)
    for r in range(rows):
        top = max(float(max(p[r].max() for p in planes)), 1e-12)
        for c, (image, plane) in enumerate(zip(images, planes)):
            a, b = _PLANE_AXES[c]
            ax = axes[r, c]
            extent = (0, extent_mm[a], 0, extent_mm[b])
            ax.imshow(image.T.numpy(), cmap="gray", vmin=0, vmax=1, origin="lower", extent=extent, interpolation="nearest")
            im = ax.imshow(plane[r].T.numpy(), cmap="inferno", vmin=0, vmax=top, alpha=0.6, origin="lower", extent=extent,
                           interpolation="nearest")
            ax.plot((voxel[a] + 0.5) * spacing[a], (voxel[b] + 0.5) * spacing[b], "+", color="cyan", ms=11, mew=1.6)
            ax.set_aspect("equal")
            ax.tick_params(labelsize=6)
            ax.set_xlabel(f"{_AXIS_NAMES[a]} (mm)", fontsize=7, labelpad=1)
            ax.set_ylabel(f"{labels[r]}\n{_AXIS_NAMES[b]} (mm)" if c == 0 else f"{_AXIS_NAMES[b]} (mm)", fontsize=7, labelpad=1)
            if r == 0:
                fixed = _FIXED_AXIS[c]
                ax.set_title(f"{PLANES[c]} ({_AXIS_NAMES[fixed]} = {(voxel[fixed] + 0.5) * spacing[fixed]:.1f} mm)", fontsize=8)
        box = axes[r, -1].get_position()
        bar = fig.colorbar(im, cax=fig.add_axes((0.92, box.y0, 0.012, box.height)))
        bar.set_label(colour_label, fontsize=7)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=8, y=1 - 0.08 / height, va="top")
    return fig


def montage_title(what: str, voxel: Sequence[int], token: Sequence[int], grid: Sequence[int], size: Sequence[int],
                  spacing: Sequence[float], name: str) -> str:
    token_mm = " x ".join(f"{n * s / g:.1f}" for n, s, g in zip(size, spacing, grid))
    return (f"{what}\nquery voxel {tuple(voxel)} (+) in token {tuple(token)} of grid {tuple(grid)}, tokens {token_mm} mm; "
            f"{name}")


def rollout_maps(rollout: torch.Tensor, grid: Sequence[int], prefix: int, voxel: Sequence[int], size: Sequence[int]
                 ) -> tuple[list[str], torch.Tensor, tuple[int, ...]]:
    """Rollout rows a montage draws: the class token's (with prefix tokens), else the query voxel's token's and
    the mean over all queries (the attention each token receives; :func:`~vitlab.analysis.rollout.rollout_map`).

    Args:
        rollout: (S, N, N) rollout on the grid (gi, gj, gk) with ``prefix`` prefix tokens.

    Returns:
        Row labels, (S, R, P) maps over the patch tokens, and the query token's grid index.
    """
    token = query_token(voxel, size, grid)
    if prefix:
        return ["class token"], rollout[:, 0:1, prefix:], token
    q = (token[0] * grid[1] + token[1]) * grid[2] + token[2]
    return ["query token", "mean over queries"], torch.stack([rollout[:, q], rollout.mean(1)], 1), token
