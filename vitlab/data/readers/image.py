"""Read one medical image file into a float32 array in [0, 1].

DICOM goes through the radiology chain in :mod:`vitlab.data.readers.dicom`; PNG / JPEG / TIFF are scaled
by the maximum of their dtype (8 or 16 bit). :func:`read_image` is the one-shot reader;
:class:`ImageReader` is the same with fixed options and a memory of DICOM headers, for datasets
that read every file once per epoch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from vitlab.data.readers.dicom import (
    NativePlan,
    dicom_header,
    finite,
    native_plan,
    read_dicom,
    read_native,
)
from vitlab.data.readers.errors import ImageNotFoundError, ImageReadError, file_errors, one_line
from vitlab.data.readers.options import ReadOptions, frame_index
from vitlab.data.readers.window import min_max

__all__ = ["SUPPORTED_TYPES", "ImageReader", "header_info", "image_kind", "read_image", "read_with_options"]

DICOM_SUFFIXES = (".dcm", ".dicom")
RASTER_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
SUPPORTED_TYPES = "'.dcm', '.dicom', DICOM without extension, " + ", ".join(repr(s) for s in RASTER_SUFFIXES)


def image_kind(path: str | os.PathLike) -> str | None:
    """``"dicom"``, ``"raster"`` or None (not an image file vitlab reads).

    Files without an extension count as DICOM only when they carry the ``DICM`` preamble.
    """
    suffix = Path(path).suffix.lower()
    if suffix in DICOM_SUFFIXES:
        return "dicom"
    if suffix in RASTER_SUFFIXES:
        return "raster"
    if suffix == "" and _has_dicm_preamble(path):
        return "dicom"
    return None


def _has_dicm_preamble(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:] == b"DICM"


def _raster_frame(image: Image.Image) -> np.ndarray:
    """The current frame of a Pillow image as float32 (H, W) or (H, W, 3) in [0, 1]."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        return np.asarray(image, dtype=np.float32) / np.float32(65535.0)
    if mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float32)
        limit = 65535.0 if mode == "I" else 1.0
        if values.min() >= 0 and values.max() <= limit:
            return values / np.float32(limit)
        return min_max(values)
    if mode in ("1", "L", "LA"):
        return np.asarray(image.convert("L"), dtype=np.float32) / np.float32(255.0)
    return np.asarray(image.convert("RGB"), dtype=np.float32) / np.float32(255.0)


def _read_raster(path: str | os.PathLike, options: ReadOptions) -> np.ndarray:
    try:
        with Image.open(path) as image:
            count = int(getattr(image, "n_frames", 1))
            index = frame_index(path, options.frames, count)
            arrays = []
            for i in range(count) if index is None else [index]:
                image.seek(i)
                arrays.append(_raster_frame(image))
    except ImageReadError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageReadError(f"{path}: cannot decode image ({one_line(exc)})") from None
    if index is None:
        if len({a.shape for a in arrays}) > 1:
            raise ImageReadError(f"{path}: frames have different shapes; read one frame at a time")
        return np.stack(arrays)  # (F, H, W[, 3])
    return arrays[0]


def read_image(
    path: str | os.PathLike,
    *,
    window: str | None = None,
    window_center: float | None = None,
    window_width: float | None = None,
    window_index: int = 0,
    frames: str | int = "middle",
) -> np.ndarray:
    """Read one image file as float32 in [0, 1].

    DICOM: stored values -> modality LUT (HU for CT) -> window ``clip((x - (c - w/2)) / w, 0, 1)``
    with the window taken from, in order: ``window_center``/``window_width``, the preset
    ``window``, the file's WindowCenter/WindowWidth (number ``window_index``), else min-max;
    MONOCHROME1 is inverted. Colour (RGB, YBR, palette) DICOM is converted to RGB and scaled by
    its bit depth; windows apply to grayscale only. PNG / JPEG / TIFF are scaled by their dtype's
    maximum (8 or 16 bit) and are not windowed.

    Args:
        path: The file.
        window: A preset name from :data:`~vitlab.data.readers.window.WINDOW_PRESETS`.
        window_center: Explicit center in modality units (HU for CT).
        window_width: Explicit width (> 0).
        window_index: Window to use when the file lists several.
        frames: ``"middle"``, ``"all"`` or a frame index, for multi-frame files.

    Returns:
        (H, W) grayscale or (H, W, 3) colour; with ``frames="all"`` (F, H, W[, 3]).

    Raises:
        ValueError: Invalid options (unknown preset etc.).
        ImageReadError: The file cannot be read (missing, unknown type, truncated, no decoder).
    """
    options = ReadOptions(window, window_center, window_width, window_index, frames)
    return read_with_options(path, options)


def _checked_kind(path: str | os.PathLike) -> str:
    """``"dicom"`` or ``"raster"``; raises for a missing file or an unsupported type."""
    if not os.path.isfile(path):
        raise ImageNotFoundError(f"{path}: file not found")
    kind = image_kind(path)
    if kind is None:
        what = repr(Path(path).suffix) if Path(path).suffix else "(no extension and no DICM preamble)"
        raise ImageReadError(f"{path}: unsupported file type {what}; supported: {SUPPORTED_TYPES}")
    return kind


def read_with_options(path: str | os.PathLike, options: ReadOptions) -> np.ndarray:
    """:func:`read_image` with already validated :class:`ReadOptions`."""
    with file_errors(path, "cannot read image"):
        reader = read_dicom if _checked_kind(path) == "dicom" else _read_raster
        return finite(path, reader(path, options))


class ImageReader:
    """:func:`read_image` with fixed options and a memory of every file's header.

    :meth:`inspect` parses a file's header once (the DataModule does it for every file at setup,
    which also finds bad files early); later reads of uncompressed grayscale DICOM are then a
    single ``np.fromfile`` of the wanted frame, bit-identical to :func:`read_image`, and other
    files skip the type check. The memory is keyed by path, mtime and size (an edited file is
    parsed again), costs a few hundred bytes per file and travels to DataLoader workers with the
    dataset, so every epoch, the first included, takes the fast path.

    Args:
        options: How files are decoded and windowed.
    """

    def __init__(self, options: ReadOptions | None = None) -> None:
        self.options = options or ReadOptions()
        self._memo: dict[str, tuple[int, int, str, NativePlan | None]] = {}

    def inspect(self, path: str | os.PathLike) -> dict[str, Any]:
        """Check one file's header (no pixel decoding), remember it, return ``{"patient_id": ...}``.

        Raises:
            ImageReadError: The file is unusable (missing, unsupported, not DICOM, truncated, no decoder).
        """
        key = os.fspath(path)
        with file_errors(key, "cannot read header"):
            kind = _checked_kind(key)
            stat = os.stat(key)
            if kind == "dicom":
                header = dicom_header(key)
                plan = native_plan(key, self.options, header)
                patient = str(header.ds.get("PatientID", "") or "").strip() or None
            else:
                plan, patient = None, _check_raster_header(key)
        self._memo[key] = (stat.st_mtime_ns, stat.st_size, kind, plan)
        return {"patient_id": patient}

    def __call__(self, path: str | os.PathLike) -> np.ndarray:
        key = os.fspath(path)
        try:
            stat = os.stat(key)
        except OSError:
            raise ImageNotFoundError(f"{path}: file not found") from None
        memo = self._memo.get(key)
        if memo is None or memo[:2] != (stat.st_mtime_ns, stat.st_size):
            self.inspect(key)
            memo = self._memo[key]
        kind, plan = memo[2], memo[3]
        with file_errors(key, "cannot read image"):
            if plan is not None:
                image = read_native(key, plan, self.options.frames)
            elif kind == "dicom":  # (inspect checked this version of the header)
                image = read_dicom(key, self.options, header_checked=True)
            else:
                image = _read_raster(key, self.options)
            return finite(key, image)  # the same last check as read_image's, whichever path read the pixels


def _check_raster_header(path: str | os.PathLike) -> None:
    """Pillow parses the header only; raises :class:`ImageReadError` when it cannot."""
    try:
        with Image.open(path) as image:
            image.size  # noqa: B018 - forces the header parse
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ImageReadError(f"{path}: cannot open image ({one_line(exc)})") from None


def header_info(path: str | os.PathLike) -> dict[str, Any]:
    """Cheap check of one file before training; returns ``{"patient_id": str | None}``.

    DICOM: :func:`~vitlab.data.readers.dicom.dicom_header` (no pixel data read). Raster: Pillow parses
    the header only. :meth:`ImageReader.inspect` does the same and remembers the result.

    Raises:
        ImageReadError: The file is unusable.
    """
    return ImageReader().inspect(path)
