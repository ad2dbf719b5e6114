"""vitlab.data.read_volume: the geometry contract against independent computations, values, refusals, synthetic volumes.

The contract (docs/volumes.md): ``array[i, j, k]`` is the voxel whose centre lies at ``affine @ [i, j, k, 1]`` in RAS+ mm,
(x, y, z)_RAS = (-x, -y, z)_LPS. The tests plant voxels in DICOM series whose patient positions they compute
themselves from the direction cosines, spacings and origin they chose, and look for them at ``inv(affine) @ RAS``.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import nibabel
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_modality_lut, get_encoder
from pydicom.uid import JPEG2000Lossless, JPEGLSLossless, RLELossless

from vitlab.data import ImageReadError, Volume, VolumeError, generate_volumes, read_volume
from vitlab.data.synthetic import main as synthetic_main
from vitlab.data.synthetic.volumes import write_enhanced, write_nifti, write_series

SHAPE = (20, 16, 7)  # (I columns, J rows, K slices): unequal, so that a swapped axis shows


def lps_affine(row, col, step, spacing_ij, origin) -> np.ndarray:
    """Voxel -> LPS from the written geometry: i along ``row`` (columns), j along ``col`` (rows), k by ``step``."""
    affine = np.eye(4)
    affine[:3, 0] = np.asarray(row, float) * spacing_ij[0]
    affine[:3, 1] = np.asarray(col, float) * spacing_ij[1]
    affine[:3, 2], affine[:3, 3] = step, origin
    return affine


def rotated(angle_x: float, angle_y: float) -> tuple[np.ndarray, np.ndarray]:
    cx, sx, cy, sy = np.cos(angle_x), np.sin(angle_x), np.cos(angle_y), np.sin(angle_y)
    rotation = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]]) @ np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    return rotation[:, 0], rotation[:, 1]


OBLIQUE_ROW, OBLIQUE_COL = rotated(0.35, -0.2)
GEOMETRIES = {  # name: (row direction, column direction, step between written slices in LPS mm)
    "axial": ((1, 0, 0), (0, 1, 0), (0, 0, 2.5)),
    "axial_head_first": ((1, 0, 0), (0, 1, 0), (0, 0, -2.5)),  # slices written from head to feet
    "sagittal": ((0, 1, 0), (0, 0, -1), (-1.5, 0, 0)),
    "coronal": ((1, 0, 0), (0, 0, -1), (0, 3.0, 0)),
    "oblique": (OBLIQUE_ROW, OBLIQUE_COL, 2.0 * np.cross(OBLIQUE_ROW, OBLIQUE_COL)),
    "gantry_tilt": ((1, 0, 0), (0, 1, 0), (0, 0.6, 2.5)),  # positions step off the normal: a sheared grid
}


def planted_series(folder: Path, geometry: str, rescale=(0.5, -1000.0), **kwargs):
    """A series of background voxels with 6 planted ones; returns their (stored value, LPS position) and the files."""
    row, col, step = GEOMETRIES[geometry]
    spacing_ij, origin = (0.7, 0.9), np.array([-12.5, 30.25, 101.0])
    stored = np.zeros(SHAPE, dtype=np.int16)
    rng = np.random.default_rng(len(geometry))
    planted = []
    for m in range(6):
        i, j, n = (int(rng.integers(0, s)) for s in SHAPE)
        stored[i, j, n] = 200 * (m + 1)
        position = origin + i * spacing_ij[0] * np.asarray(row) + j * spacing_ij[1] * np.asarray(col) + n * np.asarray(step)
        planted.append((stored[i, j, n], position))
    planted = [(s, p) for s, p in planted if s != 0 and (stored == s).sum() == 1]  # (a later plant may overwrite one)
    files = write_series(folder, stored, lps_affine(row, col, step, spacing_ij, origin), rescale=rescale, **kwargs)
    return stored, planted, files


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_planted_voxels_lie_at_inverse_affine_of_their_patient_position(tmp_path, geometry):
    slope, intercept = 0.5, -1000.0
    _, planted, _ = planted_series(tmp_path / "s", geometry, rescale=(slope, intercept), instance_numbers="reversed")
    volume = read_volume(tmp_path / "s")
    assert volume.array.shape == SHAPE and volume.array.dtype == np.float32 and volume.affine.dtype == np.float64
    inverse = np.linalg.inv(volume.affine)
    for stored_value, lps in planted:
        ras = np.array([-lps[0], -lps[1], lps[2], 1.0])
        ijk = (inverse @ ras)[:3]
        np.testing.assert_allclose(ijk, np.round(ijk), atol=1e-4)
        assert volume.array[tuple(np.round(ijk).astype(int))] == stored_value * slope + intercept
    row, col, step = GEOMETRIES[geometry]
    np.testing.assert_allclose(volume.spacing, (0.7, 0.9, np.linalg.norm(step)), rtol=1e-9)
    np.testing.assert_allclose(volume.spacing, np.linalg.norm(volume.affine[:3, :3], axis=0))
    # k runs along the normal row x column, whichever order the files were written or numbered in
    normal_ras = np.cross(row, col) * [-1, -1, 1]
    assert volume.affine[:3, 2] @ normal_ras > 0
    assert (volume.array == intercept).sum() == volume.array.size - len(planted)  # the background survived too


def test_file_names_and_instance_numbers_do_not_order_slices(tmp_path):
    stored, _, files = planted_series(tmp_path / "s", "axial")
    numbers = [int(pydicom.dcmread(f, stop_before_pixels=True).InstanceNumber) for f in files]
    assert numbers != sorted(numbers) and [f.name for f in files] != sorted(f.name for f in files)
    np.testing.assert_array_equal(read_volume(tmp_path / "s").array, stored * 0.5 - 1000.0)


def test_values_equal_pydicoms_modality_lut_with_a_non_integer_rescale(tmp_path):
    rng = np.random.default_rng(1)
    stored = rng.integers(-2000, 3000, size=(12, 10, 4)).astype(np.int16)
    files = write_series(tmp_path / "s", stored, np.diag([0.7, 0.7, 2.5, 1.0]), rescale=(0.37, -1000.5))
    volume = read_volume(tmp_path / "s")
    for k, path in enumerate(files):
        ds = pydicom.dcmread(path)
        expected = apply_modality_lut(ds.pixel_array, ds).astype(np.float32).T  # (I, J)
        np.testing.assert_array_equal(volume.array[:, :, k], expected)


def test_ct_series_carries_patient_series_and_modality(tmp_path):
    write_series(tmp_path / "s", np.zeros((8, 8, 3), np.int16), np.eye(4), patient_id="P-7", series_uid="1.2.3.4")
    volume = read_volume(tmp_path / "s")
    assert (volume.patient_id, volume.series_uid, volume.modality, volume.source) == ("P-7", "1.2.3.4", "CT", tmp_path / "s")
    np.testing.assert_array_equal(volume.array, -1024.0)


@pytest.mark.parametrize("syntax", [RLELossless, JPEGLSLossless, JPEG2000Lossless], ids=lambda s: s.name.split()[0])
def test_compressed_series_reads_equal_to_its_uncompressed_twin(tmp_path, syntax):
    if not get_encoder(syntax).is_available:
        pytest.skip(f"no encoder for {syntax.name}")
    rng = np.random.default_rng(2)
    stored = rng.integers(-1024, 3000, size=(64, 48, 4)).astype(np.int16)  # (OpenJPEG needs 64 px for its resolutions)
    affine = lps_affine(OBLIQUE_ROW, OBLIQUE_COL, 2.5 * np.cross(OBLIQUE_ROW, OBLIQUE_COL), (0.6, 0.6), (10, -20, 30))
    write_series(tmp_path / "plain", stored, affine)
    files = write_series(tmp_path / "packed", stored, affine, transfer_syntax=syntax)
    assert pydicom.dcmread(files[0], stop_before_pixels=True).file_meta.TransferSyntaxUID == syntax
    plain, packed = read_volume(tmp_path / "plain"), read_volume(tmp_path / "packed")
    np.testing.assert_array_equal(packed.array, plain.array)
    np.testing.assert_array_equal(packed.affine, plain.affine)


def test_enhanced_multiframe_file_equals_the_same_series(tmp_path):
    rng = np.random.default_rng(3)
    stored = rng.integers(0, 2000, size=(20, 16, 6)).astype(np.int16)
    affine = lps_affine(OBLIQUE_ROW, OBLIQUE_COL, 2.0 * np.cross(OBLIQUE_ROW, OBLIQUE_COL), (0.8, 0.9), (5, 6, 7))
    write_series(tmp_path / "series", stored, affine, rescale=(0.5, -1000.0))
    path = write_enhanced(tmp_path / "enhanced.dcm", stored, affine, rescale=(0.5, -1000.0))  # frames shuffled
    series, enhanced = read_volume(tmp_path / "series"), read_volume(path)
    np.testing.assert_array_equal(enhanced.array, series.array)
    np.testing.assert_allclose(enhanced.affine, series.affine, atol=1e-9)
    np.testing.assert_array_equal(enhanced.array, stored * 0.5 - 1000.0)


# ---------------------------------------------------------------- NIfTI and orientation
def oblique_ras_affine() -> np.ndarray:
    affine = np.eye(4)
    affine[:3, :3] = np.array([[0.0, 0.2, -2.4], [-0.8, 0.1, 0.3], [0.15, -0.9, 0.2]])  # a permuted, sheared grid
    affine[:3, 3] = [12.0, -40.5, 7.25]
    return affine


def test_nifti_array_and_non_diagonal_affine_are_nibabels(tmp_path):
    rng = np.random.default_rng(4)
    stored = rng.integers(-500, 500, size=SHAPE).astype(np.int16)
    write_nifti(tmp_path / "v.nii.gz", stored, oblique_ras_affine(), (2.0, -5.0))
    volume = read_volume(tmp_path / "v.nii.gz")
    image = nibabel.load(tmp_path / "v.nii.gz")
    np.testing.assert_array_equal(volume.affine, image.affine)
    np.testing.assert_allclose(volume.affine, oblique_ras_affine(), atol=1e-5)  # (sform is float32)
    np.testing.assert_array_equal(volume.array, image.get_fdata(dtype=np.float32))
    np.testing.assert_array_equal(volume.array, stored * 2.0 - 5.0)  # scl_slope / scl_inter applied
    assert volume.array.dtype == np.float32 and volume.patient_id is None


@pytest.mark.parametrize("source", ["nifti", "sagittal", "oblique"])
def test_ras_orientation_is_nibabels_closest_canonical_and_keeps_the_contract(tmp_path, source):
    if source == "nifti":
        path, planted = tmp_path / "v.nii", []
        write_nifti(path, np.arange(np.prod(SHAPE), dtype=np.int16).reshape(SHAPE), oblique_ras_affine(), None)
    else:
        path = tmp_path / "s"
        _, planted, _ = planted_series(path, source)
    stored, canonical = read_volume(path), read_volume(path, orientation="RAS")
    reference = nibabel.as_closest_canonical(nibabel.Nifti1Image(stored.array, stored.affine))
    np.testing.assert_array_equal(canonical.array, reference.get_fdata(dtype=np.float32))
    np.testing.assert_allclose(canonical.affine, reference.affine, atol=1e-12)
    assert nibabel.aff2axcodes(canonical.affine) == ("R", "A", "S")
    assert nibabel.aff2axcodes(read_volume(path, orientation="lps").affine) == ("L", "P", "S")
    np.testing.assert_allclose(sorted(canonical.spacing), sorted(stored.spacing))
    for stored_value, lps in planted:  # the contract, again, on the reoriented volume
        ijk = (np.linalg.inv(canonical.affine) @ [-lps[0], -lps[1], lps[2], 1.0])[:3]
        assert canonical.array[tuple(np.round(ijk).astype(int))] == stored_value * 0.5 - 1000.0
    # every voxel keeps its world position: compare both volumes at the world positions of all voxels
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in SHAPE], indexing="ij"), -1).reshape(-1, 3)
    world = np.c_[ijk, np.ones(len(ijk))] @ stored.affine.T
    moved = np.rint(world @ np.linalg.inv(canonical.affine).T)[:, :3].astype(int)
    np.testing.assert_array_equal(canonical.array[tuple(moved.T)], stored.array[tuple(ijk.T)])


# ---------------------------------------------------------------- synthetic volumes
@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return generate_volumes(tmp_path_factory.mktemp("volumes") / "v", seed=5, patients=3, size=32, slices=10)


def table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_synthetic_dicom_series_and_nifti_are_the_same_volume_in_world_space(synthetic):
    root = synthetic.parent
    nifti, dicom = table(synthetic), table(root / "manifest_dicom.csv")
    assert list(nifti[0]) == ["path", "mask", "label", "patient_id"] and len(nifti) == len(dicom) == 3
    assert [r["label"] for r in nifti] == ["lesion", "no_lesion", "lesion"]
    for a, b in zip(nifti, dicom):
        from_nifti, from_dicom = read_volume(root / a["path"]), read_volume(root / b["path"])
        assert from_dicom.patient_id == b["patient_id"] == a["patient_id"] and from_dicom.modality == "CT"
        np.testing.assert_array_equal(from_dicom.array, from_nifti.array)
        np.testing.assert_allclose(from_dicom.affine, from_nifti.affine, atol=1e-4)
        np.testing.assert_allclose(from_dicom.spacing, (0.7, 0.7, 2.5), atol=1e-6)
        canonical = [read_volume(root / r["path"], orientation="RAS") for r in (a, b)]
        np.testing.assert_array_equal(canonical[0].array, canonical[1].array)
        mask = read_volume(root / a["mask"])
        np.testing.assert_allclose(mask.affine, from_nifti.affine)
        assert mask.array.shape == from_nifti.array.shape and set(np.unique(mask.array)) <= {0.0, 1.0}
        assert (mask.array.sum() > 0) == (a["label"] == "lesion")
        assert -1100 < from_dicom.array.min() < -900 and from_dicom.array.max() > 300  # air ... vertebra, in HU
    oblique = read_volume(root / dicom[2]["path"]).affine[:3, :3]
    assert np.abs(oblique - np.diag(np.diag(oblique))).max() > 0.1  # patient 2's grid is oblique


def test_synthetic_series_files_do_not_follow_position(synthetic):
    folder = synthetic.parent / "dicom" / "P0000"
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in sorted(folder.iterdir())]  # by file name
    z = [float(h.ImagePositionPatient[2]) for h in headers]
    numbers = [int(h.InstanceNumber) for h in headers]
    assert z != sorted(z) and numbers != sorted(numbers) and np.argsort(numbers).tolist() != np.argsort(z).tolist()
    assert pydicom.dcmread(folder / "IM0000.dcm").pixel_array.dtype == np.int16
    assert (float(headers[0].RescaleSlope), float(headers[0].RescaleIntercept)) == (1.0, -1024.0)


def test_generate_volumes_is_deterministic_and_the_cli_writes_it(tmp_path):
    args = dict(seed=1, patients=2, size=16, slices=4)
    a = generate_volumes(tmp_path / "a", **args)
    b = synthetic_main(["--volumes", "--out", str(tmp_path / "b"), "--seed", "1", "--patients", "2", "--size", "16",
                        "--slices", "4"])  # fmt: skip
    files = sorted(p.relative_to(a.parent) for p in a.parent.rglob("*") if p.is_file())
    assert len(files) == 2 * 4 + 4 + 3  # DICOM slices, NIfTI volumes + masks, manifests + dataset.json
    assert all((a.parent / f).read_bytes() == (b.parent / f).read_bytes() for f in files if f.suffix != ".gz")
    np.testing.assert_array_equal(read_volume(a.parent / "nifti/P0000.nii.gz").array,
                                  read_volume(b.parent / "nifti/P0000.nii.gz").array)  # fmt: skip
    with pytest.raises(SystemExit):
        synthetic_main(["--out", str(tmp_path / "c"), "--spacing", "1", "1", "1"])  # --spacing needs --volumes


# ---------------------------------------------------------------- refusals
def assert_refused(path, match: str, **kwargs) -> str:
    with pytest.raises(VolumeError, match=match) as error:
        read_volume(path, **kwargs)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    return message


def rewrite(path: Path, **changes) -> None:
    ds = pydicom.dcmread(path)
    for keyword, value in changes.items():
        if keyword == "pixels":
            ds.set_pixel_data(value, photometric_interpretation="MONOCHROME2", bits_stored=16, generate_instance_uid=False)
        else:
            setattr(ds, keyword, value)
    ds.save_as(path, enforce_file_format=True)


def small_series(folder: Path, count: int = 5, **kwargs) -> list[Path]:
    return write_series(folder, np.zeros((8, 6, count), np.int16), np.diag([0.7, 0.7, 2.5, 1.0]), **kwargs)


def test_refuses_mixed_orientations(tmp_path):
    files = small_series(tmp_path / "s")
    rewrite(files[2], ImageOrientationPatient=[1, 0, 0, 0, 0.9, -0.43588989])
    assert_refused(tmp_path / "s", rf"slices differ in orientation .*{files[2].name}.*same orientation")


def test_refuses_mixed_sizes(tmp_path):
    files = small_series(tmp_path / "s")
    rewrite(files[1], pixels=np.zeros((4, 4), np.int16))
    assert_refused(tmp_path / "s", rf"slices differ in size \(Rows x Columns\): 6x8 .* 4x4 .*{files[1].name}")


def test_refuses_duplicate_positions(tmp_path):
    files = small_series(tmp_path / "s", slice_positions=[0, 1, 1, 2, 3])
    assert_refused(tmp_path / "s", rf"duplicate slice positions: ({files[1].name}|{files[2].name}) and "
                                   rf"({files[1].name}|{files[2].name}) both lie at 2\.5 mm")  # fmt: skip


@pytest.mark.parametrize("positions", [[0, 1, 2, 4, 5], [0, 1, 2, 3.05, 4.05]], ids=["missing_slice", "2_percent"])
def test_refuses_gaps_naming_the_slices_around_them(tmp_path, positions):
    files = small_series(tmp_path / "s", slice_positions=positions)
    message = assert_refused(tmp_path / "s", rf"uneven slice spacing: {files[2].name} and {files[3].name} are "
                                             r"[0-9.]+ mm apart where the series' spacing is 2\.5 mm")  # fmt: skip
    assert "within 1 % or 0.01 mm" in message


def test_accepts_spacing_jitter_within_tolerance(tmp_path):
    small_series(tmp_path / "s", slice_positions=[0, 1, 2.002, 3, 4])  # 0.005 mm: rounding in written positions
    assert read_volume(tmp_path / "s").array.shape == (8, 6, 5)


def test_refuses_positions_off_one_line(tmp_path):
    files = small_series(tmp_path / "s")
    rewrite(files[3], ImagePositionPatient=[4.0, 0.0, 7.5])  # right spacing along the normal, shifted in-plane
    assert_refused(tmp_path / "s", rf"do not lie on one line: {files[3].name} is 4 mm off")


def test_refuses_a_single_slice(tmp_path):
    small_series(tmp_path / "s", count=1)
    assert_refused(tmp_path / "s", r"a single slice \(IM0000.dcm\) is not a volume")
    single = next((tmp_path / "s").iterdir())
    assert_refused(single, rf"one single-frame DICOM file is one slice.*pass the folder .*{re.escape(str(tmp_path / 's'))}")


def test_refuses_two_series_without_choice_and_reads_the_chosen_one(tmp_path):
    small_series(tmp_path / "s", series_uid="1.2.826.1", patient_id="A")
    write_series(tmp_path / "s", np.ones((8, 6, 3), np.int16), np.diag([0.7, 0.7, 2.5, 1.0]), series_uid="1.2.826.2",
                 prefix="B")  # fmt: skip
    assert_refused(tmp_path / "s", r"holds 2 series: 1\.2\.826\.1 \(5 slices\), 1\.2\.826\.2 \(3 slices\); choose one with series_uid=")
    assert read_volume(tmp_path / "s", series_uid="1.2.826.2").array.shape == (8, 6, 3)
    assert read_volume(tmp_path / "s", series_uid="1.2.826.1").patient_id == "A"
    assert_refused(tmp_path / "s", r"no series with SeriesInstanceUID 9\.9; the folder holds 1\.2\.826\.1", series_uid="9.9")


def test_refuses_a_series_with_one_unreadable_slice_as_a_whole(tmp_path):
    files = small_series(tmp_path / "s")
    files[3].write_bytes(files[3].read_bytes()[:-20])  # truncated pixel data
    assert_refused(tmp_path / "s", rf"1 of 5 slices cannot be read, the series is refused as a whole; first: .*"
                                   rf"{files[3].name}: truncated pixel data")  # fmt: skip


def test_refuses_a_folder_with_an_unparseable_dicom_file(tmp_path):
    small_series(tmp_path / "s")
    (tmp_path / "s" / "broken.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"\x02\x00garbage")
    assert_refused(tmp_path / "s", r"broken\.dcm is not a readable DICOM file and may be a slice")


def test_passes_over_non_image_and_non_dicom_files(tmp_path):
    small_series(tmp_path / "s")
    (tmp_path / "s" / "notes.txt").write_text("not an image")
    ds = pydicom.Dataset()  # a DICOM file without an image (as a DICOMDIR or a report is)
    ds.file_meta = pydicom.dataset.FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.88.11"
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = "1.2.3.999"
    ds.SeriesInstanceUID = "1.2.3.998"
    ds.save_as(tmp_path / "s" / "report.dcm", enforce_file_format=True)
    assert read_volume(tmp_path / "s").array.shape == (8, 6, 5)


def test_refuses_empty_folders_and_folders_without_dicom(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(tmp_path / "empty", r"no DICOM files in the folder \(0 other files\); read_volume reads")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    assert_refused(tmp_path / "text", r"no DICOM files in the folder \(1 other files\)")
    (tmp_path / "patient" / "series1").mkdir(parents=True)
    assert_refused(tmp_path / "patient", r"has subfolders series1: pass the folder of one series")


def test_refuses_missing_geometry(tmp_path):
    files = small_series(tmp_path / "s")
    ds = pydicom.dcmread(files[0])
    del ds.ImagePositionPatient
    ds.save_as(files[0], enforce_file_format=True)
    assert_refused(tmp_path / "s", rf"slice {files[0].name} has no ImagePositionPatient \(3 numbers needed\)")


def test_refuses_broken_nifti_files(tmp_path):
    data = np.random.default_rng(0).normal(size=(16, 16, 16)).astype(np.float32)
    write_nifti(tmp_path / "v.nii.gz", data, np.eye(4), None)
    truncated = tmp_path / "truncated.nii.gz"
    truncated.write_bytes((tmp_path / "v.nii.gz").read_bytes()[:-2000])
    assert_refused(truncated, r"truncated or corrupt NIfTI data \(EOFError: .*\); the header announces shape \(16, 16, 16\)")
    (tmp_path / "text.nii").write_text("this is not a NIfTI header " * 20)
    assert_refused(tmp_path / "text.nii", r"not a NIfTI file \(.*\); read_volume reads a \.nii/\.nii\.gz file")
    data[3, 4, 5], data[0, 0, 1] = np.nan, np.inf
    write_nifti(tmp_path / "nan.nii", data, np.eye(4), None)
    assert_refused(tmp_path / "nan.nii", r"2 NaN or infinite voxels \(the first at \[0, 0, 1\]\); a volume must be finite")
    write_nifti(tmp_path / "4d.nii", np.zeros((4, 4, 4, 3), np.int16), np.eye(4), None)
    assert_refused(tmp_path / "4d.nii", r"4-D NIfTI of shape \(4, 4, 4, 3\) holds 3 volumes")


def test_refuses_a_singular_affine(tmp_path):
    header = nibabel.Nifti1Header()
    header.set_data_dtype(np.float32)
    header.set_sform(np.diag([1.0, 1.0, 0.0, 1.0]), code=2)  # (nibabel refuses to build a qform from it)
    nibabel.save(nibabel.Nifti1Image(np.zeros((4, 5, 6), np.float32), None, header), tmp_path / "flat.nii.gz")
    assert_refused(tmp_path / "flat.nii.gz", r"singular voxel-to-world affine \(spacing 1, 1, 0 mm.*check the header's sform")


def test_refuses_other_paths_and_options(tmp_path):
    with pytest.raises(ImageReadError, match="not found; read_volume reads"):
        read_volume(tmp_path / "missing.nii.gz")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    assert_refused(tmp_path / "image.png", r"not a volume file \(suffix '\.png', not DICOM\)")
    small_series(tmp_path / "s")
    with pytest.raises(ValueError, match="orientation must be None or a 3-letter axis code"):
        read_volume(tmp_path / "s", orientation="RAP")
    write_nifti(tmp_path / "v.nii", np.zeros((2, 2, 2), np.int16), np.eye(4), None)
    with pytest.raises(ValueError, match="series_uid= chooses a series in a DICOM folder"):
        read_volume(tmp_path / "v.nii", series_uid="1.2")


def test_refuses_a_multiframe_file_without_frame_positions(tmp_path):
    stored = np.zeros((8, 6, 3), np.int16)
    path = write_enhanced(tmp_path / "e.dcm", stored, np.eye(4))
    ds = pydicom.dcmread(path)
    del ds.PerFrameFunctionalGroupsSequence
    ds.save_as(path, enforce_file_format=True)
    assert_refused(path, r"multi-frame DICOM file without a PerFrameFunctionalGroupsSequence for its 3 frames")
    truncated = write_enhanced(tmp_path / "t.dcm", stored, np.eye(4))
    truncated.write_bytes(truncated.read_bytes()[:-50])
    assert_refused(truncated, r"t\.dcm: truncated pixel data")  # the DICOM reader's refusal, as a VolumeError


def test_refuses_pydicoms_rt_dose_and_single_ct_files():
    rtdose, ct = (get_testdata_file(name, download=False) for name in ("rtdose.dcm", "CT_small.dcm"))
    if rtdose is None or ct is None:
        pytest.skip("pydicom's test files are not installed")
    assert_refused(rtdose, r"without a PerFrameFunctionalGroupsSequence for its 15 frames \(not an enhanced image")
    assert_refused(ct, r"one single-frame DICOM file is one slice, not a volume")


def test_reading_and_refusing_write_nothing(tmp_path):
    planted_series(tmp_path / "s", "oblique")
    small_series(tmp_path / "s", series_uid="1.2.3", prefix="B")  # a second series: refused without series_uid
    write_nifti(tmp_path / "v.nii.gz", np.zeros((4, 4, 4), np.int16), np.eye(4), None)

    def snapshot() -> dict:
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")}

    before = snapshot()
    with pytest.raises(VolumeError):
        read_volume(tmp_path / "s")
    read_volume(tmp_path / "s", series_uid="1.2.3", orientation="RAS")
    read_volume(tmp_path / "v.nii.gz", orientation="LPS")
    assert snapshot() == before


def test_volume_spacing_is_the_affines_column_norms():
    affine = oblique_ras_affine()
    volume = Volume(np.zeros((2, 3, 4), np.float32), affine)
    np.testing.assert_allclose(volume.spacing, np.linalg.norm(affine[:3, :3], axis=0))
    with pytest.raises(ValueError, match="3-D array"):
        Volume(np.zeros((2, 3), np.float32), affine)
