"""Window arithmetic: the radiology presets, the linear window, min-max scaling, and the values volumes give models.

Every function is float32 in, float32 out, and exact where clipping meets rounding (``min_max`` never returns
1.0000001). The window of a DICOM file's own tags is resolved in :mod:`vitlab.data.readers.dicom`.
"""

from __future__ import annotations

import numpy as np

# Standard radiology windows (center, width) in Hounsfield units.
WINDOW_PRESETS: dict[str, tuple[float, float]] = {
    "brain": (40.0, 80.0),
    "subdural": (80.0, 200.0),
    "stroke": (40.0, 40.0),
    "lung": (-600.0, 1500.0),
    "mediastinum": (50.0, 350.0),
    "soft_tissue": (50.0, 400.0),
    "liver": (60.0, 160.0),
    "bone": (400.0, 1800.0),
}


# Window widths whose float32 arithmetic stays finite: 1 / width and width / 2 must be normal float32 numbers
# (a width of 1e-300 made 1 / width infinite and 0 x inf = NaN pixels); real windows are far inside.
WINDOW_WIDTH_RANGE = (1e-30, 1e30)


def window_width_problem(width: float) -> str | None:
    """Why ``width`` cannot be a window width ("is not positive", "is outside ..."), or None when it can."""
    if not width > 0:
        return "is not positive"
    low, high = WINDOW_WIDTH_RANGE
    if not low <= width <= high:
        return f"is outside the usable range {low:g} to {high:g}"
    return None


def window_values(values: np.ndarray, center: float, width: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """Linear window ``clip((x - (c - w/2)) / w, 0, 1)`` computed in float32.

    Args:
        values: Modality values (e.g. HU), any real dtype.
        center: Window center.
        width: Window width (> 0).
        out: Optional float32 array of the same shape to write into (may be ``values`` itself).
    """
    out = np.subtract(values, np.float32(center - width / 2.0), out=out, dtype=np.float32, casting="same_kind")
    np.multiply(out, np.float32(1.0 / width), out=out)
    return np.clip(out, 0.0, 1.0, out=out)


def min_max(values: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] by the array's own range (a constant array gives zeros), float32, clipped exactly."""
    values = np.asarray(values, dtype=np.float32)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return np.zeros_like(values)
    out = (values - np.float32(low)) * np.float32(1.0 / (high - low))
    return np.clip(out, 0.0, 1.0, out=out)  # rounding can give 1.0000001


def intensities(hu: np.ndarray, window: tuple[float, float] | None, intensity: str) -> np.ndarray:
    """Modality values -> model values (float32): the window (explicit / preset; else the volume's min-max) to
    [0, 1]; ``percentile``: clipped to the 0.5-99.5 percentiles of the non-zero voxels, scaled to [0, 1];
    ``zscore``: (x - mean) / std of the non-zero voxels (not clipped)."""
    if intensity == "window":
        return min_max(hu) if window is None else window_values(hu, *window)
    body = hu[hu != 0]
    body = body if body.size else hu.ravel()
    if intensity == "percentile":
        low, high = np.percentile(body, [0.5, 99.5])
        if high <= low:
            return np.zeros_like(hu, dtype=np.float32)
        return np.clip((hu - np.float32(low)) / np.float32(high - low), 0.0, 1.0).astype(np.float32)
    mean, std = float(body.mean()), float(body.std())
    return ((hu - np.float32(mean)) / np.float32(std if std > 0 else 1.0)).astype(np.float32)
