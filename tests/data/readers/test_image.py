"""vitlab.data.readers.image and .dicom: DICOM radiology chain, raster files and one-line errors, on pydicom's real test files."""

from __future__ import annotations

import shutil

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_color_lut, apply_modality_lut, get_decoder, pixel_array
from pydicom.uid import JPEGLSLossless

from vitlab.data import (
    WINDOW_PRESETS,
    ImageNotFoundError,
    ImageReader,
    ImageReadError,
    ReadOptions,
    modality_values,
    read_image,
)
from vitlab.data.readers.dicom import native_plan
from vitlab.data.readers.image import header_info


def pydicom_file(name: str) -> str:
    path = get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"pydicom test file {name} not installed")
    return str(path)


def reference_window(values: np.ndarray, center: float, width: float) -> np.ndarray:
    """The window formula computed independently in float64."""
    return np.clip((values.astype(np.float64) - (center - width / 2)) / width, 0, 1)


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ---------------------------------------------------------------- DICOM grayscale
def test_ct_hounsfield_units_equal_modality_lut():
    path = pydicom_file("CT_small.dcm")
    ds = pydicom.dcmread(path)
    expected = apply_modality_lut(ds.pixel_array, ds)
    hu = modality_values(path)
    assert hu.dtype == np.float32 and hu.shape == (128, 128)
    np.testing.assert_array_equal(hu, expected)
    # the intercept really was applied: stored values are shifted by -1024
    np.testing.assert_array_equal(hu, ds.pixel_array.astype(np.float64) - 1024)


def test_ct_windowing_matches_formula_for_random_and_preset_windows():
    path = pydicom_file("CT_small.dcm")
    hu = modality_values(path).astype(np.float64)
    rng = np.random.default_rng(0)
    for _ in range(3):
        center, width = rng.uniform(-200, 600), rng.uniform(50, 1500)
        image = read_image(path, window_center=center, window_width=width)
        assert image.dtype == np.float32
        np.testing.assert_allclose(image, reference_window(hu, center, width), atol=1e-6)
        assert 0 < (image == 0).mean() + (image == 1).mean() < 1  # the window clips something, not everything
    lung = read_image(path, window="lung")
    np.testing.assert_allclose(lung, reference_window(hu, -600, 1500), atol=1e-6)


def test_ct_without_window_tags_is_min_max_scaled():
    path = pydicom_file("CT_small.dcm")
    assert "WindowCenter" not in pydicom.dcmread(path, stop_before_pixels=True)
    hu = modality_values(path).astype(np.float64)
    np.testing.assert_allclose(read_image(path), (hu - hu.min()) / (hu.max() - hu.min()), atol=1e-6)


def test_presets_are_the_standard_radiology_windows():
    assert WINDOW_PRESETS == {
        "brain": (40, 80), "subdural": (80, 200), "stroke": (40, 40), "lung": (-600, 1500),
        "mediastinum": (50, 350), "soft_tissue": (50, 400), "liver": (60, 160), "bone": (400, 1800),
    }  # fmt: skip


def test_mr_uses_its_own_window_tags():
    path = pydicom_file("MR_small.dcm")
    ds = pydicom.dcmread(path)
    center, width = float(ds.WindowCenter), float(ds.WindowWidth)
    expected = reference_window(apply_modality_lut(ds.pixel_array, ds), center, width)
    np.testing.assert_allclose(read_image(path), expected, atol=1e-6)


def test_window_index_selects_among_several_windows():
    path = pydicom_file("examples_overlay.dcm")
    ds = pydicom.dcmread(path)
    assert len(ds.WindowCenter) == 2
    values = apply_modality_lut(ds.pixel_array, ds)
    for index in (0, 1):
        expected = reference_window(values, float(ds.WindowCenter[index]), float(ds.WindowWidth[index]))
        np.testing.assert_allclose(read_image(path, window_index=index), expected, atol=1e-6)
    with pytest.raises(ImageReadError) as error:
        read_image(path, window_index=2)
    assert_one_line(error, "examples_overlay.dcm", "window_index 2", "2 windows")


def test_monochrome1_is_inverted(tmp_path):
    source = pydicom_file("MR_small.dcm")
    ds = pydicom.dcmread(source)
    ds.PhotometricInterpretation = "MONOCHROME1"
    copy = tmp_path / "mono1.dcm"
    ds.save_as(copy)
    np.testing.assert_allclose(read_image(copy), 1.0 - read_image(source), atol=1e-6)
    rng = np.random.default_rng(1)
    center, width = rng.uniform(300, 900), rng.uniform(200, 2000)
    expected = 1.0 - reference_window(apply_modality_lut(ds.pixel_array, ds), center, width)
    np.testing.assert_allclose(read_image(copy, window_center=center, window_width=width), expected, atol=1e-6)


def test_multiframe_selection():
    path = pydicom_file("rtdose.dcm")
    frames = pydicom.dcmread(path).pixel_array.astype(np.float64)  # (15, 10, 10)

    def scaled(x):
        return (x - x.min()) / (x.max() - x.min())

    np.testing.assert_allclose(read_image(path), scaled(frames[7]), atol=1e-6)  # middle of 15
    np.testing.assert_allclose(read_image(path, frames=3), scaled(frames[3]), atol=1e-6)
    np.testing.assert_allclose(read_image(path, frames=-1), scaled(frames[14]), atol=1e-6)
    volume = read_image(path, frames="all")
    assert volume.shape == (15, 10, 10)
    np.testing.assert_allclose(volume, scaled(frames), atol=1e-6)
    # one frame decoded alone equals pydicom's own frame decoding
    np.testing.assert_array_equal(pixel_array(path, index=3), frames[3])
    with pytest.raises(ImageReadError) as error:
        read_image(path, frames=15)
    assert_one_line(error, "rtdose.dcm", "frame 15", "15 frames")


# ---------------------------------------------------------------- DICOM colour
def test_rgb_dicom_is_scaled_by_bit_depth():
    path = pydicom_file("SC_rgb_rle_2frame.dcm")
    frames = pydicom.dcmread(path).pixel_array  # (2, 100, 100, 3) uint8
    np.testing.assert_allclose(read_image(path), frames[1] / 255.0, atol=1e-6)
    np.testing.assert_allclose(read_image(path, frames=0), frames[0] / 255.0, atol=1e-6)
    assert read_image(path, frames="all").shape == (2, 100, 100, 3)
    path16 = pydicom_file("SC_rgb_rle_16bit.dcm")
    np.testing.assert_allclose(read_image(path16), pydicom.dcmread(path16).pixel_array / 65535.0, atol=1e-6)


def test_ybr_and_palette_dicom_become_rgb():
    ybr = pydicom_file("examples_ybr_color.dcm")
    image = read_image(ybr)
    assert image.shape == (240, 320, 3) and image.dtype == np.float32
    np.testing.assert_allclose(image, pixel_array(ybr, index=15) / 255.0, atol=1e-6)
    palette = pydicom_file("examples_palette.dcm")
    ds = pydicom.dcmread(palette)
    expected = apply_color_lut(ds.pixel_array, ds) / (2.0 ** ds.RedPaletteColorLookupTableDescriptor[2] - 1)
    np.testing.assert_allclose(read_image(palette), expected, atol=1e-6)


# ---------------------------------------------------------------- raster files
@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_8_and_16_bit_raster_scaled_by_dtype_max(tmp_path, suffix):
    rng = np.random.default_rng(2)
    gray8 = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    gray16 = rng.integers(0, 65536, (20, 30), dtype=np.uint16)
    rgb8 = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    for name, array, max_value in (("g8", gray8, 255), ("g16", gray16, 65535), ("rgb", rgb8, 255)):
        path = tmp_path / f"{name}{suffix}"
        Image.fromarray(array).save(path)
        image = read_image(path)
        assert image.dtype == np.float32 and image.shape == array.shape
        np.testing.assert_allclose(image, array / max_value, atol=1e-6)


def test_jpeg_and_multipage_tiff(tmp_path):
    rng = np.random.default_rng(3)
    smooth = np.repeat(np.linspace(0, 255, 32, dtype=np.uint8)[None], 16, axis=0)
    Image.fromarray(smooth).save(tmp_path / "a.jpg", quality=95)
    np.testing.assert_allclose(read_image(tmp_path / "a.jpg"), smooth / 255.0, atol=0.03)
    pages = [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)) for _ in range(3)]
    pages[0].save(tmp_path / "stack.tiff", save_all=True, append_images=pages[1:])
    for index in (0, 2):
        np.testing.assert_allclose(read_image(tmp_path / "stack.tiff", frames=index), np.asarray(pages[index]) / 255.0)
    np.testing.assert_allclose(read_image(tmp_path / "stack.tiff"), np.asarray(pages[1]) / 255.0)
    assert read_image(tmp_path / "stack.tiff", frames="all").shape == (3, 8, 8)


def test_extensionless_dicom_with_preamble_is_read(tmp_path):
    shutil.copy(pydicom_file("CT_small.dcm"), tmp_path / "IM0001")
    np.testing.assert_array_equal(read_image(tmp_path / "IM0001"), read_image(pydicom_file("CT_small.dcm")))


# ---------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    with pytest.raises(ImageNotFoundError) as error:
        read_image(tmp_path / "nope.dcm")
    assert isinstance(error.value, FileNotFoundError) and isinstance(error.value, ImageReadError)
    assert_one_line(error, "nope.dcm", "not found")


def test_unknown_extension(tmp_path):
    (tmp_path / "scan.bmp").write_bytes(b"BM")
    with pytest.raises(ImageReadError) as error:
        read_image(tmp_path / "scan.bmp")
    assert_one_line(error, "scan.bmp", "'.bmp'", ".dcm", ".png", ".tiff")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"window": "abdomen"}, "brain, subdural, stroke, lung, mediastinum, soft_tissue, liver, bone"),
        ({"window_center": 40.0}, "together"),
        ({"window_center": 40.0, "window_width": 0.0}, "window_width must be > 0"),
        ({"window": "brain", "window_center": 40.0, "window_width": 80.0}, "not both"),
        ({"frames": "first"}, "'middle', 'all' or an int"),
        ({"window_index": -1}, "window_index"),
    ],
)
def test_bad_options_are_value_errors_not_file_errors(kwargs, fragment):
    with pytest.raises(ValueError) as error:
        read_image(pydicom_file("CT_small.dcm"), **kwargs)
    assert not isinstance(error.value, ImageReadError)  # never silently skipped as a "bad file"
    assert_one_line(error, fragment)


def test_truncated_dicom_is_caught_by_header_check_and_decoder():
    path = pydicom_file("MR_truncated.dcm")
    with pytest.raises(ImageReadError) as error:
        read_image(path)
    assert_one_line(error, "MR_truncated.dcm", "pixel data")
    with pytest.raises(ImageReadError) as error:
        header_info(path)
    assert_one_line(error, "MR_truncated.dcm", "truncated")
    assert header_info(pydicom_file("MR_small.dcm")) == {"patient_id": "4MR1"}


def test_every_compressed_syntax_has_an_installed_decoder():
    """vitlab installs its decoders (setup.cfg): none of the syntaxes it names packages for lacks one."""
    from vitlab.data.readers.dicom import DECODER_PACKAGES

    assert [uid for uid in DECODER_PACKAGES if not get_decoder(uid).is_available] == []


def test_jpeg_ls_without_decoder_names_the_packages(monkeypatch):
    import vitlab.data.readers.dicom as dicom_module

    real = dicom_module.get_decoder
    unavailable = type("Unavailable", (), {"is_available": False})()
    monkeypatch.setattr(dicom_module, "get_decoder", lambda uid: unavailable if uid == JPEGLSLossless else real(uid))
    path = pydicom_file("MR_small_jpeg_ls_lossless.dcm")
    for call in (read_image, header_info):
        with pytest.raises(ImageReadError) as error:
            call(path)
        assert_one_line(error, "MR_small_jpeg_ls_lossless.dcm", "JPEG-LS", "pip install `pyjpegls`")


def test_non_dicom_and_pixelless_dicom(tmp_path):
    (tmp_path / "notes.dcm").write_text("not a dicom file")
    with pytest.raises(ImageReadError) as error:
        read_image(tmp_path / "notes.dcm")
    assert_one_line(error, "notes.dcm", "not a DICOM file")
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    del ds.PixelData
    ds.save_as(tmp_path / "header_only.dcm")
    for call in (read_image, header_info):
        with pytest.raises(ImageReadError) as error:
            call(tmp_path / "header_only.dcm")
        assert_one_line(error, "header_only.dcm", "no pixel data")


def test_truncated_png_fails_at_decode_not_at_header(tmp_path):
    rng = np.random.default_rng(4)
    Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    assert header_info(tmp_path / "cut.png") == {"patient_id": None}
    with pytest.raises(ImageReadError) as error:
        read_image(tmp_path / "cut.png")
    assert_one_line(error, "cut.png", "cannot decode")


# ---------------------------------------------------------------- ImageReader fast path
def variants(tmp_path) -> list[str]:
    """Real files plus edited copies: MONOCHROME1, fractional rescale, 12 of 16 bits with junk high bits."""
    ct = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    ct.PhotometricInterpretation = "MONOCHROME1"
    ct.RescaleSlope, ct.RescaleIntercept = 0.37, -100.25
    ct.save_as(tmp_path / "mono1_rescaled.dcm")
    junk = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    junk.BitsStored, junk.HighBit = 12, 11
    junk.PixelData = (np.frombuffer(junk.PixelData, "<u2") | np.uint16(0x8000)).tobytes()  # set an unused bit
    junk.save_as(tmp_path / "junk_high_bits.dcm")
    names = ["CT_small.dcm", "MR_small.dcm", "MR_small_implicit.dcm", "MR_small_bigendian.dcm", "rtdose.dcm",
             "examples_overlay.dcm", "MR_small_RLE.dcm", "SC_rgb_rle_2frame.dcm"]  # fmt: skip
    edited = [str(tmp_path / "mono1_rescaled.dcm"), str(tmp_path / "junk_high_bits.dcm")]
    return [pydicom_file(n) for n in names] + edited


@pytest.mark.parametrize(
    "options",
    [{}, {"window": "bone"}, {"window_center": 35.5, "window_width": 123.0}, {"frames": 0}, {"frames": "all"}],
)
def test_image_reader_equals_read_image(tmp_path, options):
    reader = ImageReader(ReadOptions(**options))
    for path in variants(tmp_path):
        expected = read_image(path, **options)
        for _ in range(2):  # first read parses the header, the second uses the remembered plan
            np.testing.assert_array_equal(reader(path), expected, err_msg=path)


def test_fast_path_applies_to_uncompressed_grayscale_only(tmp_path):
    files = dict(zip(["ct", "mr", "implicit", "bigendian", "rtdose", "overlay", "rle", "rgb", "mono1", "junk"],
                     variants(tmp_path)))  # fmt: skip
    planned = {name for name, path in files.items() if native_plan(path, ReadOptions()) is not None}
    assert planned == {"ct", "mr", "implicit", "rtdose", "overlay", "mono1", "junk"}
    plan = native_plan(files["ct"], ReadOptions())
    assert (plan.dtype, plan.rows, plan.rescale, plan.window) == ("<i2", 128, (1.0, -1024.0), None)


def test_image_reader_notices_edited_files(tmp_path):
    path = tmp_path / "ct.dcm"
    shutil.copy(pydicom_file("CT_small.dcm"), path)
    reader = ImageReader(ReadOptions(window="brain"))
    before = reader(path)
    ds = pydicom.dcmread(path)
    ds.RescaleIntercept = -1000
    ds.save_as(path)
    after = reader(path)
    np.testing.assert_array_equal(after, read_image(path, window="brain"))
    assert not np.array_equal(before, after)
    path.unlink()
    with pytest.raises(ImageNotFoundError):
        reader(path)
