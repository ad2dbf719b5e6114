"""Read options, window arithmetic and the error type shared by every image reader.

A problem with one *file* raises :class:`ImageReadError` (one line naming the file and the
reason), which ``on_bad_file="skip"`` may skip; a wrong *option* (unknown preset, bad frame
selector) raises a plain ``ValueError`` because it is not the file's fault and must never be skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class ImageReadError(ValueError):
    """One image file cannot be read; the message names the file and the reason (one line)."""


class ImageNotFoundError(ImageReadError, FileNotFoundError):
    """The image file does not exist."""


class VolumeError(ImageReadError):
    """A volume (NIfTI file, DICOM series folder, multi-frame DICOM file) cannot be read as one; the message
    names the file or folder, what is wrong and what would be valid (one line)."""


@dataclass(frozen=True)
class ReadOptions:
    """How to turn a file into an array; validated on construction.

    Args:
        window: Name of a preset in :data:`WINDOW_PRESETS`, or None.
        window_center: Explicit window center (modality units, e.g. HU); needs ``window_width``.
        window_width: Explicit window width (> 0).
        window_index: Which window to use when a file lists several in its tags.
        frames: ``"middle"``, ``"all"`` or a frame index (negative counts from the end).
    """

    window: str | None = None
    window_center: float | None = None
    window_width: float | None = None
    window_index: int = 0
    frames: str | int = "middle"

    def __post_init__(self) -> None:
        if self.window is not None and self.window not in WINDOW_PRESETS:
            raise ValueError(
                f"unknown window preset {self.window!r}; valid presets: {', '.join(WINDOW_PRESETS)}"
            )
        if (self.window_center is None) != (self.window_width is None):
            raise ValueError("window_center and window_width must be given together")
        if self.window_center is not None and self.window is not None:
            raise ValueError(
                f"give either window={self.window!r} or window_center/window_width, not both"
            )
        if self.window_width is not None and not self.window_width > 0:
            raise ValueError(f"window_width must be > 0, got {self.window_width}")
        if self.window_width is not None and window_width_problem(self.window_width):
            low, high = WINDOW_WIDTH_RANGE
            raise ValueError(f"window_width must be between {low:g} and {high:g}, got {self.window_width}")
        if isinstance(self.window_index, bool) or not isinstance(self.window_index, int):
            raise ValueError(f"window_index must be an int, got {self.window_index!r}")
        if self.window_index < 0:
            raise ValueError(f"window_index must be >= 0, got {self.window_index}")
        frames_ok = self.frames in ("middle", "all") or (
            isinstance(self.frames, int) and not isinstance(self.frames, bool)
        )
        if not frames_ok:
            raise ValueError(f"frames must be 'middle', 'all' or an int, got {self.frames!r}")

    @property
    def explicit_window(self) -> tuple[float, float] | None:
        """The (center, width) fixed by the options, or None to use the file's own tags."""
        if self.window is not None:
            return WINDOW_PRESETS[self.window]
        if self.window_center is not None:
            return float(self.window_center), float(self.window_width)  # type: ignore[arg-type]
        return None


def one_line(exc: BaseException) -> str:
    """An exception's message collapsed to one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


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


def frame_index(path: object, frames: str | int, count: int) -> int | None:
    """Index of the frame to decode among ``count``, or None for all of them.

    Raises:
        ImageReadError: An integer ``frames`` outside the file's frames.
    """
    if frames == "all":
        return None
    if frames == "middle":
        return count // 2
    if not -count <= int(frames) < count:
        raise ImageReadError(f"{path}: frame {frames} out of range (the file has {count} frames)")
    return int(frames) % count
