"""Synthetic CT volumes: the same patients as NIfTI files and as DICOM series, with 3-D lesions and label maps.

Each patient is a phantom defined in patient space (millimetres): an elliptic body with a fat rim, smooth "tissue"
around 40 HU, an organ, contrast-filled vessels and a vertebra along the body axis, and, for every other patient,
one or two ellipsoidal lesions of varied size, shape, contrast (hypo- or hyperdense) and texture. It is sampled on
the patient's voxel grid (0.7 x 0.7 mm in-plane, 2.5 mm slices by default; every third patient's grid oblique,
tilted about two axes) with correlated noise, then written twice from the same stored int16 values:

- ``nifti/P0000.nii.gz`` (scl_slope 1, scl_inter -1024: Hounsfield units) and its label map
  ``nifti/P0000_mask.nii.gz`` (uint8, 1 inside a lesion), with the voxel -> RAS+ affine;
- ``dicom/P0000/`` a CT series of single-frame files (RescaleSlope 1, RescaleIntercept -1024), written in
  shuffled order under shuffled names, with InstanceNumbers that do not follow position, so only
  ImagePositionPatient orders the slices.

``manifest.csv`` lists the NIfTI volumes and ``manifest_dicom.csv`` the DICOM folders, both with
``path,mask,label,patient_id`` (label ``lesion`` / ``no_lesion`` per patient; no split column: vitlab splits by
patient). Everything is deterministic by ``seed``. :func:`write_series` is the DICOM writer, usable on its own
(the tests plant voxels with it).

Run ``python -m vitlab.data.synthetic --volumes --out DIR`` or call :func:`generate_volumes`.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset
from pydicom.uid import CTImageStorage, generate_uid
from pydicom.valuerep import format_number_as_ds

from vitlab.data.synthetic.phantom import INTERCEPT_HU, LABELS, dicom_dataset, smooth_field, soft
from vitlab.data.readers.volume import LPS_TO_RAS

VOLUME_GENERATOR_VERSION = 1  # bump when the generated volumes change


def _ds(values: np.ndarray) -> list[str]:
    """Numbers as DICOM decimal strings (at most 16 characters each)."""
    return [format_number_as_ds(float(v)) for v in np.ravel(values)]


def write_series(
    folder: str | os.PathLike,
    stored: np.ndarray,
    affine_lps: np.ndarray,
    *,
    rescale: tuple[float, float] = (1.0, INTERCEPT_HU),
    slice_positions: Sequence[float] | None = None,
    instance_numbers: str | Sequence[int] = "shuffled",
    transfer_syntax: str | None = None,
    patient_id: str = "SYN-VOLUME",
    series_uid: str | None = None,
    seed: int = 0,
    modality: str = "CT",
    prefix: str = "IM",
) -> list[Path]:
    """Write ``stored`` as a DICOM series of single-frame files into ``folder`` (created).

    Slice ``n`` holds ``stored[:, :, n]`` (its pixel array is the transpose: rows along j, columns along i) at
    ImagePositionPatient ``affine_lps @ [0, 0, slice_positions[n], 1]``; ImageOrientationPatient is the unit
    directions of the affine's first two columns and PixelSpacing their norms (between rows, between columns).
    Files are written in a shuffled order under shuffled names (``IM0007.dcm``); nothing else in ``folder`` is touched.

    Args:
        folder: Destination folder.
        stored: (I, J, N) int16 or uint16 stored values.
        affine_lps: (4, 4) voxel -> LPS mm.
        rescale: (RescaleSlope, RescaleIntercept).
        slice_positions: k of each slice (default 0..N-1); repeat or skip values to plant duplicates or gaps.
        instance_numbers: ``"shuffled"``, ``"reversed"`` (the last position gets 1), ``"position"`` or one
            number per slice.
        transfer_syntax: A transfer syntax UID to compress with (pydicom's encoders: RLE Lossless, JPEG-LS
            Lossless, JPEG 2000 Lossless), or None for Explicit VR Little Endian.
        patient_id: PatientID.
        series_uid: SeriesInstanceUID (default: derived from ``seed`` and ``patient_id``).
        seed: Seeds the shuffles and the UIDs.
        modality: Modality.
        prefix: File names start with it (two series in one folder need two prefixes).

    Returns:
        The files, in slice order.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    count = stored.shape[2]
    positions = np.arange(count, dtype=float) if slice_positions is None else np.asarray(slice_positions, dtype=float)
    rng = np.random.default_rng([seed, count, 7])
    if isinstance(instance_numbers, str):
        numbers = {"shuffled": rng.permutation(count) + 1, "reversed": np.arange(count, 0, -1),
                   "position": np.arange(1, count + 1)}[instance_numbers]  # fmt: skip
    else:
        numbers = np.asarray(instance_numbers)
    names = [f"{prefix}{m:04d}.dcm" for m in rng.permutation(count)]
    uid = lambda *parts: generate_uid(entropy_srcs=["vitlab-volume", str(seed), patient_id, *map(str, parts)])  # noqa: E731
    series_uid = series_uid or uid("series")
    row, col = affine_lps[:3, 0], affine_lps[:3, 1]
    orientation = _ds(np.concatenate([row / np.linalg.norm(row), col / np.linalg.norm(col)]))
    pixel_spacing = _ds([np.linalg.norm(col), np.linalg.norm(row)])
    paths = [folder / name for name in names]
    for n in rng.permutation(count):  # the order files are written in
        sop_uid = uid(series_uid, n, "sop")
        ds = dicom_dataset(CTImageStorage, sop_uid)
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = uid("study"), series_uid, uid("frame")
        ds.PatientID, ds.PatientName, ds.Modality = patient_id, f"Synthetic^{patient_id}", modality
        ds.Manufacturer, ds.SeriesNumber, ds.InstanceNumber = "vitlab synthetic", 1, int(numbers[n])
        ds.ImagePositionPatient = _ds((affine_lps @ [0.0, 0.0, positions[n], 1.0])[:3])
        ds.ImageOrientationPatient, ds.PixelSpacing = orientation, pixel_spacing
        ds.SliceThickness = format_number_as_ds(float(np.linalg.norm(affine_lps[:3, 2])))
        ds.RescaleSlope, ds.RescaleIntercept = _ds(rescale)
        ds.RescaleType = "HU" if modality == "CT" else "US"
        ds.WindowCenter, ds.WindowWidth = "40", "400"
        pixels = np.ascontiguousarray(stored[:, :, n].T)  # (rows, columns) = (J, I)
        ds.set_pixel_data(pixels, photometric_interpretation="MONOCHROME2", bits_stored=16, generate_instance_uid=False)
        if transfer_syntax is not None:
            ds.compress(transfer_syntax, generate_instance_uid=False)
        ds.save_as(paths[n], enforce_file_format=True)
    return paths


def write_enhanced(
    path: str | os.PathLike,
    stored: np.ndarray,
    affine_lps: np.ndarray,
    *,
    rescale: tuple[float, float] = (1.0, INTERCEPT_HU),
    frame_order: Sequence[int] | None = None,
    patient_id: str = "SYN-VOLUME",
    seed: int = 0,
) -> Path:
    """Write ``stored`` (I, J, N) as one Enhanced CT multi-frame file: per-frame PlanePositionSequence, shared
    PlaneOrientationSequence, PixelMeasuresSequence and PixelValueTransformationSequence.

    ``frame_order`` lists which slice each frame holds (default: a shuffle), so that only the positions order them.
    """
    from pydicom.sequence import Sequence as DicomSequence
    from pydicom.uid import EnhancedCTImageStorage

    count = stored.shape[2]
    order = np.random.default_rng([seed, count, 11]).permutation(count) if frame_order is None else np.asarray(frame_order)
    item = lambda **values: _item(values)  # noqa: E731
    sop_uid = generate_uid(entropy_srcs=["vitlab-enhanced", str(seed), patient_id])
    ds = dicom_dataset(EnhancedCTImageStorage, sop_uid)
    ds.SeriesInstanceUID = generate_uid(entropy_srcs=["vitlab-enhanced-series", str(seed), patient_id])
    ds.PatientID, ds.Modality = patient_id, "CT"
    row, col = affine_lps[:3, 0], affine_lps[:3, 1]
    shared = item(
        PlaneOrientationSequence=DicomSequence([item(ImageOrientationPatient=_ds(np.concatenate(
            [row / np.linalg.norm(row), col / np.linalg.norm(col)])))]),
        PixelMeasuresSequence=DicomSequence([item(PixelSpacing=_ds([np.linalg.norm(col), np.linalg.norm(row)]),
                                                  SliceThickness=format_number_as_ds(float(np.linalg.norm(affine_lps[:3, 2]))))]),
        PixelValueTransformationSequence=DicomSequence([item(RescaleSlope=_ds(rescale[:1])[0],
                                                             RescaleIntercept=_ds(rescale[1:])[0], RescaleType="HU")]),
    )  # fmt: skip
    ds.SharedFunctionalGroupsSequence = DicomSequence([shared])
    ds.PerFrameFunctionalGroupsSequence = DicomSequence([
        item(PlanePositionSequence=DicomSequence([item(ImagePositionPatient=_ds((affine_lps @ [0.0, 0.0, k, 1.0])[:3]))]))
        for k in order
    ])  # fmt: skip
    frames = np.ascontiguousarray(np.transpose(stored[:, :, order], (2, 1, 0)))  # (N, rows, columns)
    ds.set_pixel_data(frames, photometric_interpretation="MONOCHROME2", bits_stored=16, generate_instance_uid=False)
    ds.save_as(path, enforce_file_format=True)
    return Path(path)


def _item(values: dict) -> Dataset:
    item = Dataset()
    for keyword, value in values.items():
        setattr(item, keyword, value)
    return item


def write_nifti(path: str | os.PathLike, stored: np.ndarray, affine_ras: np.ndarray, rescale: tuple[float, float] | None) -> None:
    """Write ``stored`` (I, J, K) with ``affine_ras`` as sform and qform (scanner space) and scl_slope / scl_inter."""
    import nibabel

    image = nibabel.Nifti1Image(stored, affine_ras)
    image.header.set_qform(affine_ras, code=1)
    image.header.set_sform(affine_ras, code=1)
    image.header.set_xyzt_units("mm")
    if rescale is not None:
        image.header.set_slope_inter(*rescale)
    nibabel.save(image, path)


# ---------------------------------------------------------------- the phantom
def _rotation(rng: np.random.Generator, tilt_degrees: tuple[float, float]) -> np.ndarray:
    """A rotation about x then y, by angles drawn up to ``tilt_degrees`` (random signs), (3, 3)."""
    ax, ay = np.radians(tilt_degrees) * rng.uniform(0.6, 1.0, 2) * rng.choice([-1, 1], 2)
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    return ry @ rx


def patient_affine(rng: np.random.Generator, shape: tuple[int, int, int], spacing: Sequence[float], oblique: bool) -> np.ndarray:
    """Voxel -> LPS affine (4, 4) of an axial (or oblique) grid whose centre lies at the patient origin."""
    rotation = _rotation(rng, (25.0, 12.0)) if oblique else np.eye(3)
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag(spacing)
    affine[:3, 3] = -affine[:3, :3] @ ((np.array(shape) - 1) / 2.0)
    return affine


def _lesions(rng, affine, shape, body, spine, difficulty, spacing) -> list[dict]:
    """One or two ellipsoidal lesions (LPS mm) centred on voxels inside the body, away from the spine."""
    a, b = body
    low, high = (1 - difficulty) * np.array([150.0, 300.0]) + difficulty * np.array([10.0, 30.0])  # HU
    fov = min(shape[0] * spacing[0], shape[1] * spacing[1])
    r_low, r_high = fov * ((1 - difficulty) * np.array([0.08, 0.2]) + difficulty * np.array([0.03, 0.09]))  # mm
    out = []
    for _ in range(1 + int(rng.random() < 0.3)):
        radius = float(np.exp(rng.uniform(np.log(r_low), np.log(r_high))))
        for _ in range(200):  # rejection sampling of the centre voxel
            ijk = rng.uniform(0.2, 0.8, 3) * (np.array(shape) - 1)
            centre = (affine @ [*ijk, 1.0])[:3]
            inside = (centre[0] / a) ** 2 + (centre[1] / b) ** 2 < 0.5
            if inside and np.hypot(centre[0] - spine[0], centre[1] - spine[1]) > spine[2] + radius + 2.0:
                break
        axes = np.maximum(radius * rng.uniform(0.6, 1.0, 3), 0.6 * max(spacing))  # every lesion covers a voxel
        rotation, _ = np.linalg.qr(rng.standard_normal((3, 3)))
        out.append(dict(centre=centre, axes=axes, rotation=rotation, edge=rng.uniform(0.1, 0.3) * radius,
                        contrast=rng.uniform(low, high) * (-1 if rng.random() < 0.6 else 1),
                        texture=rng.choice(["homogeneous", "heterogeneous", "rim"])))  # fmt: skip
    return out


def phantom_volume(
    rng: np.random.Generator, affine_lps: np.ndarray, shape: tuple[int, int, int], lesion: bool, difficulty: float
) -> tuple[np.ndarray, np.ndarray]:
    """HU (I, J, K) float32 and lesion mask (I, J, K) uint8 of one patient sampled on the grid ``affine_lps``."""
    spacing = np.linalg.norm(affine_lps[:3, :3], axis=0)
    fov = np.array(shape) * spacing  # mm
    ijk = np.stack(np.meshgrid(*[np.arange(n, dtype=float) for n in shape], indexing="ij"), axis=-1)  # (I, J, K, 3)
    x, y, z = np.moveaxis(ijk @ affine_lps[:3, :3].T + affine_lps[:3, 3], -1, 0)  # each (I, J, K), LPS mm
    a, b = fov[0] * rng.uniform(0.36, 0.44), fov[1] * rng.uniform(0.27, 0.34)
    body_depth = (1 - np.hypot(x / a, y / b)) * min(a, b)
    body = soft(body_depth, 0.5)
    fat_mm = fov[0] * rng.uniform(0.03, 0.06)
    fat = soft(body_depth - 1.0, 0.4) * (1 - soft(body_depth - 1.0 - fat_mm, 0.6))
    hu = np.full(shape, 40.0)
    for _ in range(6):  # smooth tissue: plane waves of 0.2-0.8 field of view
        direction = rng.standard_normal(3)
        frequency = direction / np.linalg.norm(direction) / (fov[0] * rng.uniform(0.2, 0.8))
        hu += 8.0 * np.cos(2 * np.pi * (frequency[0] * x + frequency[1] * y + frequency[2] * z) + rng.uniform(0, 2 * np.pi))
    ox, oy = rng.uniform(-0.3, 0.3) * a, rng.uniform(-0.35, 0.1) * b
    organ = (1 - np.sqrt(((x - ox) / (0.4 * a)) ** 2 + ((y - oy) / (0.4 * b)) ** 2 + (z / (0.6 * fov[2])) ** 2))
    hu += rng.uniform(12.0, 30.0) * soft(organ * 0.4 * min(a, b), 1.0)
    for _ in range(int(rng.integers(2, 6))):  # vessels along the body axis, drifting
        vx, vy, radius = rng.uniform(-0.5, 0.5) * a, rng.uniform(-0.5, 0.3) * b, fov[0] * rng.uniform(0.015, 0.035)
        drift = rng.normal(0, 0.05, 2)
        hu += rng.uniform(60, 140) * soft(radius - np.hypot(x - vx - drift[0] * z, y - vy - drift[1] * z), 0.3)
    spine = (rng.normal(0, 0.5), b * rng.uniform(0.6, 0.7), fov[0] * rng.uniform(0.05, 0.065))  # posterior: +y in LPS
    hu += 600.0 * soft(spine[2] - np.hypot(x - spine[0], y - spine[1]), 0.5)
    mask = np.zeros(shape, dtype=np.uint8)
    hetero = smooth_field(rng, shape, 1.5)
    for d in _lesions(rng, affine_lps, shape, (a, b), spine, difficulty, spacing) if lesion else []:
        local = (np.stack([x, y, z], axis=-1) - d["centre"]) @ d["rotation"] / d["axes"]  # (I, J, K, 3)
        rho = np.linalg.norm(local, axis=-1)
        inside_mm = (1 - rho) * d["axes"].min()
        weight = soft(inside_mm, d["edge"])
        if d["texture"] == "heterogeneous":
            weight = weight * np.clip(0.7 + 0.5 * hetero, 0.0, 1.6)
        elif d["texture"] == "rim":
            weight = weight - 1.6 * soft((0.5 - rho) * d["axes"].min(), d["edge"] / 2)
        hu += d["contrast"] * weight
        mask |= (rho < 1).astype(np.uint8)
    hu = hu * (1 - fat) + (-100.0 + 0.3 * (hu - 40.0)) * fat
    noise = smooth_field(rng, shape, 0.6) * rng.uniform(8.0, 14.0)
    return (-1000.0 + (hu + 1000.0) * body + noise).astype(np.float32), mask


# ---------------------------------------------------------------- the dataset
def generate_volumes(
    out: str | os.PathLike,
    seed: int = 0,
    patients: int = 4,
    size: int = 64,
    slices: int = 24,
    spacing: Sequence[float] = (0.7, 0.7, 2.5),
    difficulty: float = 0.15,
) -> Path:
    """Write the synthetic volumes into ``out`` (created; must be empty if it exists), see the module docstring.

    Args:
        out: Destination folder.
        seed: Everything is a deterministic function of the arguments.
        patients: Number of patients; the even ones carry lesions.
        size: Columns and rows per slice.
        slices: Slices per volume.
        spacing: Voxel size in mm: between columns, between rows, between slices.
        difficulty: From 0 (lesions of 150-300 HU contrast, radius 8-20 % of the field of view) to 1 (10-30 HU,
            3-9 %); linear in between.

    Returns:
        Path of ``manifest.csv`` (the NIfTI volumes; ``manifest_dicom.csv`` beside it lists the DICOM folders).
    """
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    for name, value, low in (("patients", patients, 1), ("size", size, 8), ("slices", slices, 2)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    spacing = tuple(float(s) for s in spacing)
    if len(spacing) != 3 or not all(s > 0 for s in spacing):
        raise ValueError(f"spacing must be 3 positive numbers (mm), got {spacing!r}")
    if not 0.0 <= difficulty <= 1.0:
        raise ValueError(f"difficulty must be in [0, 1], got {difficulty}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"refusing to write into non-empty folder {out}")
    (out / "nifti").mkdir(parents=True)
    rows, dicom_rows = [], []
    shape = (size, size, slices)
    for p in range(patients):
        rng = np.random.default_rng([seed, p, 3])
        affine = patient_affine(rng, shape, spacing, oblique=p % 3 == 2)
        label = LABELS[p % 2]
        hu, mask = phantom_volume(rng, affine, shape, label == LABELS[0], difficulty)
        stored = np.clip(np.rint(hu - INTERCEPT_HU), -32768, 32767).astype(np.int16)  # (I, J, K)
        patient_id, name = f"SYNV{seed:03d}-{p:04d}", f"P{p:04d}"
        write_nifti(out / "nifti" / f"{name}.nii.gz", stored, LPS_TO_RAS @ affine, (1.0, INTERCEPT_HU))
        write_nifti(out / "nifti" / f"{name}_mask.nii.gz", mask, LPS_TO_RAS @ affine, None)
        write_series(out / "dicom" / name, stored, affine, patient_id=patient_id, seed=seed)
        mask_rel = f"nifti/{name}_mask.nii.gz"
        rows.append((f"nifti/{name}.nii.gz", mask_rel, label, patient_id))
        dicom_rows.append((f"dicom/{name}", mask_rel, label, patient_id))
    for file, table in (("manifest.csv", rows), ("manifest_dicom.csv", dicom_rows)):
        with open(out / file, "w", newline="") as f:
            csv.writer(f).writerows([("path", "mask", "label", "patient_id"), *table])
    params = dict(seed=seed, patients=patients, size=size, slices=slices, spacing=list(spacing), difficulty=difficulty)
    (out / "dataset.json").write_text(json.dumps({"volume_generator_version": VOLUME_GENERATOR_VERSION, **params}, indent=1))
    return out / "manifest.csv"
