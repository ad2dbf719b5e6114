"""Resampling a :class:`~vitlab.data.readers.volume.Volume` to a voxel spacing, and centred crop / pad to a grid size.

Both keep the geometry contract of :mod:`vitlab.data.readers.volume` (``array[i, j, k]`` is the voxel whose centre lies at
``affine @ [i, j, k, 1]`` in RAS+ mm) by moving the affine with the array, so a resampled or cropped volume still
places every voxel in the patient. ``data.sample: volume`` uses them to bring whole volumes to ``data.spacing`` mm
and ``data.volume_size`` voxels (docs/volumes.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.data.readers.volume import Volume

__all__ = ["crop_or_pad", "resample"]

_MODES = {"linear": "bilinear", "nearest": "nearest"}  # grid_sample's "bilinear" on 5-D input is trilinear


def resample(volume: Volume, spacing: Sequence[float], *, mode: str = "linear", fill: float | None = None) -> Volume:
    """Resample ``volume`` onto a grid of voxel spacing ``spacing`` (mm along i, j, k) over the same extent.

    The new grid keeps the axis directions (unit columns of ``affine[:3, :3]``) and the centre of voxel 0; only
    the columns are rescaled. Along each axis of ``n`` voxels of spacing ``old`` the new size is
    ``round((n - 1) * old / new) + 1`` (rounded half up): the centres span the same distance as before, to within
    half a new voxel (a single-voxel axis stays one voxel). As the directions are kept, new voxel ``v`` lies at old
    voxel coordinate ``v * new / old`` on each axis, which :func:`torch.nn.functional.grid_sample` reads with
    ``align_corners=True`` (normalised -1 and 1 are the centres of the first and last voxels).

    Args:
        volume: The volume.
        spacing: 3 positive finite voxel sizes in mm, along i, j, k.
        mode: ``"linear"`` (trilinear) for intensities, ``"nearest"`` for label maps (values stay original ones).
        fill: None replicates the edge voxels for points past the outermost voxel centres (``padding_mode
            "border"``). A number treats the volume as surrounded by voxels of that value, as scipy's
            ``mode="grid-constant"`` (a point half a voxel past an edge centre is the mean of the edge voxel and
            ``fill`` in linear mode; more than half a voxel past it is ``fill`` in nearest mode).

    Returns:
        A new :class:`Volume` (float32 array, same metadata), or ``volume`` itself when ``spacing`` equals its
        spacing to 1e-6 relative.

    Memory: computed in float32 from a float32 copy of the array; grid_sample needs a (1, I', J', K', 3) float32
    grid, 12 bytes per output voxel, built from three 1-D axes (no float64 grid); ``fill`` doubles input and output.
    """
    new = _check_spacing(spacing)
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be 'linear' or 'nearest', got {mode!r}")
    if fill is not None and not (isinstance(fill, (int, float, np.number)) and math.isfinite(fill)):
        raise ValueError(f"fill must be None or a finite number, got {fill!r}")
    old = np.asarray(volume.spacing, dtype=np.float64)
    if np.allclose(new, old, rtol=1e-6, atol=0.0):
        return volume
    ratio = new / old  # old voxel steps per new voxel step, along i, j, k
    shape = [math.floor((n - 1) * r + 0.5) + 1 for n, r in zip(volume.shape, old / new)]
    # grid_sample's grid (x, y, z) indexes (W, H, D) = (k, j, i); normalised coordinate 2 * x / (n - 1) - 1.
    axes = [
        torch.from_numpy(np.arange(m) * r * 2.0 / max(n - 1, 1) - 1.0).float()
        for m, r, n in zip(shape, ratio, volume.shape)
    ]
    i, j, k = (a.view(*(-1 if d == axis else 1 for d in range(3))).expand(shape) for axis, a in enumerate(axes))
    grid = torch.stack([k, j, i], dim=-1).unsqueeze(0)  # (1, I', J', K', 3) float32
    values = torch.from_numpy(np.ascontiguousarray(volume.array, dtype=np.float32))[None, None]
    if fill is None:
        array = F.grid_sample(values, grid, mode=_MODES[mode], padding_mode="border", align_corners=True)[0, 0]
    else:  # a channel of ones samples to the weight of the points inside; the rest goes to fill
        inside = torch.cat([values, torch.ones_like(values)], dim=1)
        out = F.grid_sample(inside, grid, mode=_MODES[mode], padding_mode="zeros", align_corners=True)[0]
        array = out[0] + (1.0 - out[1]) * float(fill)
    affine = volume.affine.copy()
    affine[:3, :3] = volume.affine[:3, :3] * ratio  # column c scaled by new / old: same direction, new spacing
    return _like(volume, array.numpy(), affine)


def crop_or_pad(volume: Volume, size: Sequence[int], *, fill: float = 0.0) -> Volume:
    """Centre-crop or pad each axis of ``volume`` to ``size`` voxels; the affine moves so every kept voxel stays put.

    An axis of ``n`` voxels padded to ``size > n`` gets ``(size - n) // 2`` voxels of ``fill`` before and the rest
    after; cropped to ``size < n`` it keeps old voxels ``(n - size) // 2`` onwards. Either way the extra voxel of
    an odd difference is added at, or removed from, the high-index end. The affine's origin becomes the world
    position of the new voxel 0 (outside the old grid when padded): ``affine @ [o, 1]`` with ``o`` the old index
    of the new voxel 0. Returns ``volume`` itself when ``size`` equals its shape; else the array keeps its dtype.
    """
    values = _three(size)
    if values is None or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in values):
        raise ValueError(f"size must be 3 positive integers (voxels along i, j, k), got {size!r}")
    size = tuple(int(s) for s in values)
    if size == volume.shape:
        return volume
    offset = [(n - s) // 2 if n >= s else -((s - n) // 2) for n, s in zip(volume.shape, size)]  # old index of new 0
    source = tuple(slice(max(o, 0), min(o + s, n)) for o, s, n in zip(offset, size, volume.shape))
    target = tuple(slice(max(-o, 0), max(-o, 0) + (sl.stop - sl.start)) for o, sl in zip(offset, source))
    array = np.full(size, fill, dtype=volume.array.dtype)
    array[target] = volume.array[source]
    affine = volume.affine.copy()
    affine[:3, 3] = volume.affine[:3, :3] @ np.asarray(offset, dtype=np.float64) + volume.affine[:3, 3]
    return _like(volume, array, affine)


def crop_at(volume: Volume, origin: Sequence[int], size: Sequence[int]) -> Volume:
    """The block of ``size`` voxels of ``volume`` whose voxel 0 is the old voxel ``origin`` (inside the grid: a
    patch, not a pad); the affine moves so every kept voxel stays put in the world."""
    origin, size = tuple(int(o) for o in origin), tuple(int(n) for n in size)
    if len(origin) != 3 or len(size) != 3 or any(o < 0 or n < 1 or o + n > m for o, n, m in zip(origin, size, volume.shape)):
        raise ValueError(f"crop_at: origin {origin} + size {size} must lie inside the volume's {volume.shape} voxels")
    array = volume.array[tuple(slice(o, o + n) for o, n in zip(origin, size))]
    affine = volume.affine.copy()
    affine[:3, 3] = volume.affine[:3, :3] @ np.asarray(origin, dtype=np.float64) + volume.affine[:3, 3]
    return _like(volume, np.ascontiguousarray(array), affine)


def _three(values) -> tuple | None:
    """``values`` as a 3-tuple (from a list, tuple, array or config list), or None when it is not 3 items."""
    if isinstance(values, (str, bytes)):
        return None
    try:
        values = tuple(values)
    except TypeError:
        return None
    return values if len(values) == 3 else None


def _check_spacing(spacing) -> np.ndarray:
    values = _three(spacing)
    try:
        values = None if values is None else np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != (3,) or not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"spacing must be 3 positive finite numbers (mm along i, j, k), got {spacing!r}")
    return values


def _like(volume: Volume, array: np.ndarray, affine: np.ndarray) -> Volume:
    return Volume(array, affine, volume.patient_id, volume.series_uid, volume.modality, volume.source)
