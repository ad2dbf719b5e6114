"""Checks of the DICOM elements that decoding and display use, before any pixel is decoded.

Hospital files carry malformed values (an IS ``'1A'``, a WindowCenter ``'abc'``, a WindowWidth
``inf``, a PALETTE COLOR image without its lookup tables). Each is turned here into one
:class:`~vitlab.data.readers.errors.ImageReadError` naming the file, the element and the value, so
``on_bad_file="skip"`` skips the file instead of stopping a run; none reaches numpy as a string or
as a non-finite number. The pixel data element's header is checked here too: its declared length
against Rows x Columns x ... and against what the file holds, read in the VR encoding the file uses.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, NamedTuple

import pydicom
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.multival import MultiValue
from pydicom.tag import Tag
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from vitlab.data.readers.errors import ImageReadError

_INTEGER_TAGS = ("Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit", "PixelRepresentation",
                 "SamplesPerPixel", "NumberOfFrames", "PlanarConfiguration")  # fmt: skip
_REAL_TAGS = ("WindowCenter", "WindowWidth", "RescaleSlope", "RescaleIntercept")
_CHECKED = [(keyword, Tag(keyword), keyword in _INTEGER_TAGS) for keyword in _INTEGER_TAGS + _REAL_TAGS]
_PALETTE = ("Red", "Green", "Blue")
_ENCODING_SYNTAX = {  # pydicom's (implicit VR, little endian) of a file read with force=True
    (True, True): ImplicitVRLittleEndian,
    (False, True): ExplicitVRLittleEndian,
    (False, False): ExplicitVRBigEndian,
}


def numbers(path: str | os.PathLike, ds: Dataset, keyword: str, *, integer: bool = False, tag: Any = None) -> list[float]:
    """The element's values as finite floats ([] when absent or empty).

    Raises:
        ImageReadError: A value is not a number, not finite, or (``integer``) not whole.
    """
    tag = Tag(keyword) if tag is None else tag
    if tag not in ds:
        return []
    try:
        value = ds[tag].value
    except Exception as exc:  # pydicom converts lazily and may raise on a malformed raw value
        raise ImageReadError(f"{path}: {keyword} cannot be read ({type(exc).__name__}: {exc})") from None
    if value is None or value == "":
        return []
    if isinstance(value, int) and not isinstance(value, bool):  # US/SS (binary) values: always whole
        return [float(value)]
    out = []
    for item in list(value) if isinstance(value, (MultiValue, list, tuple)) else [value]:
        try:
            number = float(item)
        except (TypeError, ValueError):
            raise ImageReadError(f"{path}: {keyword} value {item!r} is not a number") from None
        if not math.isfinite(number):
            raise ImageReadError(f"{path}: {keyword} value {item!r} is not finite")
        if integer and not number.is_integer():
            raise ImageReadError(f"{path}: {keyword} value {item!r} is not an integer")
        out.append(number)
    return out


def check_values(path: str | os.PathLike, ds: Dataset) -> None:
    """Raise :class:`ImageReadError` for an element that decoding or display would choke on."""
    first = {}
    for keyword, tag, integer in _CHECKED:
        values = numbers(path, ds, keyword, integer=integer, tag=tag)
        if values:
            first[keyword] = int(values[0]) if integer else values[0]
    for keyword in ("Rows", "Columns", "NumberOfFrames"):
        if first.get(keyword, 1) < 1:
            raise ImageReadError(f"{path}: {keyword} {first[keyword]} is not a positive size")
    samples = first.get("SamplesPerPixel", 1)
    if samples not in (1, 3):
        raise ImageReadError(f"{path}: SamplesPerPixel {samples} is not supported (1 or 3)")
    bits = first.get("BitsAllocated", 8)
    if bits not in (1, 8, 16, 32, 64):
        raise ImageReadError(f"{path}: BitsAllocated {bits} is not one of 1, 8, 16, 32, 64")
    stored = first.get("BitsStored", bits)
    if not 1 <= stored <= bits:
        raise ImageReadError(f"{path}: BitsStored {stored} is not between 1 and BitsAllocated {bits}")
    slope, intercept = first.get("RescaleSlope", 1.0), first.get("RescaleIntercept", 0.0)
    if abs(slope) * 2.0**stored + abs(intercept) >= 3e38:
        raise ImageReadError(
            f"{path}: RescaleSlope {slope:g} / RescaleIntercept {intercept:g} overflow float32 for {stored}-bit values"
        )
    if first.get("PixelRepresentation", 0) not in (0, 1):
        raise ImageReadError(f"{path}: PixelRepresentation {first['PixelRepresentation']} is not 0 or 1")
    if str(ds.get("PhotometricInterpretation", "")).strip() == "PALETTE COLOR":
        _check_palette(path, ds)


def _check_palette(path: str | os.PathLike, ds: Dataset) -> None:
    for colour in _PALETTE:
        keyword = f"{colour}PaletteColorLookupTableDescriptor"
        descriptor = numbers(path, ds, keyword, integer=True)
        if len(descriptor) != 3:
            raise ImageReadError(f"{path}: PALETTE COLOR image without a valid {keyword} (3 numbers needed)")
        if int(descriptor[2]) not in (8, 16):
            raise ImageReadError(f"{path}: {keyword} gives {int(descriptor[2])} bits per entry (8 or 16)")
        entries = int(descriptor[0]) or 2**16  # 0 means 65536 entries
        plain, segmented = f"{colour}PaletteColorLookupTableData", f"Segmented{colour}PaletteColorLookupTableData"
        data = ds.get(plain) if plain in ds else ds.get(segmented)
        if not data:
            raise ImageReadError(f"{path}: PALETTE COLOR image without its {plain}")
        if plain in ds and len(data) < entries * (int(descriptor[2]) // 8):
            raise ImageReadError(f"{path}: {plain} holds {len(data)} bytes, {keyword} announces {entries} entries")


# ---------------------------------------------------------------- pixel data element
def pixel_bytes(ds: Dataset) -> tuple[int, str]:
    """Bytes the uncompressed pixel data must hold, and how that follows from the header (for messages)."""
    frames, samples = int(ds.get("NumberOfFrames") or 1), int(ds.get("SamplesPerPixel") or 1)
    bits = int(ds.get("BitsAllocated") or 8)
    length = (ds.Rows * ds.Columns * frames * samples * bits + 7) // 8
    formula = (f"Rows {ds.Rows} × Columns {ds.Columns} × NumberOfFrames {frames} × SamplesPerPixel {samples} "
               f"× BitsAllocated {bits} / 8")
    if str(ds.get("PhotometricInterpretation", "")) == "YBR_FULL_422":  # two of three chroma samples per pair
        length, formula = length // 3 * 2, f"{formula} × 2/3 (YBR_FULL_422)"
    return length, formula


class PixelElement(NamedTuple):
    """The pixel data element's header as written in the file."""

    tag: int  # (7FE0,0010) PixelData, (7FE0,0008) FloatPixelData or (7FE0,0009) DoubleFloatPixelData
    explicit_vr: bool  # its header is explicit VR (12 bytes) rather than implicit (8 bytes)
    length: int  # declared value length in bytes (0xFFFFFFFF: undefined)

    @property
    def header_length(self) -> int:
        return 12 if self.explicit_vr else 8


_ROWS, _COLUMNS = Tag("Rows"), Tag("Columns")
_PIXEL_TAGS = {0x7FE00010: "PixelData", 0x7FE00008: "FloatPixelData", 0x7FE00009: "DoubleFloatPixelData"}
_PIXEL_VRS = (b"OB", b"OW", b"OF", b"OD", b"UN")
_UNDEFINED_LENGTH = 0xFFFFFFFF


def read_as_implicit_vr(ds: Dataset) -> bool | None:
    """Whether pydicom read the data set as implicit VR: what it found in the file, whatever the UID says.

    (pydicom checks the first element and follows it, with a warning; its ``original_encoding`` repeats the UID.)
    Call before the elements are accessed: the raw elements carry it.
    """
    for tag in (_ROWS, _COLUMNS):
        raw = ds.get_item(tag) if tag in ds else None
        if isinstance(raw, RawDataElement):
            return bool(raw.is_implicit_VR)
    return None


def pixel_element(ds: Dataset, head: bytes, implicit_vr: bool | None) -> PixelElement | None:
    """Parse ``head``, the pixel element's first 12 bytes, in the encoding pydicom read the data set with.

    None when it is not a pixel element header in that encoding (an explicit one has VR OB / OW / OF / OD / UN
    and two zero bytes).
    """
    little = getattr(ds, "original_encoding", (None, None))[1]
    if little is None or implicit_vr is None or len(head) < 12:
        return None
    order = "<" if little else ">"
    group, element = struct.unpack(f"{order}HH", head[:4])
    tag = group << 16 | element
    if tag not in _PIXEL_TAGS or not (implicit_vr or (head[4:6] in _PIXEL_VRS and head[6:8] == b"\0\0")):
        return None
    return PixelElement(tag, not implicit_vr, struct.unpack(f"{order}I", head[4:8] if implicit_vr else head[8:12])[0])


def check_pixel_data(path: str | os.PathLike, ds: Dataset, element: PixelElement | None, left: int) -> None:
    """Refuse uncompressed pixel data the file cannot hold, from the header alone.

    ``left`` is the number of bytes from the pixel element's start to the end of the file. Refused: fewer bytes
    than Rows × Columns × … needs (a truncated file), and a declared length that is too short or runs past the end
    of the file (pydicom tried to allocate a length of 4 294 967 280 bytes, a MemoryError, while the fast path read
    the first bytes). A longer length within the file is padding, which pydicom removes (it warns).
    """
    expected, formula = pixel_bytes(ds)
    if left < expected + 8:  # + 8: the smallest element header
        raise ImageReadError(f"{path}: truncated pixel data ({left} bytes left in the file, {expected} expected)")
    if element is None or element.length == _UNDEFINED_LENGTH:
        return
    available = left - element.header_length
    if expected <= element.length <= available:
        return
    beyond = f"; the file holds {available} bytes after the element header" if element.length > available else ""
    raise ImageReadError(
        f"{path}: {_PIXEL_TAGS[element.tag]} length {element.length} does not match {formula} = {expected} bytes{beyond}"
    )


# ---------------------------------------------------------------- files without file meta
def read_forced(source: Any, **kwargs: Any) -> Dataset:
    """``pydicom.dcmread(..., force=True)`` for files without the 'DICM' preamble and file meta.

    The transfer syntax the file meta would name is the encoding pydicom detected.
    """
    ds = pydicom.dcmread(source, force=True, **kwargs)
    if not isinstance(getattr(ds, "file_meta", None), FileMetaDataset):
        ds.file_meta = FileMetaDataset()
    if "TransferSyntaxUID" not in ds.file_meta:
        syntax = _ENCODING_SYNTAX.get(tuple(getattr(ds, "original_encoding", (None, None))))
        if syntax is not None:
            ds.file_meta.TransferSyntaxUID = syntax
    return ds


def has_image_elements(ds: Dataset) -> bool:
    """True when a dataset has the elements of an image (size and pixel data)."""
    pixels = any(tag in ds for tag in ("PixelData", "FloatPixelData", "DoubleFloatPixelData"))
    return "Rows" in ds and "Columns" in ds and pixels
