"""DICOM as PACS exports it: every compressed file pydicom ships, deflate, no preamble, exact [0, 1].

Oracles are pydicom's own: its decoded ``pixel_array`` put through its ``apply_modality_lut`` /
``apply_color_lut`` and the window formula in float64, its published reference pixel values,
and the same pixels stored uncompressed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.multival import MultiValue
from pydicom.pixels import apply_color_lut, apply_modality_lut, pixel_array
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from vitlab.data import ImageReader, ImageReadError, ReadOptions, read_image
from vitlab.data.readers.image import header_info
from vitlab.data.readers.window import min_max

FOLDER = Path(get_testdata_file("CT_small.dcm", download=False)).parent  # never the network
BROKEN_STREAM = "JPEG2000-embedded-sequence-delimiter.dcm"  # a corrupt J2K codestream: no decoder reads it


def _compressed_images() -> list[str]:
    """Names of the files in pydicom's test folder with a compressed transfer syntax and pixel data."""
    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in sorted(FOLDER.glob("*.dcm")):
            try:
                ds = pydicom.dcmread(path)
            except Exception:  # noqa: BLE001 - deliberately broken files of pydicom's test set
                continue
            syntax = ds.file_meta.get("TransferSyntaxUID")
            if syntax is not None and syntax.is_compressed and "PixelData" in ds and "Rows" in ds:
                names.append(path.name)
    return names


COMPRESSED = _compressed_images()


def pydicom_reference(path: str | os.PathLike) -> np.ndarray:
    """pydicom's decode put through the display chain independently (float64)."""
    ds = pydicom.dcmread(path)
    frames = int(ds.get("NumberOfFrames") or 1)
    stored = pixel_array(ds, index=frames // 2)
    photometric = ds.PhotometricInterpretation
    if photometric == "PALETTE COLOR":
        return apply_color_lut(stored, ds) / (2.0 ** ds.RedPaletteColorLookupTableDescriptor[2] - 1)
    if ds.SamplesPerPixel == 3:
        return stored / (2.0**ds.BitsStored - 1)
    values = apply_modality_lut(stored, ds).astype(np.float64)
    if "WindowCenter" in ds and "WindowWidth" in ds:
        center, width = (v[0] if isinstance(v, MultiValue) else v for v in (ds.WindowCenter, ds.WindowWidth))
        image = np.clip((values - (float(center) - float(width) / 2)) / float(width), 0, 1)
    else:
        image = (values - values.min()) / (values.max() - values.min())
    return 1 - image if photometric == "MONOCHROME1" else image


def test_the_compressed_set_covers_every_codec_family():
    syntaxes = {str(pydicom.dcmread(FOLDER / n, stop_before_pixels=True).file_meta.TransferSyntaxUID)
                for n in COMPRESSED}  # fmt: skip
    for uid in ("1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.51", "1.2.840.10008.1.2.4.70",
                "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.81", "1.2.840.10008.1.2.4.90",
                "1.2.840.10008.1.2.4.91", "1.2.840.10008.1.2.5"):  # fmt: skip
        assert uid in syntaxes
    assert len(COMPRESSED) >= 35


@pytest.mark.parametrize("name", [n for n in COMPRESSED if n != BROKEN_STREAM])
def test_compressed_file_decodes_like_pydicom(name):
    path = FOLDER / name
    assert header_info(path)["patient_id"] is None or isinstance(header_info(path)["patient_id"], str)
    image = read_image(path)
    reference = pydicom_reference(path)
    assert image.dtype == np.float32 and image.shape == reference.shape
    assert 0.0 <= image.min() and image.max() <= 1.0
    np.testing.assert_allclose(image, reference, atol=2e-6)
    np.testing.assert_array_equal(ImageReader(ReadOptions())(path), image)  # the data module's reader


def test_12_bit_jpeg_extended_matches_pydicoms_reference_values():
    """pydicom's pixels_reference for JPGExtended.dcm: arr[420, 140] == 244, arr[230, 120] == 95."""
    ds = pydicom.dcmread(FOLDER / "JPGExtended.dcm")
    stored = pixel_array(ds)
    assert stored.dtype == np.uint16 and stored.shape == (1024, 256)
    assert stored[420, 140] == 244 and stored[230, 120] == 95
    # JPEG-lossy.dcm is the same image with non-standard scan parameters (JPGExtended.dcm is its fixed copy)
    np.testing.assert_array_equal(read_image(FOLDER / "JPEG-lossy.dcm"), read_image(FOLDER / "JPGExtended.dcm"))


def test_corrupt_codestream_is_a_one_line_error_naming_the_file():
    with pytest.raises(ImageReadError) as error:
        read_image(FOLDER / BROKEN_STREAM)
    assert BROKEN_STREAM in str(error.value) and "cannot decode pixel data" in str(error.value)
    assert "\n" not in str(error.value)


def test_deflated_file_passes_the_header_check_and_reads_like_pydicom():
    path = FOLDER / "image_dfl.dcm"
    assert pydicom.dcmread(path).file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.1.99"
    assert header_info(path) == {"patient_id": str(pydicom.dcmread(path).PatientID).strip() or None}
    reader = ImageReader(ReadOptions())
    reader.inspect(path)
    image = reader(path)
    assert image.shape == (512, 512)
    np.testing.assert_allclose(image, pydicom_reference(path), atol=2e-6)


@pytest.mark.parametrize(
    ("name", "syntax"),
    [("MR_small_implicit.dcm", ImplicitVRLittleEndian), ("MR_small.dcm", ExplicitVRLittleEndian),
     ("MR_small_bigendian.dcm", ExplicitVRBigEndian)],
)  # fmt: skip
def test_files_without_preamble_and_file_meta_are_read(tmp_path, name, syntax):
    bare = pydicom.dcmread(FOLDER / name)
    assert bare.file_meta.TransferSyntaxUID == syntax
    del bare.file_meta
    bare.preamble = None
    bare.save_as(tmp_path / "bare.dcm", implicit_vr=syntax.is_implicit_VR,
                 little_endian=syntax.is_little_endian, enforce_file_format=False)  # fmt: skip
    assert (tmp_path / "bare.dcm").read_bytes()[128:132] != b"DICM"
    with pytest.raises(pydicom.errors.InvalidDicomError):
        pydicom.dcmread(tmp_path / "bare.dcm")  # pydicom needs force=True
    expected = read_image(FOLDER / name)
    np.testing.assert_array_equal(read_image(tmp_path / "bare.dcm"), expected)
    assert header_info(tmp_path / "bare.dcm") == header_info(FOLDER / name)
    np.testing.assert_array_equal(ImageReader(ReadOptions())(tmp_path / "bare.dcm"), expected)


@pytest.mark.parametrize("name", ["ExplVR_LitEndNoMeta.dcm", "ExplVR_BigEndNoMeta.dcm", "rtstruct.dcm", "no_meta.dcm"])
def test_files_without_preamble_and_without_pixels_keep_the_clear_message(name):
    for call in (read_image, header_info):
        with pytest.raises(ImageReadError) as error:
            call(FOLDER / name)
        assert str(error.value) == f"{FOLDER / name}: not a DICOM file (no 'DICM' preamble and file meta header)"


def test_random_bytes_with_a_dcm_suffix_are_not_dicom(tmp_path):
    path = tmp_path / "noise.dcm"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for call in (read_image, header_info):
        with pytest.raises(ImageReadError) as error:
            call(path)
        assert str(error.value) == f"{path}: not a DICOM file (no 'DICM' preamble and file meta header)"


def _naive_min_max(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float32)
    low, high = float(values.min()), float(values.max())
    return (values - np.float32(low)) * np.float32(1.0 / (high - low))


def test_zero_one_contract_is_exact_after_scaling(tmp_path):
    """A rescale whose float32 min-max rounds to 1.0000001 still gives at most 1.0 (clip after scaling)."""
    ds = pydicom.dcmread(FOLDER / "CT_small.dcm")
    for keyword in ("WindowCenter", "WindowWidth"):
        if keyword in ds:
            delattr(ds, keyword)
    stored = pixel_array(ds)
    for step in range(1, 3000):  # find a rescale where scaling alone overshoots, so the test can fail
        ds.RescaleSlope, ds.RescaleIntercept = f"{0.001 * step + 0.0003:.4f}", "3.3"
        if _naive_min_max(apply_modality_lut(stored, ds)).max() > 1.0:
            break
    else:
        pytest.fail("no overshooting rescale found")
    ds.save_as(tmp_path / "overshoot.dcm")
    for image in (read_image(tmp_path / "overshoot.dcm"), ImageReader(ReadOptions())(tmp_path / "overshoot.dcm")):
        assert image.max() == 1.0 and image.min() == 0.0
    assert min_max(np.array([-4.454133, 656.4749], np.float32)).max() == 1.0


def test_tests_and_benchmarks_never_ask_pydicom_to_download():
    """``get_testdata_file(s)`` without ``download=False`` tries the network and hangs offline."""
    import ast

    root = Path(__file__).parents[3]
    offending = []
    for path in sorted([*root.glob("tests/*.py"), *root.glob("benchmarks/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in ("get_testdata_file", "get_testdata_files"):
                download = [k.value for k in node.keywords if k.arg == "download"]
                if not (download and isinstance(download[0], ast.Constant) and download[0].value is False):
                    offending.append(f"{path.name}:{node.lineno}")
    assert offending == []


@pytest.mark.parametrize(("bits", "signed"), [(16, True), (12, True), (16, False), (8, False)])
def test_jpeg_lossless_round_trip_is_exact(tmp_path, bits, signed):
    """Lossless JPEG (libjpeg-turbo's encoder) reads back exactly as the uncompressed original does."""
    import imagecodecs
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEGLossless, JPEGLosslessSV1

    rng = np.random.default_rng(bits)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if signed else (0, 2**bits)
    values = rng.integers(low, high, (48, 40)).astype(np.int16 if signed else np.uint16 if bits > 8 else np.uint8)
    ds = pydicom.dcmread(FOLDER / "CT_small.dcm")
    ds.Rows, ds.Columns, ds.BitsAllocated, ds.BitsStored, ds.HighBit = 48, 40, 8 if bits == 8 else 16, bits, bits - 1
    ds.PixelRepresentation, ds.RescaleSlope, ds.RescaleIntercept = int(signed), "0.5", "-3"
    ds.PixelData = values.tobytes()
    ds.save_as(tmp_path / "native.dcm")
    samples = values.view(np.uint16) & np.uint16(2**bits - 1) if bits > 8 else values
    for syntax, predictor in ((JPEGLosslessSV1, 1), (JPEGLossless, 6)):
        ds.PixelData = encapsulate([imagecodecs.jpeg8_encode(samples, lossless=True, predictor=predictor,
                                                             bitspersample=bits)])  # fmt: skip
        ds.file_meta.TransferSyntaxUID = syntax
        ds.save_as(tmp_path / "lossless.dcm")
        np.testing.assert_array_equal(pixel_array(tmp_path / "lossless.dcm"), values)
        np.testing.assert_array_equal(read_image(tmp_path / "lossless.dcm"), read_image(tmp_path / "native.dcm"))


def test_rgb_lossless_jpeg_equals_the_same_image_rle_encoded():
    np.testing.assert_array_equal(read_image(FOLDER / "SC_rgb_jpeg_gdcm.dcm"), read_image(FOLDER / "SC_rgb_rle.dcm"))
