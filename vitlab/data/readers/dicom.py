"""DICOM: header checks, the radiology display chain, and a fast path for uncompressed files.

Display chain (pydicom 3): stored values -> ``apply_modality_lut`` (Hounsfield units for CT) ->
window ``clip((x - (c - w/2)) / w, 0, 1)`` -> ``1 - x`` for MONOCHROME1 -> float32. Colour
(RGB, YBR, palette) is converted to RGB and scaled by its bit depth.

Fast path: the first read of a file parses its header once into a :class:`NativePlan` (where
the pixel bytes start, their dtype, rescale and window); later reads of uncompressed
little-endian grayscale files are a single ``np.fromfile`` of the wanted frame, with results
identical to pydicom's decoding. Anything else (compressed, big endian, colour, modality LUT
sequences, float pixels, a Transfer Syntax UID that misnames the file's VR encoding, a pixel
length that is not certain) always takes pydicom's decoder.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.pixels import apply_color_lut, apply_modality_lut, get_decoder, pixel_array
from pydicom.tag import BaseTag, Tag

from vitlab.data.readers import codecs
from vitlab.data.readers.dicom_checks import (
    PixelElement,
    check_pixel_data,
    check_values,
    has_image_elements,
    pixel_element,
    read_as_implicit_vr,
    read_forced,
)
from vitlab.data.readers.errors import ImageNotFoundError, ImageReadError, one_line
from vitlab.data.readers.options import ReadOptions, frame_index
from vitlab.data.readers.window import min_max, window_values, window_width_problem

# Packages (pip names) that add a decoder for a compressed transfer syntax, by UID. vitlab installs
# pylibjpeg-openjpeg, pyjpegls and imagecodecs (see docs/dicom.md), so
# these show only when one was removed or has no wheel for the platform.
_JPEG_LS = "`pyjpegls`"
_JPEG_LOSSLESS = "`imagecodecs`"
_JPEG_2000 = "`pylibjpeg pylibjpeg-openjpeg`"
DECODER_PACKAGES: dict[str, str] = {
    "1.2.840.10008.1.2.4.50": "`pillow`",
    "1.2.840.10008.1.2.4.51": "`imagecodecs` (12-bit) or `pillow` (8-bit)",
    "1.2.840.10008.1.2.4.57": _JPEG_LOSSLESS,
    "1.2.840.10008.1.2.4.70": _JPEG_LOSSLESS,
    "1.2.840.10008.1.2.4.80": _JPEG_LS,
    "1.2.840.10008.1.2.4.81": _JPEG_LS,
    "1.2.840.10008.1.2.4.90": _JPEG_2000,
    "1.2.840.10008.1.2.4.91": _JPEG_2000,
    "1.2.840.10008.1.2.4.201": "`pylibjpeg pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.4.202": "`pylibjpeg pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.4.203": "`pylibjpeg pylibjpeg-openjpeg`",
    "1.2.840.10008.1.2.5": "`pylibjpeg-rle` (pydicom's own RLE decoder is built in)",
}

# The only elements decoding and display need (as tags: keyword lookups cost ~0.2 ms per file).
_DICOM_TAGS = [Tag(keyword) for keyword in (
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
)]  # fmt: skip
_NATIVE_LITTLE_ENDIAN = {"1.2.840.10008.1.2": False, "1.2.840.10008.1.2.1": True}  # UID -> explicit VR
_PIXEL_DATA = Tag(0x7FE00010)
_DEFLATED = "1.2.840.10008.1.2.1.99"  # pixel offsets in the file mean nothing: read whole
_NOT_DICOM = "not a DICOM file (no 'DICM' preamble and file meta header)"
codecs.register()  # 12-bit JPEG Extended, JPEG Lossless (see vitlab.data.readers.codecs)


def _dicom_error(path: str | os.PathLike, exc: Exception) -> ImageReadError:
    """One-line error for a file pydicom cannot parse."""
    if isinstance(exc, InvalidDicomError):
        return ImageReadError(f"{path}: {_NOT_DICOM}")
    return ImageReadError(f"{path}: not a readable DICOM file ({one_line(exc)})")


def check_decodable(path: str | os.PathLike, ds: Dataset) -> None:
    """Raise :class:`ImageReadError` when no installed plugin decodes the file's transfer syntax."""
    syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if syntax is None:
        raise ImageReadError(f"{path}: DICOM file meta has no Transfer Syntax UID")
    try:
        decoder = get_decoder(syntax)
    except NotImplementedError:
        raise ImageReadError(f"{path}: transfer syntax {syntax.name!r} ({syntax}) is not supported") from None
    if not decoder.is_available:
        packages = DECODER_PACKAGES.get(str(syntax), "a pydicom decoding plugin")
        raise ImageReadError(f"{path}: no decoder installed for {syntax.name!r}; pip install {packages}")


def _read_without_preamble(
    path: str | os.PathLike, source: Any, *, stop_before_pixels: bool = False, tags: list[BaseTag] = _DICOM_TAGS
) -> Dataset:
    """A file without 'DICM' preamble and file meta, read with ``force=True``, when it holds an image.

    Raises:
        ImageReadError: "not a DICOM file" when pydicom finds no image elements in it.
    """
    try:
        ds = read_forced(source, stop_before_pixels=stop_before_pixels, specific_tags=tags)
    except Exception:  # noqa: BLE001 - any failure here means the file is not DICOM
        ds = None
    if ds is None or "Rows" not in ds or "Columns" not in ds or not (stop_before_pixels or has_image_elements(ds)):
        raise ImageReadError(f"{path}: {_NOT_DICOM}")
    return ds


# One plugin per syntax: GDCM's wheel (when installed) aborts the whole process with an uncaught C++
# exception on some malformed J2K and JPEG streams, and pydicom's default tries every plugin in turn.
_PLUGIN_BY_SYNTAX = {
    "1.2.840.10008.1.2.4.50": "pillow",
    "1.2.840.10008.1.2.4.57": codecs.LABEL,
    "1.2.840.10008.1.2.4.70": codecs.LABEL,
    "1.2.840.10008.1.2.4.80": "pyjpegls",
    "1.2.840.10008.1.2.4.81": "pyjpegls",
    **dict.fromkeys(("1.2.840.10008.1.2.4.90", "1.2.840.10008.1.2.4.91", "1.2.840.10008.1.2.4.201",
                     "1.2.840.10008.1.2.4.202", "1.2.840.10008.1.2.4.203"), "pylibjpeg"),
}  # fmt: skip


def decoding_plugin(ds: Dataset) -> str:
    """pydicom's ``decoding_plugin`` for this file ("" lets pydicom choose)."""
    syntax = str(ds.file_meta.get("TransferSyntaxUID", ""))
    if syntax == "1.2.840.10008.1.2.4.51":
        label = codecs.LABEL if int(ds.get("BitsStored") or 8) > 8 else "pillow"
    else:
        label = _PLUGIN_BY_SYNTAX.get(syntax, "")
    try:
        return label if label and label in get_decoder(syntax).available_plugins else ""
    except NotImplementedError:
        return ""


class DicomHeader(NamedTuple):
    """What one pass over a DICOM header yields (pixel data not read)."""

    ds: Dataset  # the elements display needs
    pixel_offset: int  # byte offset of the pixel data element
    file_size: int
    pixel: PixelElement | None  # its header as pydicom reads it (None: deflated, or not a pixel element header)


def dicom_header(path: str | os.PathLike, extra_tags: Sequence[BaseTag] = ()) -> DicomHeader:
    """Read a DICOM header (no pixel data) and check that the pixels can be decoded.

    Catches from the header alone: non-DICOM files, missing pixel data, missing decoder plugins,
    truncated uncompressed pixel data (fewer bytes left than rows x columns x frames needs) and a
    declared PixelData length that is too short or runs past the end of the file. :func:`read_dicom`
    and :class:`~vitlab.data.readers.image.ImageReader` both start here, so they refuse the same files alike.
    ``extra_tags`` are read into ``ds`` too (the volume reader's geometry), in the same pass.

    Raises:
        ImageReadError: The file is unusable, with the reason.
    """
    if not os.path.isfile(path):
        raise ImageNotFoundError(f"{path}: file not found")
    tags = _DICOM_TAGS + list(extra_tags) if extra_tags else _DICOM_TAGS
    try:
        with open(path, "rb") as f:
            try:
                ds = pydicom.dcmread(f, stop_before_pixels=True, specific_tags=tags)
            except InvalidDicomError:  # no preamble: an image only if pydicom finds one with force=True
                f.seek(0)
                ds = _read_without_preamble(path, f, stop_before_pixels=True, tags=tags)
            implicit_vr = read_as_implicit_vr(ds)
            pixel_offset = f.tell()
            head = f.read(12)
            file_size = os.fstat(f.fileno()).st_size
        if str(ds.file_meta.get("TransferSyntaxUID", "")) == _DEFLATED:  # offsets are in the inflated stream
            ds = pydicom.dcmread(path, specific_tags=tags)
            pixel_offset, head = (0, b"") if has_image_elements(ds) else (file_size, b"")
    except ImageReadError:
        raise
    except Exception as exc:  # pydicom raises many types for broken files
        raise _dicom_error(path, exc) from None
    if "Rows" not in ds or "Columns" not in ds or pixel_offset >= file_size:
        raise ImageReadError(f"{path}: DICOM file has no pixel data")
    check_values(path, ds)
    check_decodable(path, ds)
    pixel = pixel_element(ds, head, implicit_vr)  # (head is b"" for deflated files: None)
    if not ds.file_meta.TransferSyntaxUID.is_compressed and head:
        check_pixel_data(path, ds, pixel, file_size - pixel_offset)
    return DicomHeader(ds, pixel_offset, file_size, pixel)


def decode(path: str | os.PathLike, frames: str | int, *, header_checked: bool = False) -> tuple[np.ndarray, Dataset]:
    """Stored values of the selected frame(s) via pydicom, and the header elements display needs.

    Args:
        path: The file.
        frames: Frame selector (see :func:`~vitlab.data.readers.options.frame_index`).
        header_checked: :func:`dicom_header` already passed on this version of the file (the reader's memory
            says so); otherwise it runs first, so that a file is refused alike by every reader and before pydicom
            reads a pixel length that the file cannot hold.

    Returns:
        (H, W[, 3]) for one frame, (F, H, W[, 3]) for ``frames="all"``; the dataset.
    """
    if not header_checked:
        dicom_header(path)
    try:
        try:
            ds = pydicom.dcmread(path, specific_tags=_DICOM_TAGS)
        except InvalidDicomError:  # no preamble: see dicom_header
            ds = _read_without_preamble(path, path)
    except ImageReadError:
        raise
    except Exception as exc:  # pydicom raises many types for broken files
        raise _dicom_error(path, exc) from None
    if not any(tag in ds for tag in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
        raise ImageReadError(f"{path}: DICOM file has no pixel data")
    count = int(ds.get("NumberOfFrames") or 1)
    index = frame_index(path, frames, count)
    try:
        stored = pixel_array(ds, index=index, decoding_plugin=decoding_plugin(ds))
    except Exception as exc:
        raise ImageReadError(f"{path}: cannot decode pixel data ({one_line(exc)})") from None
    if index is None and count == 1:
        stored = stored[None]  # (1, H, W[, 3])
    return stored, ds


def _tag_window(path: str | os.PathLike, ds: Dataset, index: int) -> tuple[float, float] | None:
    """The file's own (WindowCenter, WindowWidth) number ``index``, or None without tags."""
    center, width = ds.get("WindowCenter"), ds.get("WindowWidth")
    if center is None or width is None or center == "" or width == "":
        return None
    centers = list(center) if isinstance(center, MultiValue) else [center]
    widths = list(width) if isinstance(width, MultiValue) else [width]
    if index >= min(len(centers), len(widths)):
        raise ImageReadError(f"{path}: window_index {index} out of range (the file lists {len(centers)} windows)")
    problem = window_width_problem(float(widths[index]))
    if problem:
        raise ImageReadError(f"{path}: WindowWidth {widths[index]} {problem}")
    return float(centers[index]), float(widths[index])


def _display(
    values: np.ndarray, window: tuple[float, float] | None, monochrome1: bool, *, reuse: bool = False
) -> np.ndarray:
    """Modality values -> float32 [0, 1]: window (min-max without one), inverted for MONOCHROME1.

    ``reuse`` lets a float32 ``values`` array be overwritten.
    """
    out = values if reuse and values.dtype == np.float32 else None
    image = min_max(values) if window is None else window_values(values, *window, out=out)
    return np.subtract(np.float32(1.0), image, out=image) if monochrome1 else image  # both stay in [0, 1]


def read_dicom(path: str | os.PathLike, options: ReadOptions, *, header_checked: bool = False) -> np.ndarray:
    """One DICOM file as float32 [0, 1] through pydicom's decoders (see the module docstring and :func:`decode`)."""
    stored, ds = decode(path, options.frames, header_checked=header_checked)
    try:
        image = _display_dataset(path, stored, ds, options)
    except ImageReadError:
        raise
    except Exception as exc:  # a malformed element that the header checks let through
        raise ImageReadError(f"{path}: cannot display pixel data ({type(exc).__name__}: {one_line(exc)})") from None
    return finite(path, image)


def _display_dataset(path: str | os.PathLike, stored: np.ndarray, ds: Dataset, options: ReadOptions) -> np.ndarray:
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2"))
    if photometric == "PALETTE COLOR":
        lut_bits = int(ds.RedPaletteColorLookupTableDescriptor[2])
        rgb = apply_color_lut(stored, _palette_in_native_order(ds))  # (..., 3)
        return (rgb.astype(np.float32) / np.float32(2**lut_bits - 1)).clip(0.0, 1.0)
    if int(ds.get("SamplesPerPixel") or 1) > 1:  # RGB; YBR was converted to RGB by pixel_array
        max_value = 2 ** int(ds.get("BitsStored") or stored.dtype.itemsize * 8) - 1
        return (stored.astype(np.float32) / np.float32(max_value)).clip(0.0, 1.0)
    window = options.explicit_window or _tag_window(path, ds, options.window_index)
    return _display(apply_modality_lut(stored, ds), window, photometric == "MONOCHROME1")


def _palette_in_native_order(ds: Dataset) -> Dataset:
    """``ds``'s palette with 16-bit lookup-table data in this machine's byte order, for ``apply_color_lut``.

    pydicom (3.0) reads non-segmented (OW) lookup-table data with ``np.frombuffer`` in the machine's order whatever
    the file's: an Explicit VR Big Endian palette image came out byte-swapped, nearly black. Segmented tables are
    unpacked in the file's order by pydicom itself and are left as they are.
    """
    little = getattr(ds, "original_encoding", (None, None))[1]  # how pydicom read the file
    if little is None:
        little = ds.file_meta.TransferSyntaxUID.is_little_endian
    if little == (sys.byteorder == "little") or "RedPaletteColorLookupTableData" not in ds:
        return ds
    palette = Dataset()
    for colour in ("Red", "Green", "Blue"):
        descriptor = ds[f"{colour}PaletteColorLookupTableDescriptor"].value
        data = ds[f"{colour}PaletteColorLookupTableData"].value
        if len(data) == 2 * (int(descriptor[0]) or 2**16):  # 16 bits per entry (8-bit entries have no order)
            data = np.frombuffer(data, dtype="<u2" if little else ">u2").astype("=u2").tobytes()
        setattr(palette, f"{colour}PaletteColorLookupTableDescriptor", descriptor)
        setattr(palette, f"{colour}PaletteColorLookupTableData", data)
    return palette


def finite(path: str | os.PathLike, image: np.ndarray) -> np.ndarray:
    """``image`` when every value is finite; else :class:`ImageReadError` (nothing non-finite reaches a batch)."""
    if image.size and not np.isfinite(image).all():
        raise ImageReadError(
            f"{path}: non-finite (NaN or infinite) pixel values after rescale and window; "
            "check its pixel data and RescaleSlope/RescaleIntercept"
        )
    return image


def modality_values(path: str | os.PathLike, *, frames: str | int = "middle") -> np.ndarray:
    """Grayscale DICOM values after the modality LUT (Hounsfield units for CT), float32.

    This is :func:`vitlab.data.read_image` stopped before windowing.

    Raises:
        ImageReadError: The file is missing, unreadable or not grayscale.
    """
    stored, ds = decode(path, ReadOptions(frames=frames).frames)
    if int(ds.get("SamplesPerPixel") or 1) > 1 or ds.get("PhotometricInterpretation") == "PALETTE COLOR":
        raise ImageReadError(f"{path}: colour image has no modality values")
    return np.asarray(apply_modality_lut(stored, ds), dtype=np.float32)


# ---------------------------------------------------------------- fast path
@dataclass(frozen=True)
class NativePlan:
    """How to read and display an uncompressed little-endian grayscale file without pydicom.

    Args:
        offset: Byte offset of the first pixel value.
        dtype: NumPy dtype of the stored values (little endian).
        frames: Number of frames.
        rows: Rows per frame.
        columns: Columns per frame.
        unused_bits: BitsAllocated - BitsStored (shifted out as pydicom does).
        rescale: (slope, intercept) when both tags are present (applied in float64 like pydicom).
        window: Resolved (center, width), or None for min-max.
        monochrome1: Invert after windowing.
    """

    offset: int
    dtype: str
    frames: int
    rows: int
    columns: int
    unused_bits: int
    rescale: tuple[float, float] | None
    window: tuple[float, float] | None
    monochrome1: bool


def native_plan(path: str | os.PathLike, options: ReadOptions, header: DicomHeader | None = None) -> NativePlan | None:
    """A plan when the fast path applies to this file, else None.

    Args:
        path: The file.
        options: Read options (the window is resolved into the plan).
        header: The file's :func:`dicom_header`, when already read.

    Raises:
        ImageReadError: The header check of :func:`dicom_header` fails.
    """
    ds, element_offset, file_size, element = header or dicom_header(path)
    explicit_vr = _NATIVE_LITTLE_ENDIAN.get(str(ds.file_meta.TransferSyntaxUID))
    if (
        explicit_vr is None
        or element is None
        or element.tag != _PIXEL_DATA
        or element.explicit_vr != explicit_vr  # the UID misnames the encoding: pydicom's reading is the certain one
        or ds.get("ModalityLUTSequence")
    ):
        return None
    bits, stored_bits = int(ds.get("BitsAllocated") or 0), int(ds.get("BitsStored") or 0)
    photometric = str(ds.get("PhotometricInterpretation", ""))
    if (
        int(ds.get("SamplesPerPixel") or 1) != 1
        or photometric not in ("MONOCHROME1", "MONOCHROME2")
        or bits not in (8, 16, 32)
        or not 0 < stored_bits <= bits
    ):
        return None
    header_length = element.header_length
    frames, rows, columns = int(ds.get("NumberOfFrames") or 1), int(ds.Rows), int(ds.Columns)
    expected = frames * rows * columns * bits // 8
    if not expected <= element.length <= file_size - element_offset - header_length:  # (undefined length too)
        return None
    slope, intercept = ds.get("RescaleSlope"), ds.get("RescaleIntercept")
    has_rescale = "RescaleSlope" in ds and "RescaleIntercept" in ds
    if has_rescale and (slope is None or intercept is None):
        return None
    return NativePlan(
        offset=element_offset + header_length,
        dtype=f"<{'i' if int(ds.get('PixelRepresentation') or 0) else 'u'}{bits // 8}",
        frames=frames,
        rows=rows,
        columns=columns,
        unused_bits=bits - stored_bits,
        rescale=(float(slope), float(intercept)) if has_rescale else None,
        window=options.explicit_window or _tag_window(path, ds, options.window_index),
        monochrome1=photometric == "MONOCHROME1",
    )


def read_native(path: str | os.PathLike, plan: NativePlan, frames: str | int) -> np.ndarray:
    """Read the selected frame(s) with one ``np.fromfile``; equal to :func:`read_dicom`'s result.

    Not checked for non-finite values: :class:`~vitlab.data.readers.image.ImageReader` checks every path's result alike.
    """
    return _display(native_values(path, plan, frames), plan.window, plan.monochrome1, reuse=True)


def native_values(path: str | os.PathLike, plan: NativePlan, frames: str | int) -> np.ndarray:
    """The selected frame(s) after the modality rescale, with one ``np.fromfile`` (no window).

    Equal to pydicom's ``apply_modality_lut`` of the decoded pixels: float32 where that is exact (integer
    rescale of small integers), else float64 as pydicom computes it; the stored integers when the file has
    no rescale.
    """
    index = frame_index(path, frames, plan.frames)
    frame_values = plan.rows * plan.columns
    dtype = np.dtype(plan.dtype)
    count = frame_values * (plan.frames if index is None else 1)
    offset = plan.offset + (0 if index is None else index * frame_values * dtype.itemsize)
    try:
        stored = np.fromfile(path, dtype=dtype, count=count, offset=offset)
    except OSError as exc:
        raise ImageReadError(f"{path}: cannot read pixel data ({one_line(exc)})") from None
    if stored.size != count:
        raise ImageReadError(f"{path}: truncated pixel data (file changed since its header was read)")
    shape = (plan.rows, plan.columns) if index is not None else (plan.frames, plan.rows, plan.columns)
    stored = stored.reshape(shape)
    if plan.unused_bits:
        np.left_shift(stored, plan.unused_bits, out=stored)
        np.right_shift(stored, plan.unused_bits, out=stored)
    if plan.rescale is None:
        return stored
    slope, intercept = plan.rescale
    # float32 is exact (hence identical to pydicom's float64) for integer rescale of small integers
    largest = 2 ** (8 * dtype.itemsize) * abs(slope) + abs(intercept)
    exact = slope.is_integer() and intercept.is_integer() and largest < 2**24
    values = stored.astype(np.float32 if exact else np.float64)
    values *= slope
    values += intercept
    return values
