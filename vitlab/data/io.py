"""Read one medical image file into a float32 array in [0, 1].

DICOM goes through the radiology chain: stored values -> modality LUT (Hounsfield units for CT)
-> window -> MONOCHROME1 inversion. PNG / JPEG / TIFF are scaled by the maximum of their dtype.
Everything that can go wrong with one file raises :class:`ImageReadError` with one line naming
the file and the reason; a wrong *option* (unknown preset, bad frame selector) raises a plain
``ValueError`` because it is not the file's fault and must never be skipped silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from PIL import Image, UnidentifiedImageError
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.pixels import apply_color_lut, apply_modality_lut, get_decoder, pixel_array

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

DICOM_SUFFIXES = (".dcm", ".dicom")
RASTER_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
SUPPORTED_TYPES = "'.dcm', '.dicom', DICOM without extension, " + ", ".join(
    repr(s) for s in RASTER_SUFFIXES
)

# Packages (pip names) that add a decoder for a compressed transfer syntax, by UID.
_JPEG_LS = "`pylibjpeg-libjpeg` or `pyjpegls` or `python-gdcm`"
_JPEG_LOSSLESS = "`pylibjpeg-libjpeg` or `python-gdcm`"
_JPEG_2000 = "`pylibjpeg-openjpeg` or `python-gdcm` (or Pillow built with OpenJPEG)"
DECODER_PACKAGES: dict[str, str] = {
    "1.2.840.10008.1.2.4.50": "`pillow` or `pylibjpeg-libjpeg` or `python-gdcm`",
    "1.2.840.10008.1.2.4.51": _JPEG_LOSSLESS,
    "1.2.840.10008.1.2.4.57": _JPEG_LOSSLESS,
    "1.2.840.10008.1.2.4.70": _JPEG_LOSSLESS,
    "1.2.840.10008.1.2.4.80": _JPEG_LS,
    "1.2.840.10008.1.2.4.81": _JPEG_LS,
    "1.2.840.10008.1.2.4.90": _JPEG_2000,
    "1.2.840.10008.1.2.4.91": _JPEG_2000,
    "1.2.840.10008.1.2.4.201": "`pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.4.202": "`pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.4.203": "`pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.5": "`pylibjpeg-rle` or `python-gdcm`",
}

# The only elements decoding and display need; reading just these is ~10 % faster than a full parse.
_DICOM_TAGS = [
    "PatientID", "Modality", "SamplesPerPixel", "PhotometricInterpretation", "PlanarConfiguration",
    "NumberOfFrames", "Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit",
    "PixelRepresentation", "WindowCenter", "WindowWidth", "RescaleIntercept", "RescaleSlope",
    "RescaleType", "ModalityLUTSequence", "RedPaletteColorLookupTableDescriptor",
    "GreenPaletteColorLookupTableDescriptor", "BluePaletteColorLookupTableDescriptor",
    "RedPaletteColorLookupTableData", "GreenPaletteColorLookupTableData",
    "BluePaletteColorLookupTableData", "SegmentedRedPaletteColorLookupTableData",
    "SegmentedGreenPaletteColorLookupTableData", "SegmentedBluePaletteColorLookupTableData",
    "ExtendedOffsetTable", "ExtendedOffsetTableLengths", "FloatPixelData",
    "DoubleFloatPixelData", "PixelData",
]  # fmt: skip


class ImageReadError(ValueError):
    """One image file cannot be read; the message names the file and the reason (one line)."""


class ImageNotFoundError(ImageReadError, FileNotFoundError):
    """The image file does not exist."""


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


def window_values(values: np.ndarray, center: float, width: float) -> np.ndarray:
    """Linear window ``clip((x - (c - w/2)) / w, 0, 1)`` as float32."""
    low = center - width / 2.0
    out = (np.asarray(values, dtype=np.float32) - np.float32(low)) * np.float32(1.0 / width)
    return np.clip(out, 0.0, 1.0, out=out)


def min_max(values: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] by the array's own range (a constant array gives zeros), float32."""
    values = np.asarray(values, dtype=np.float32)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return np.zeros_like(values)
    return (values - np.float32(low)) * np.float32(1.0 / (high - low))


def _dicom_error(path: str | os.PathLike, exc: Exception) -> ImageReadError:
    """One-line error for a file pydicom cannot parse."""
    if isinstance(exc, InvalidDicomError):
        return ImageReadError(f"{path}: not a DICOM file (no 'DICM' preamble and file meta header)")
    return ImageReadError(f"{path}: not a readable DICOM file ({one_line(exc)})")


def check_decodable(path: str | os.PathLike, ds: Dataset) -> None:
    """Raise :class:`ImageReadError` when no installed plugin decodes the file's transfer syntax."""
    syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if syntax is None:
        raise ImageReadError(f"{path}: DICOM file meta has no Transfer Syntax UID")
    try:
        decoder = get_decoder(syntax)
    except NotImplementedError:
        raise ImageReadError(
            f"{path}: pixel data in transfer syntax {syntax.name!r} ({syntax}) is not supported by pydicom"
        ) from None
    if not decoder.is_available:
        packages = DECODER_PACKAGES.get(str(syntax), "a pydicom decoding plugin")
        raise ImageReadError(
            f"{path}: no decoder installed for {syntax.name!r}; pip install {packages}"
        )


def dicom_header(path: str | os.PathLike) -> Dataset:
    """Read a DICOM header (no pixel data) and check that the pixels can be decoded.

    Catches from the header alone: non-DICOM files, missing pixel data, missing decoder plugins
    and truncated uncompressed pixel data (file shorter than rows x columns x frames x bytes).

    Raises:
        ImageReadError: The file is unusable, with the reason.
    """
    if not os.path.exists(path):
        raise ImageNotFoundError(f"{path}: file not found")
    try:
        with open(path, "rb") as f:
            ds = pydicom.dcmread(f, stop_before_pixels=True)
            pixel_offset = f.tell()
            file_size = os.fstat(f.fileno()).st_size
    except Exception as exc:  # pydicom raises many types for broken files
        raise _dicom_error(path, exc) from None
    if "Rows" not in ds or "Columns" not in ds or pixel_offset >= file_size:
        raise ImageReadError(f"{path}: DICOM file has no pixel data")
    check_decodable(path, ds)
    if not ds.file_meta.TransferSyntaxUID.is_compressed:
        frames = int(ds.get("NumberOfFrames") or 1)
        bits = int(ds.get("BitsAllocated") or 8)
        samples = int(ds.get("SamplesPerPixel") or 1)
        expected_bytes = (ds.Rows * ds.Columns * frames * samples * bits + 7) // 8
        if file_size - pixel_offset < expected_bytes + 8:  # + 8: the smallest element header
            raise ImageReadError(
                f"{path}: truncated pixel data ({file_size - pixel_offset} bytes left in the file, "
                f"{expected_bytes} expected)"
            )
    return ds


def _frame_index(path: str | os.PathLike, frames: str | int, count: int) -> int | None:
    """Index of the frame to decode, or None for all of them."""
    if frames == "all":
        return None
    if frames == "middle":
        return count // 2
    if not -count <= int(frames) < count:
        raise ImageReadError(f"{path}: frame {frames} out of range (the file has {count} frames)")
    return int(frames) % count


def _decode_dicom(path: str | os.PathLike, frames: str | int) -> tuple[np.ndarray, Dataset]:
    """Stored pixel values of the selected frame(s) and the header elements display needs."""
    try:
        ds = pydicom.dcmread(path, specific_tags=_DICOM_TAGS)
    except Exception as exc:  # pydicom raises many types for broken files
        raise _dicom_error(path, exc) from None
    if not any(tag in ds for tag in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
        raise ImageReadError(f"{path}: DICOM file has no pixel data")
    check_decodable(path, ds)
    count = int(ds.get("NumberOfFrames") or 1)
    index = _frame_index(path, frames, count)
    try:
        stored = pixel_array(ds, index=index)  # (H, W[, 3]), or (F, H, W[, 3]) when index is None
    except Exception as exc:
        raise ImageReadError(f"{path}: cannot decode pixel data ({one_line(exc)})") from None
    if index is None and count == 1:
        stored = stored[None]  # (1, H, W[, 3])
    return stored, ds


def _read_dicom(path: str | os.PathLike, options: ReadOptions) -> np.ndarray:
    stored, ds = _decode_dicom(path, options.frames)
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2"))
    if photometric == "PALETTE COLOR":
        rgb = apply_color_lut(stored, ds)
        lut_bits = int(ds.RedPaletteColorLookupTableDescriptor[2])
        return (rgb.astype(np.float32) / np.float32(2**lut_bits - 1)).clip(0.0, 1.0)
    if int(ds.get("SamplesPerPixel") or 1) > 1:  # RGB; YBR was converted to RGB by pixel_array
        max_value = 2 ** int(ds.get("BitsStored") or stored.dtype.itemsize * 8) - 1
        return (stored.astype(np.float32) / np.float32(max_value)).clip(0.0, 1.0)
    values = apply_modality_lut(stored, ds)  # HU for CT
    window = options.explicit_window or _tag_window(path, ds, options.window_index)
    image = min_max(values) if window is None else window_values(values, *window)
    if photometric == "MONOCHROME1":
        image = np.subtract(np.float32(1.0), image, out=image)
    return image


def _tag_window(path: str | os.PathLike, ds: Dataset, index: int) -> tuple[float, float] | None:
    """The file's own (WindowCenter, WindowWidth) number ``index``, or None without tags."""
    center, width = ds.get("WindowCenter"), ds.get("WindowWidth")
    if center is None or width is None or center == "" or width == "":
        return None
    centers = list(center) if isinstance(center, MultiValue) else [center]
    widths = list(width) if isinstance(width, MultiValue) else [width]
    if index >= min(len(centers), len(widths)):
        raise ImageReadError(
            f"{path}: window_index {index} out of range (the file lists {len(centers)} windows)"
        )
    if not float(widths[index]) > 0:
        raise ImageReadError(f"{path}: WindowWidth {widths[index]} is not positive")
    return float(centers[index]), float(widths[index])


def modality_values(path: str | os.PathLike, *, frames: str | int = "middle") -> np.ndarray:
    """Grayscale DICOM values after the modality LUT (Hounsfield units for CT), float32.

    This is :func:`read_image` stopped before windowing; useful to check windows and for probes.

    Raises:
        ImageReadError: The file is missing, unreadable or not grayscale.
    """
    if not os.path.isfile(path):
        raise ImageNotFoundError(f"{path}: file not found")
    stored, ds = _decode_dicom(path, ReadOptions(frames=frames).frames)
    if int(ds.get("SamplesPerPixel") or 1) > 1 or ds.get("PhotometricInterpretation") == "PALETTE COLOR":
        raise ImageReadError(f"{path}: colour image has no modality values")
    return np.asarray(apply_modality_lut(stored, ds), dtype=np.float32)


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
            index = _frame_index(path, options.frames, count)
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
        window: A preset name from :data:`WINDOW_PRESETS`.
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


def read_with_options(path: str | os.PathLike, options: ReadOptions) -> np.ndarray:
    """:func:`read_image` with already validated :class:`ReadOptions`."""
    if not os.path.isfile(path):
        raise ImageNotFoundError(f"{path}: file not found")
    kind = image_kind(path)
    if kind is None:
        what = repr(Path(path).suffix) if Path(path).suffix else "(no extension and no DICM preamble)"
        raise ImageReadError(f"{path}: unsupported file type {what}; supported: {SUPPORTED_TYPES}")
    reader = _read_dicom if kind == "dicom" else _read_raster
    return reader(path, options)


def header_info(path: str | os.PathLike) -> dict[str, Any]:
    """Cheap check of one file before training; returns ``{"patient_id": str | None}``.

    DICOM: :func:`dicom_header`. Raster: Pillow opens the header only (no pixel decoding).

    Raises:
        ImageReadError: The file is unusable.
    """
    if not os.path.isfile(path):
        raise ImageNotFoundError(f"{path}: file not found")
    kind = image_kind(path)
    if kind == "dicom":
        patient = str(dicom_header(path).get("PatientID", "") or "").strip()
        return {"patient_id": patient or None}
    if kind == "raster":
        try:
            with Image.open(path) as image:
                image.size  # noqa: B018 - forces the header parse
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ImageReadError(f"{path}: cannot open image ({one_line(exc)})") from None
        return {"patient_id": None}
    raise ImageReadError(f"{path}: unsupported file type; supported: {SUPPORTED_TYPES}")
