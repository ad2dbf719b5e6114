"""Malformed DICOM as hospitals send it: every failure is an ImageReadError naming the file; skip mode skips it.

Malformed DS/IS strings are written the way broken devices write them: the element is saved as a
string (LO) and its VR bytes are then set to the dictionary's DS/IS, so pydicom reads the raw text
back (``'abc'``, ``'1A'``, ``'inf'``) exactly as from a real file.
"""

from __future__ import annotations

import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file
from pydicom.dataelem import DataElement
from pydicom.datadict import dictionary_VR
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.tag import Tag
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from vitlab.data import MedicalDataModule, SkippedFileWarning
from vitlab.data import ImageReader, ImageReadError, ReadOptions, read_image
from vitlab.data.readers.image import header_info

FOLDER = Path(get_testdata_file("CT_small.dcm", download=False)).parent  # never the network


def write_raw(ds: Dataset, path: Path, **texts: str) -> Path:
    """Save ``ds`` with the given DS/IS elements holding raw (possibly malformed) text."""
    for keyword, text in texts.items():
        ds[Tag(keyword)] = DataElement(Tag(keyword), "LO", text)
    ds.save_as(path)
    data = bytearray(path.read_bytes())
    if not ds.file_meta.TransferSyntaxUID.is_implicit_VR:
        for keyword in texts:
            tag = Tag(keyword)
            at = data.index(struct.pack("<HH", tag.group, tag.element) + b"LO", 132)
            data[at + 4 : at + 6] = dictionary_VR(keyword).encode()
    path.write_bytes(bytes(data))
    return path


def float_image(path: Path, values: np.ndarray) -> Path:
    """A grayscale Float Pixel Data file (what some research exports hold)."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.30"
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.SOPClassUID, ds.PatientID = ds.file_meta.MediaStorageSOPClassUID, "FLOAT"
    ds.Rows, ds.Columns = values.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.BitsAllocated = 1, "MONOCHROME2", 32
    ds.FloatPixelData = values.astype("<f4").tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


def assert_names_the_file(path: Path, *fragments: str, calls=None) -> None:
    for call in calls or (read_image, header_info, ImageReader(ReadOptions())):
        with pytest.raises(ImageReadError) as error:
            call(path)
        message = str(error.value)
        assert path.name in message and "\n" not in message, message
        for fragment in fragments:
            assert fragment in message, (fragment, message)


def test_bad_vr_file_names_the_file_and_value():
    assert_names_the_file(FOLDER / "badVR.dcm", "NumberOfFrames", "'1A'")


MALFORMED = [
    ({"WindowCenter": "abc"}, "WindowCenter"),
    ({"WindowCenter": "40\\abc"}, "'abc'"),
    ({"WindowWidth": "inf"}, "WindowWidth"),
    ({"WindowWidth": "nan"}, "WindowWidth"),
    ({"RescaleSlope": "x"}, "RescaleSlope"),
    ({"RescaleSlope": "nan"}, "RescaleSlope"),
    ({"RescaleIntercept": "-inf"}, "RescaleIntercept"),
    ({"RescaleSlope": "1e300"}, "overflow float32"),
    ({"NumberOfFrames": "1A"}, "NumberOfFrames"),
    ({"NumberOfFrames": "0"}, "NumberOfFrames"),
]


@pytest.mark.parametrize("base", ["CT_small.dcm", "MR_small_RLE.dcm"])  # fast path, pydicom decoder
@pytest.mark.parametrize(("texts", "fragment"), MALFORMED, ids=[f"{k}={v}" for t, _ in MALFORMED for k, v in t.items()])
def test_malformed_numbers_are_image_read_errors(tmp_path, base, texts, fragment):
    ds = pydicom.dcmread(FOLDER / base)
    if "RescaleSlope" in texts or "RescaleIntercept" in texts:
        ds.RescaleSlope, ds.RescaleIntercept = "1", "0"
    path = write_raw(ds, tmp_path / f"mutant_{base}", **texts)
    assert_names_the_file(path, fragment)


def palette_variants(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    out = {}
    ds = pydicom.dcmread(FOLDER / "examples_palette.dcm")
    del ds.RedPaletteColorLookupTableData, ds.GreenPaletteColorLookupTableData, ds.BluePaletteColorLookupTableData
    ds.save_as(tmp_path / "palette_no_lut.dcm")
    out["no_lut"] = (tmp_path / "palette_no_lut.dcm", "RedPaletteColorLookupTableData")
    ds = pydicom.dcmread(FOLDER / "examples_palette.dcm")
    del ds.RedPaletteColorLookupTableDescriptor
    ds.save_as(tmp_path / "palette_no_descriptor.dcm")
    out["no_descriptor"] = (tmp_path / "palette_no_descriptor.dcm", "RedPaletteColorLookupTableDescriptor")
    ds = pydicom.dcmread(FOLDER / "examples_palette.dcm")
    for colour in ("Red", "Green", "Blue"):
        setattr(ds, f"{colour}PaletteColorLookupTableDescriptor", [0, 0, 16])  # 0 entries means 65536
    ds.save_as(tmp_path / "palette_zero_entries.dcm")
    out["zero_entries"] = (tmp_path / "palette_zero_entries.dcm", "65536 entries")
    ds = pydicom.dcmread(FOLDER / "CT_small.dcm")
    ds.PhotometricInterpretation = "PALETTE COLOR"
    ds.save_as(tmp_path / "gray_called_palette.dcm")
    out["gray_called_palette"] = (tmp_path / "gray_called_palette.dcm", "PALETTE COLOR")
    return out


@pytest.mark.parametrize("kind", ["no_lut", "no_descriptor", "zero_entries", "gray_called_palette"])
def test_broken_palettes_are_image_read_errors(tmp_path, kind):
    path, fragment = palette_variants(tmp_path)[kind]
    assert_names_the_file(path, fragment)


def test_non_finite_pixels_never_come_back(tmp_path):
    values = np.linspace(-5, 5, 64, dtype=np.float32).reshape(8, 8)
    good = read_image(float_image(tmp_path / "float.dcm", values))
    np.testing.assert_allclose(good, (values - values.min()) / (values.max() - values.min()), atol=1e-6)
    values[3, 4] = np.nan
    assert_names_the_file(float_image(tmp_path / "float_nan.dcm", values), "non-finite",
                          calls=(read_image, ImageReader(ReadOptions())))  # fmt: skip
    Image.fromarray(values, mode="F").save(tmp_path / "nan.tif")
    assert_names_the_file(tmp_path / "nan.tif", "non-finite", calls=(read_image, ImageReader(ReadOptions())))


# ---------------------------------------------------------------- mutation fuzzer
TEXT_TAGS = ("WindowCenter", "WindowWidth", "RescaleSlope", "RescaleIntercept", "NumberOfFrames")
TEXT_VALUES = ("abc", "1A", "inf", "-inf", "nan", "", "1e400", "0", "-5", "3.5", "99999999", "40\\x")
SIZE_TAGS = ("Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit", "PixelRepresentation",
             "SamplesPerPixel", "PlanarConfiguration")  # fmt: skip
SIZE_VALUES = (0, 1, 2, 3, 7, 8, 12, 16, 33, 64)
PHOTOMETRIC = ("PALETTE COLOR", "MONOCHROME1", "RGB", "YBR_FULL_422", "XYZ", "")
FUZZ_BASES = ("CT_small.dcm", "MR_small_RLE.dcm", "examples_palette.dcm", "SC_rgb_small_odd.dcm", "rtdose.dcm",
              "JPGExtended.dcm", "MR_small_jp2klossless.dcm", "SC_rgb_jpeg_gdcm.dcm")  # fmt: skip


def mutants(folder: Path, count: int = 48, extra: tuple[Path, ...] = ()) -> list[Path]:
    """``count`` deterministic mutants: 1-3 tag mutations each, some with flipped pixel bytes."""
    paths = []
    synthetic = float_image(folder / "synthetic_float.dcm", np.arange(36, dtype=np.float32).reshape(6, 6))
    bases = [FOLDER / name for name in FUZZ_BASES] + [synthetic, *extra]
    for i in range(3 * count):
        if len(paths) == count:
            break
        rng = np.random.default_rng(1000 + i)
        base = bases[i % len(bases)]
        ds = pydicom.dcmread(base)
        texts = {}
        for _ in range(int(rng.integers(1, 4))):
            what = int(rng.integers(0, 4))
            if what == 0:
                texts[TEXT_TAGS[rng.integers(len(TEXT_TAGS))]] = TEXT_VALUES[rng.integers(len(TEXT_VALUES))]
            elif what == 1:
                setattr(ds, SIZE_TAGS[rng.integers(len(SIZE_TAGS))], int(SIZE_VALUES[rng.integers(len(SIZE_VALUES))]))
            elif what == 2:
                ds.PhotometricInterpretation = PHOTOMETRIC[rng.integers(len(PHOTOMETRIC))]
            elif "PixelData" in ds:
                data = bytearray(ds.PixelData)
                for at in rng.integers(0, len(data), 16):
                    data[at] ^= 0xFF
                ds.PixelData = bytes(data)
        try:
            paths.append(write_raw(ds, folder / f"mutant_{i:02d}_{base.stem}.dcm", **texts))
        except ValueError:  # pydicom refuses to write it (e.g. flipped bytes broke the encapsulation)
            continue
    assert len(paths) == count
    return paths


def test_fuzzer_every_mutant_reads_in_zero_one_or_names_itself(tmp_path, tiny_dataset):
    vitlab_synthetic = sorted(tiny_dataset.parent.rglob("*.dcm"))[:2]  # vitlab's generated CT slices
    assert vitlab_synthetic
    paths = mutants(tmp_path, extra=tuple(vitlab_synthetic))
    outcomes = {"read": 0, "refused": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns about the values it keeps
        for path in paths:
            for call in (read_image, ImageReader(ReadOptions())):
                try:
                    image = call(path)
                except ImageReadError as error:
                    assert path.name in str(error) and "\n" not in str(error), str(error)
                    outcomes["refused"] += 1
                    continue
                assert image.dtype == np.float32 and np.isfinite(image).all(), path.name
                assert 0.0 <= image.min() and image.max() <= 1.0, (path.name, image.min(), image.max())
                outcomes["read"] += 1
            try:
                header_info(path)
            except ImageReadError as error:
                assert path.name in str(error), str(error)
    assert outcomes["read"] >= 10 and outcomes["refused"] >= 10, outcomes  # the fuzzer exercises both sides


# ---------------------------------------------------------------- skip mode end to end
def test_skip_mode_setup_skips_exactly_the_bad_files_and_batches_are_finite(tmp_path):
    root = tmp_path / "data"
    good = []
    for label, base in (("a", "CT_small.dcm"), ("b", "MR_small.dcm")):
        (root / label).mkdir(parents=True)
        for i in range(4):
            ds = pydicom.dcmread(FOLDER / base)
            ds.PatientID = f"{label}{i}"
            ds.save_as(root / label / f"good_{i}.dcm")
            good.append(root / label / f"good_{i}.dcm")
    bad = [root / "a" / "badVR.dcm"]
    shutil.copy(FOLDER / "badVR.dcm", bad[0])
    for i, (texts, _) in enumerate(MALFORMED):
        ds = pydicom.dcmread(FOLDER / "CT_small.dcm")
        ds.RescaleSlope, ds.RescaleIntercept = "1", "0"
        bad.append(write_raw(ds, root / "ab"[i % 2] / f"malformed_{i}.dcm", **texts))
    for kind, (path, _) in palette_variants(tmp_path).items():
        bad.append(Path(shutil.copy(path, root / "b" / path.name)))
    for name in ("MR_truncated.dcm", "rtplan.dcm", "rtstruct.dcm", "waveform_ecg.dcm"):
        bad.append(Path(shutil.copy(FOLDER / name, root / "a" / name)))
    (root / "b" / "notes.dcm").write_text("not a dicom file")
    bad.append(root / "b" / "notes.dcm")
    # decode-time failures: the header is fine, the pixels are not (skipped when loaded, never in a batch)
    late = [Path(shutil.copy(FOLDER / "JPEG2000-embedded-sequence-delimiter.dcm", root / "a" / "j2k_corrupt.dcm"))]
    nan_values = np.ones((16, 16), np.float32)
    nan_values[2, 2] = np.nan
    late.append(float_image(root / "b" / "float_nan.dcm", nan_values))

    dm = MedicalDataModule(root=str(root), image_size=32, batch_size=4, num_workers=0, augment="none",
                           val_fraction=0.25, on_bad_file="skip")  # fmt: skip
    with pytest.warns(SkippedFileWarning) as caught:
        dm.setup("fit")
    assert dm.skipped_files == len(bad)
    skipped_names = {Path(str(w.message).split(": ")[1]).name for w in caught.list if w.category is SkippedFileWarning}
    assert skipped_names == {p.name for p in bad}
    kept = {s.path.name for split in ("train", "val") for s in dm.samples(split)}
    assert kept == {p.name for p in good + late}
    with warnings.catch_warnings(record=True) as loading:
        warnings.simplefilter("always")
        for loader in (dm.train_dataloader(), dm.val_dataloader()):
            for images, _ in loader:
                assert torch_finite(images)
    late_warned = {p.name for p in late if any(p.name in str(w.message) for w in loading)}
    in_train_or_val = {p.name for p in late}
    assert late_warned == in_train_or_val


def torch_finite(images) -> bool:
    return bool(images.isfinite().all())


def _read_in_child(path: str, queue) -> None:
    try:
        read_image(path)
        queue.put("read")
    except ImageReadError as error:
        queue.put(f"refused: {error}")


def test_a_decoder_crash_cannot_take_the_process_down(tmp_path):
    """GDCM aborts the interpreter on a J2K stream whose components disagree with SamplesPerPixel;
    vitlab decodes J2K with pylibjpeg-openjpeg, which raises. Read in a forked child so a regression fails here."""
    import multiprocessing

    ds = pydicom.dcmread(FOLDER / "MR_small_jp2klossless.dcm")
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.save_as(tmp_path / "j2k_three_samples.dcm")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(str(tmp_path / "j2k_three_samples.dcm"), queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the reading process died (exit code {child.exitcode})"
    outcome = queue.get(timeout=5)
    assert outcome.startswith("refused:") and "j2k_three_samples.dcm" in outcome, outcome
