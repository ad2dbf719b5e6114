"""The data module's reader and ``read_image`` are one function over a generated corpus of broken DICOM.

:class:`~vitlab.data.readers.image.ImageReader` reads uncompressed little-endian grayscale files with one ``np.fromfile``
(the fast path) and everything else through pydicom like ``read_image``. Over every file of the corpus (small,
≤ 32 px, generated here with pydicom and then damaged the way devices and tools damage files) both must give the
same array, bit for bit, or the same one-line :class:`ImageReadError`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    RLELossless,
    generate_uid,
)

from vitlab.data import ImageReader, ImageReadError, ReadOptions, read_image
from vitlab.data.readers.image import header_info

SYNTAXES = {  # transfer syntax -> (implicit VR, little endian) of the data set
    ExplicitVRLittleEndian: (False, True),
    ImplicitVRLittleEndian: (True, True),
    ExplicitVRBigEndian: (False, False),
}


# ---------------------------------------------------------------- intact files
def image_dataset(kind: str, rng: np.random.Generator, *, bits: int = 16, signed: bool = False, frames: int = 1,
                  size: tuple[int, int] = (12, 10), stored: int | None = None) -> Dataset:
    """A small valid image data set (no file meta): ``kind`` is gray, mono1, rgb or palette."""
    ds = Dataset()
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.7"
    ds.SOPInstanceUID = generate_uid()
    ds.PatientID, ds.Modality = "FUZZ", "OT"
    ds.Rows, ds.Columns = size
    samples = 3 if kind == "rgb" else 1
    bits = 8 if kind == "rgb" else bits
    stored = bits if stored is None else stored
    ds.SamplesPerPixel, ds.BitsAllocated, ds.BitsStored, ds.HighBit = samples, bits, stored, stored - 1
    ds.PixelRepresentation = int(signed and kind in ("gray", "mono1"))
    ds.PhotometricInterpretation = {"gray": "MONOCHROME2", "mono1": "MONOCHROME1", "rgb": "RGB",
                                    "palette": "PALETTE COLOR"}[kind]  # fmt: skip
    if samples == 3:
        ds.PlanarConfiguration = 0
    if frames > 1:
        ds.NumberOfFrames = frames
    shape = (frames, *size, samples)
    if kind == "palette":
        entries = 64
        values = rng.integers(0, entries, shape)
        for colour, scale in (("Red", 1000), ("Green", 700), ("Blue", 300)):
            lut = (np.arange(entries) * scale + rng.integers(0, 50, entries)).astype("<u2")
            setattr(ds, f"{colour}PaletteColorLookupTableDescriptor", [entries, 0, 16])
            setattr(ds, f"{colour}PaletteColorLookupTableData", lut.tobytes())
    else:
        low, high = (-(2 ** (stored - 1)), 2 ** (stored - 1)) if ds.PixelRepresentation else (0, 2**stored)
        values = rng.integers(low, high, shape)
    dtype = f"<{'i' if ds.PixelRepresentation else 'u'}{bits // 8}"
    ds.PixelData = values.astype(dtype).tobytes()
    return ds


def save(ds: Dataset, path: Path, syntax: str = ExplicitVRLittleEndian, *, body: str | None = None) -> Path:
    """Write ``ds`` with file meta naming ``syntax``; ``body`` encodes the data set in another syntax (a lie).

    Native pixel bytes and palette tables are little endian in ``ds`` and are swapped for a big-endian body, as a
    big-endian writer stores them (pydicom writes OB / OW values as they are).
    """
    ds = copy.deepcopy(ds)
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.file_meta.TransferSyntaxUID = syntax
    ds.preamble = b"\0" * 128
    encoding = body or syntax
    if encoding == ExplicitVRBigEndian:
        bits = int(ds.BitsAllocated)
        if bits in (16, 32, 64) and len(ds.PixelData) % (bits // 8) == 0:
            ds.PixelData = np.frombuffer(ds.PixelData, f"<u{bits // 8}").astype(f">u{bits // 8}").tobytes()
        for colour in ("Red", "Green", "Blue"):
            keyword = f"{colour}PaletteColorLookupTableData"
            if keyword in ds:
                ds[keyword].value = np.frombuffer(ds[keyword].value, "<u2").astype(">u2").tobytes()
    if encoding in SYNTAXES:
        implicit, little = SYNTAXES[encoding]
        pydicom.dcmwrite(path, ds, implicit_vr=implicit, little_endian=little, force_encoding=True)
    else:
        ds.save_as(path, enforce_file_format=True)
    return path


def pixel_length_at(data: bytes) -> tuple[int, int, str]:
    """(offset of the pixel element's length field, its size in bytes, byte order) in a saved little- or big-endian file."""
    found = [(data.find(tag, 132), order) for tag, order in ((b"\xe0\x7f\x10\x00", "<"), (b"\x7f\xe0\x00\x10", ">"))]
    at, order = min((at, order) for at, order in found if at > 0)  # the first: the element, not pixel bytes
    explicit = data[at + 4 : at + 6] in (b"OB", b"OW")
    return (at + 8, 4, order) if explicit else (at + 4, 4, order)


def with_pixel_length(path: Path, length: int | Callable[[int], int], *, extra: bytes = b"") -> Path:
    """Rewrite the declared PixelData length (``length(old)`` when callable); ``extra`` is appended to the file."""
    data = bytearray(path.read_bytes())
    at, size, order = pixel_length_at(bytes(data))
    old = struct.unpack(f"{order}I", data[at : at + size])[0]
    data[at : at + size] = struct.pack(f"{order}I", length(old) if callable(length) else length)
    path.write_bytes(bytes(data) + extra)
    return path


# ---------------------------------------------------------------- the corpus
TEXT_MUTATIONS = {  # element -> raw values written as text, the way broken devices write them
    "WindowWidth": ("1e-300", "0", "-5", "nan", "inf", "1e300", "1e-38", "1e-30", "1e30", "abc", "", "40\\1e-300"),
    "WindowCenter": ("1e300", "-1e300", "nan", "1e38", "x"),
    "RescaleSlope": ("1e-300", "0", "-1", "1e30", "0.37", "nan", ""),
    "RescaleIntercept": ("1e300", "-1024", "1e30", "inf", "0.5"),
    "NumberOfFrames": ("0", "2", "3", "abc", "1A", "-1"),
}
SIZE_MUTATIONS = {
    "Rows": (0, 1, 11, 13, 64, 65535),
    "Columns": (0, 9, 11, 64),
    "BitsAllocated": (1, 8, 12, 16, 32, 64),
    "BitsStored": (0, 1, 7, 12, 17, 33),
    "HighBit": (0, 7, 40),
    "PixelRepresentation": (0, 1, 2),
    "SamplesPerPixel": (0, 1, 2, 3, 4),
    "PlanarConfiguration": (0, 1, 2),
}
PHOTOMETRIC = ("MONOCHROME1", "MONOCHROME2", "RGB", "PALETTE COLOR", "YBR_FULL", "YBR_FULL_422", "XYZ", "")
LENGTHS = {  # declared PixelData length, from the true one
    "huge": lambda n: 0xFFFFFFF0,
    "undefined": lambda n: 0xFFFFFFFF,
    "zero": lambda n: 0,
    "short by 2": lambda n: n - 2,
    "long by 2": lambda n: n + 2,
    "long by 200": lambda n: n + 200,
    "odd": lambda n: n + 1,
}


def at_centre(ds: Dataset, stored: int) -> None:
    """Set the first row of a 16-bit image to ``stored``: pixels on the window centre, where a width of 1e-300
    once gave 0 x inf = NaN (elsewhere it gives ±inf, which the clip to [0, 1] hides)."""
    values = np.frombuffer(ds.PixelData, f"<{'i' if ds.PixelRepresentation else 'u'}2").copy().reshape(ds.Rows, -1)
    values[0] = stored
    ds.PixelData = values.tobytes()


def base_datasets(rng: np.random.Generator) -> list[tuple[str, Dataset, str]]:
    """(name, data set, transfer syntax) of the intact files the mutants start from."""
    bases = []
    for bits, signed, stored in ((8, False, 8), (16, False, 12), (16, True, 16), (16, True, 12), (32, False, 20)):
        ds = image_dataset("gray", rng, bits=bits, signed=signed, stored=stored)
        if signed:  # a window and no rescale: integers straight into the window
            ds.WindowCenter, ds.WindowWidth = 0, 1000
            at_centre(ds, 0)
        bases.append((f"gray{bits}{'s' if signed else 'u'}{stored}", ds, ExplicitVRLittleEndian))
    ct = image_dataset("gray", rng, signed=True, stored=12)
    ct.Modality, ct.RescaleSlope, ct.RescaleIntercept = "CT", 1, -1024
    ct.WindowCenter, ct.WindowWidth = 40, 400
    at_centre(ct, 40 + 1024)
    bases.append(("ct", ct, ExplicitVRLittleEndian))
    bases.append(("ct_implicit", ct, ImplicitVRLittleEndian))
    bases.append(("ct_bigendian", ct, ExplicitVRBigEndian))
    bases.append(("ct_rle", ct, RLELossless))
    bases.append(("ct_deflated", ct, DeflatedExplicitVRLittleEndian))
    mono1 = image_dataset("mono1", rng, frames=3)
    mono1.RescaleSlope, mono1.RescaleIntercept = 0.37, -100.25
    bases.append(("mono1_3frames", mono1, ExplicitVRLittleEndian))
    windows = image_dataset("gray", rng, bits=16, stored=10)
    windows.WindowCenter, windows.WindowWidth = [300, 600], [200, 900]
    at_centre(windows, 300)
    bases.append(("two_windows", windows, ImplicitVRLittleEndian))
    bases.append(("rgb", image_dataset("rgb", rng), ExplicitVRLittleEndian))
    bases.append(("palette", image_dataset("palette", rng, bits=8), ExplicitVRLittleEndian))
    bases.append(("palette_bigendian", image_dataset("palette", rng, bits=8), ExplicitVRBigEndian))
    return bases


def write_raw(ds: Dataset, path: Path, syntax: str, texts: dict[str, str]) -> Path:
    """Save with DS/IS elements holding raw text (written as LO, the VR bytes then set to the dictionary's)."""
    from pydicom.datadict import dictionary_VR
    from pydicom.dataelem import DataElement
    from pydicom.tag import Tag

    for keyword, text in texts.items():
        ds[Tag(keyword)] = DataElement(Tag(keyword), "LO", text)
    save(ds, path, syntax)
    implicit, little = SYNTAXES.get(syntax, (False, True))
    if texts and not implicit and syntax != DeflatedExplicitVRLittleEndian:
        data = bytearray(path.read_bytes())
        order = "<" if little else ">"
        for keyword in texts:
            tag = Tag(keyword)
            at = data.index(struct.pack(f"{order}HH", tag.group, tag.element) + b"LO", 132)
            data[at + 4 : at + 6] = dictionary_VR(keyword).encode()
        path.write_bytes(bytes(data))
    return path


Recipe = tuple[str, Callable[[Path], Path]]  # (label, write the file at this path)


def recipes(ds: Dataset, syntax: str, rng: np.random.Generator) -> list[Recipe]:
    """Every mutant of one intact file (the intact file first)."""
    fresh = functools.partial(copy.deepcopy, ds)
    if syntax == RLELossless:
        compressed = fresh()
        compressed.file_meta = FileMetaDataset()
        compressed.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        compressed.compress(RLELossless, generate_instance_uid=False)
        flipped = copy.deepcopy(compressed)
        data = bytearray(flipped.PixelData)
        for at in rng.integers(16, len(data), 8):
            data[at] ^= 0xFF
        flipped.PixelData = bytes(data)
        return [("intact", lambda path: save(compressed, path, RLELossless)),
                ("flipped", lambda path: save(flipped, path, RLELossless))]  # fmt: skip
    out: list[Recipe] = [("intact", lambda path: save(fresh(), path, syntax))]
    for keyword, values in TEXT_MUTATIONS.items():
        for value in values:
            out.append((f"{keyword}={value}", functools.partial(_texts, fresh, syntax, {keyword: value})))
    for keyword, values in SIZE_MUTATIONS.items():
        for value in values:
            out.append((f"{keyword}={value}", functools.partial(_edited, fresh, syntax, keyword, value)))
    for photometric in PHOTOMETRIC:
        out.append((f"photometric={photometric or 'empty'}",
                    functools.partial(_edited, fresh, syntax, "PhotometricInterpretation", photometric)))
    if syntax == DeflatedExplicitVRLittleEndian:
        return out
    for other in SYNTAXES:  # the UID names one encoding, the data set is written in another
        if other != syntax:
            out.append((f"uid_{syntax.keyword}_body_{other.keyword}",
                        functools.partial(lambda other, path: save(fresh(), path, syntax, body=other), other)))
    for label, length in LENGTHS.items():
        out.append((f"length_{label}", functools.partial(lambda length, path: with_pixel_length(
            save(fresh(), path, syntax), length), length)))
    out.append(("length_long_by_200_in_file", lambda path: with_pixel_length(
        save(fresh(), path, syntax), LENGTHS["long by 200"], extra=b"\0" * 200)))
    out.append(("truncated", lambda path: _truncated(save(fresh(), path, syntax))))
    return out


def _texts(fresh: Callable[[], Dataset], syntax: str, texts: dict[str, str], path: Path) -> Path:
    return write_raw(fresh(), path, syntax, texts)


def _edited(fresh: Callable[[], Dataset], syntax: str, keyword: str, value: object, path: Path) -> Path:
    ds = fresh()
    setattr(ds, keyword, value)
    return save(ds, path, syntax)


def _truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-7])
    return path


def _pair(mutations: tuple[str, str], rng: np.random.Generator, path: Path) -> Path:
    """Two mutations at once on a 16-bit signed image with a window."""
    ds = image_dataset("gray", rng, signed=True, stored=12)
    ds.WindowCenter, ds.WindowWidth = 0, 1000
    at_centre(ds, 0)
    texts = {}
    for mutation in mutations:
        if mutation != "length":
            keyword, value = mutation.split("=")
            if keyword == "WindowWidth":
                texts[keyword] = value
            else:
                setattr(ds, keyword, int(value))
    write_raw(ds, path, ExplicitVRLittleEndian, texts)
    return with_pixel_length(path, LENGTHS["huge"]) if "length" in mutations else path


# malformed files a bug report named: in every corpus, thinned or not
ISSUE_CASES = ("ct_WindowWidth=1e-300", "gray16s12_WindowWidth=1e-300", "ct_length_huge",
               "ct_implicit_uid_ImplicitVRLittleEndian_body_ExplicitVRLittleEndian")  # fmt: skip


def corpus(folder: Path, thin: int = 1) -> list[Path]:
    """Every base file intact, then its mutants (each mutation kind that applies to it), then pairs of mutations.

    ``thin`` keeps every ``thin``-th file (and always the intact files and :data:`ISSUE_CASES`).
    """
    rng = np.random.default_rng(22)
    named = [(f"{name}_{label}", make) for name, ds, syntax in base_datasets(rng) for label, make in recipes(ds, syntax, rng)]
    pairs = itertools.combinations(["WindowWidth=1e-300", "Rows=13", "BitsStored=1", "length"], 2)
    named += [(f"pair_{'+'.join(pair)}", functools.partial(_pair, pair, rng)) for pair in pairs]
    paths = []
    for i, (name, make) in enumerate(named):
        if i % thin == 0 or name in ISSUE_CASES or name.endswith("_intact"):
            file_name = f"{len(paths):04d}_{name}.dcm".replace(" ", "_").replace("\\", "_")
            paths.append(make(folder / file_name))
    return paths


def outcome(call: Callable[[Path], np.ndarray], path: Path) -> tuple[str, object]:
    """("image", array) or ("error", message); any other exception fails the test."""
    try:
        return "image", call(path)
    except ImageReadError as error:
        return "error", str(error)


def disagreements(paths: list[Path], options: ReadOptions) -> list[str]:
    """Files on which ``ImageReader(options)`` (first read: header check + read; second: the remembered plan) and
    ``read_image`` differ, one line each."""
    reader = ImageReader(options)
    out = []
    for path in paths:
        expected = outcome(lambda p: read_image(p, **vars(options)), path)
        for _ in range(2):
            got = outcome(reader, path)
            if got[0] != expected[0]:
                out.append(f"{path.name}: reader {got[0]} {got[1] if got[0] == 'error' else ''}, "
                           f"read_image {expected[0]} {expected[1] if expected[0] == 'error' else ''}")
            elif got[0] == "error" and got[1] != expected[1]:
                out.append(f"{path.name}: messages differ: {got[1]!r} vs {expected[1]!r}")
            elif got[0] == "image" and not (got[1].dtype == expected[1].dtype and np.array_equal(got[1], expected[1])):
                same_shape = got[1].shape == expected[1].shape
                diff = float(np.abs(got[1].astype(np.float64) - expected[1]).max()) if same_shape else None
                out.append(f"{path.name}: arrays differ (shapes {got[1].shape} {expected[1].shape}, max |diff| {diff})")
            else:
                continue
            break
    return out


def check_corpus(paths: list[Path], options: ReadOptions) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns about what it tolerates
        found = disagreements(paths, options)
        read = sum(outcome(read_image, p)[0] == "image" for p in paths[::5])
    assert not found, f"{len(found)} of {len(paths)} files:\n" + "\n".join(found)
    assert 0.2 < read / len(paths[::5]) < 0.8  # the corpus has both readable and refused files


@pytest.mark.slow
@pytest.mark.parametrize("options", [ReadOptions(), ReadOptions(window_center=100.0, window_width=700.0)],
                         ids=["file-windows", "explicit-window"])
def test_reader_and_read_image_agree_on_every_file_of_the_corpus(tmp_path_factory, options):
    """The whole corpus (1 271 files; ~15 s per option set on 2 cores)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = corpus(tmp_path_factory.mktemp("corpus"))
    assert len(paths) > 1200
    check_corpus(paths, options)


def test_reader_and_read_image_agree_on_a_sixth_of_the_corpus_and_the_issue_files(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = corpus(tmp_path, thin=6)
    assert len(paths) > 200
    check_corpus(paths, ReadOptions())
    by_name = {p.name.split("_", 1)[1].removesuffix(".dcm"): p for p in paths}
    for case in ("ct_WindowWidth=1e-300", "gray16s12_WindowWidth=1e-300"):
        with pytest.raises(ImageReadError, match="WindowWidth 1e-300 is outside the usable range"):
            read_image(by_name[case])
    with pytest.raises(ImageReadError, match="PixelData length 4294967280 does not match"):
        read_image(by_name["ct_length_huge"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        misnamed = read_image(by_name["ct_implicit_uid_ImplicitVRLittleEndian_body_ExplicitVRLittleEndian"])
    np.testing.assert_array_equal(misnamed, read_image(by_name["ct_implicit_intact"]))


def test_pixel_data_length_past_the_file_end_is_named_with_the_expected_length(tmp_path):
    ds = image_dataset("gray", np.random.default_rng(0), size=(8, 6))
    path = with_pixel_length(save(ds, tmp_path / "huge_length.dcm"), 4_294_967_280)
    message = ("PixelData length 4294967280 does not match Rows 8 × Columns 6 × NumberOfFrames 1 × SamplesPerPixel 1 "
               "× BitsAllocated 16 / 8 = 96 bytes; the file holds 96 bytes after the element header")
    for call in (read_image, header_info, ImageReader()):
        with pytest.raises(ImageReadError) as error:
            call(path)
        assert str(error.value) == f"{path}: {message}"
    short = with_pixel_length(save(ds, tmp_path / "short_length.dcm"), 90, extra=b"")
    with pytest.raises(ImageReadError, match=r"short_length.dcm: PixelData length 90 does not match .* = 96 bytes$"):
        read_image(short)


def test_tiny_window_width_is_refused_by_both_readers_with_the_same_line(tmp_path):
    ds = image_dataset("gray", np.random.default_rng(1))
    ds.WindowCenter = 100
    path = write_raw(ds, tmp_path / "tiny_width.dcm", ExplicitVRLittleEndian, {"WindowWidth": "1e-300"})
    messages = set()
    for call in (read_image, ImageReader(), header_info):
        with pytest.raises(ImageReadError) as error:
            call(path)
        messages.add(str(error.value))
    assert messages == {f"{path}: WindowWidth 1e-300 is outside the usable range 1e-30 to 1e+30"}
    with pytest.raises(ValueError, match="window_width must be between 1e-30 and 1e"):
        ReadOptions(window_center=0.0, window_width=1e-300)


@pytest.mark.parametrize("body", [ExplicitVRLittleEndian, ImplicitVRLittleEndian])
def test_a_transfer_syntax_that_misnames_the_vr_encoding_reads_like_pydicom(tmp_path, body):
    ds = image_dataset("gray", np.random.default_rng(2), signed=True, stored=12)
    ds.WindowCenter, ds.WindowWidth = 0, 3000
    truth = read_image(save(ds, tmp_path / "true.dcm", body))
    other = ImplicitVRLittleEndian if body == ExplicitVRLittleEndian else ExplicitVRLittleEndian
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom: "Expected implicit VR, but found explicit VR"
        path = save(ds, tmp_path / "misnamed.dcm", other, body=body)
        for read in (read_image, ImageReader()):
            np.testing.assert_array_equal(read(path), truth)


# ---------------------------------------------------------------- big-endian palette colour
@pytest.mark.parametrize("bits", [8, 16])
def test_big_endian_palette_colour_equals_its_little_endian_twin(tmp_path, bits):
    """pydicom's apply_color_lut reads OW lookup-table data in the machine's byte order: a big-endian file came out
    nearly black (its LUT values byte-swapped) until vitlab handed it the table in native order."""
    ds = image_dataset("palette", np.random.default_rng(3), bits=bits, size=(16, 12))
    little = read_image(save(ds, tmp_path / "palette_le.dcm", ExplicitVRLittleEndian))
    big_path = save(ds, tmp_path / "palette_be.dcm", ExplicitVRBigEndian)  # tables and pixels stored big endian
    assert pydicom.dcmread(big_path).file_meta.TransferSyntaxUID == ExplicitVRBigEndian
    assert little.shape == (16, 12, 3) and little.mean() > 0.05
    for read in (read_image, ImageReader()):
        np.testing.assert_array_equal(read(big_path), little)
