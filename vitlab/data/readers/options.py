"""How a file becomes an array: the read options every reader takes (window, frames), checked on construction,
and the frame a multi-frame file gives.

A wrong *option* raises a plain ``ValueError`` (never skipped: it is not the file's fault); a file whose frames
do not fit raises :class:`~vitlab.data.readers.errors.ImageReadError` (see :mod:`vitlab.data.readers.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vitlab.data.readers.errors import ImageReadError
from vitlab.data.readers.window import WINDOW_PRESETS, WINDOW_WIDTH_RANGE, window_width_problem


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
