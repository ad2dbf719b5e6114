"""Embedded synthetic CT dataset: faint lesions on feature-poor tissue, as real DICOM files.

Each synthetic patient is a short stack of axial CT slices (int16, RescaleIntercept -1024, soft
tissue window 40/400 in the tags): an elliptical body with a fat rim and skin, smooth
low-frequency "tissue" around 40 HU with correlated noise, one organ of slightly higher density,
a few contrast-filled vessels and a vertebra. Every patient carries one or two lesions that run
through a contiguous half of the slices, so labels ``lesion`` / ``no_lesion`` are per slice,
balanced, and a lesion slice and its lesion-free neighbour share the same anatomy (no shortcut
through patient appearance; a split that is not grouped by patient leaks). Lesions vary in size
(small ones are the hard cases), edge sharpness, hypo- or hyperdensity and texture
(homogeneous, heterogeneous, rim-enhancing); ``difficulty`` scales their contrast and size (0:
obvious, 1: barely above the noise). ``manifest.csv`` has ``path,label,patient_id,mask`` and no split
column, so vitlab's patient-grouped split applies; ``mask`` is each slice's lesion label map
(``masks/P0000/slice_00.png``, uint8: 0 background, 1 lesion, the inside of the outlines that were drawn),
for detection and segmentation. Everything is deterministic by ``seed``.

Run ``python -m vitlab.data.synthetic --out DIR`` or call :func:`generate`;
:func:`~vitlab.data.synthetic.embedded.embedded_dataset` keeps one generated copy per parameter set in the cache folder.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image
from pydicom.uid import CTImageStorage, generate_uid

from vitlab.data.synthetic.phantom import INTERCEPT_HU, LABELS, dicom_dataset, smooth_field, soft

GENERATOR_VERSION = 3  # bump when the generated images change


def _ellipse_depth(
    x: np.ndarray, y: np.ndarray, cx: float, cy: float, ax: float, ay: float, angle: float = 0.0
) -> np.ndarray:
    """Approximate signed distance (px, positive inside) to an ellipse, (S, S)."""
    c, s = np.cos(angle), np.sin(angle)
    u, v = (x - cx) * c + (y - cy) * s, -(x - cx) * s + (y - cy) * c
    rho = np.sqrt((u / ax) ** 2 + (v / ay) ** 2)
    return (1.0 - rho) * min(ax, ay)


def _patient_volume(
    rng: np.random.Generator, slices: int, size: int, difficulty: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One patient's slices in HU, (slices, size, size) float32, which slices show a lesion (slices,) bool and
    the lesion masks (slices, size, size) uint8 (1 inside a lesion outline)."""
    px = size / 128.0  # pixel scale relative to the default size
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    shape = (slices, size, size)
    tissue = 18.0 * smooth_field(rng, shape, 10 * px) + 7.0 * smooth_field(rng, shape, 2.5 * px)  # (K, S, S)
    hetero = smooth_field(rng, shape, 1.5 * px)
    noise = smooth_field(rng, shape, 0.6)
    noise_hu = rng.uniform(8.0, 14.0)

    cx, cy = size / 2 + rng.normal(0, 0.03 * size), size / 2 + rng.normal(0, 0.03 * size)
    ax, ay, tilt = size * rng.uniform(0.36, 0.45), size * rng.uniform(0.27, 0.35), rng.uniform(-0.15, 0.15)
    taper = rng.uniform(-0.08, 0.08)
    fat_px = rng.uniform(3.0, 7.0) * px
    organ = (rng.uniform(-0.3, 0.3) * ax, rng.uniform(-0.35, 0.1) * ay, rng.uniform(0.3, 0.45), rng.uniform(0.3, 0.5))
    organ_hu = rng.uniform(12.0, 30.0)
    spine = (cx + rng.normal(0, 1.5 * px), cy + ay * rng.uniform(0.6, 0.7), rng.uniform(0.05, 0.065) * size)
    vessels = [(rng.uniform(-0.5, 0.5) * ax, rng.uniform(-0.5, 0.4) * ay, rng.uniform(0.8, 1.8) * px,
                rng.uniform(60, 140), rng.normal(0, 0.7 * px, 2)) for _ in range(rng.integers(2, 6))]  # fmt: skip
    run = slices // 2  # lesion slices: a contiguous run of half of them
    start = int(rng.integers(0, slices - run + 1))
    has_lesion = np.zeros(slices, dtype=bool)
    has_lesion[start : start + run] = True
    lesions = _draw_lesions(rng, start, run, px, (cx, cy, ax, ay), spine, difficulty)

    volume = np.empty(shape, dtype=np.float32)
    masks = np.zeros(shape, dtype=np.uint8)
    for k in range(slices):
        dz = (k - (slices - 1) / 2) / slices
        body_depth = _ellipse_depth(x, y, cx, cy, ax * (1 + taper * dz), ay * (1 + taper * dz), tilt)
        body = soft(body_depth, 0.7)
        fat = soft(body_depth - 1.5 * px, 0.7) * (1 - soft(body_depth - 1.5 * px - fat_px, 1.0))
        hu = 40.0 + tissue[k]
        ox, oy, oa, ob = organ
        hu += organ_hu * soft(_ellipse_depth(x, y, cx + ox, cy + oy, oa * ax, ob * ay, 0.3), 2.0 * px)
        for vx, vy, vr, vhu, drift in vessels:
            vdepth = vr - np.hypot(x - cx - vx - drift[0] * k, y - cy - vy - drift[1] * k)
            hu += vhu * soft(vdepth, 0.5)
        hu += 600.0 * soft(spine[2] - np.hypot(x - spine[0], y - spine[1]), 0.8)
        for draw in lesions if has_lesion[k] else []:
            added, inside = _lesion_hu(x, y, k, draw, hetero[k])
            hu += added
            masks[k] |= inside
        hu = hu * (1 - fat) + (-100.0 + 0.3 * tissue[k]) * fat
        volume[k] = -1000.0 + (hu + 1000.0) * body + noise_hu * noise[k]
    return volume, has_lesion, masks


def _draw_lesions(
    rng: np.random.Generator,
    start: int,
    run: int,
    px: float,
    body: tuple[float, float, float, float],
    spine: tuple[float, float, float],
    difficulty: float,
) -> list[dict]:
    """One or two lesions spanning slices ``start:start + run``: inside the body, away from the spine."""
    cx, cy, ax, ay = body
    low, high = (1 - difficulty) * np.array([150.0, 300.0]) + difficulty * np.array([10.0, 30.0])  # HU
    r_low, r_high = (1 - difficulty) * np.array([8.0, 20.0]) + difficulty * np.array([2.5, 8.0])  # px at 128
    draws = []
    for _ in range(1 + int(rng.random() < 0.25)):
        radius = np.exp(rng.uniform(np.log(r_low), np.log(r_high))) * px
        for _ in range(100):  # rejection sampling of the centre
            lx, ly = cx + rng.uniform(-0.7, 0.7) * ax, cy + rng.uniform(-0.7, 0.7) * ay
            inside = ((lx - cx) / ax) ** 2 + ((ly - cy) / ay) ** 2 < 0.55
            if inside and np.hypot(lx - spine[0], ly - spine[1]) > spine[2] + radius + 3 * px:
                break
        draws.append(dict(
            x=lx, y=ly, z=start + (run - 1) / 2, rz=(run / 2 + 0.5) * rng.uniform(1.0, 1.4),
            radius=radius, aspect=rng.uniform(0.7, 1.0), angle=rng.uniform(0, np.pi),
            wobble=(rng.uniform(0, 0.15), rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.1), rng.uniform(0, 2 * np.pi)),
            edge=rng.uniform(0.1, 0.3) * radius, contrast=rng.uniform(low, high) * (-1 if rng.random() < 0.6 else 1),
            texture=rng.choice(["homogeneous", "heterogeneous"] + ["rim"] * int(radius > 7 * px)),
        ))  # fmt: skip
    return draws


def _lesion_hu(x: np.ndarray, y: np.ndarray, k: int, d: dict, hetero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HU added by one lesion on slice ``k``, (S, S), and its mask (S, S) uint8 (inside the outline)."""
    r_k = d["radius"] * np.sqrt(max(0.0, 1.0 - ((k - d["z"]) / d["rz"]) ** 2))
    c, s = np.cos(d["angle"]), np.sin(d["angle"])
    u, v = (x - d["x"]) * c + (y - d["y"]) * s, (-(x - d["x"]) * s + (y - d["y"]) * c) / d["aspect"]
    phi, dist = np.arctan2(v, u), np.hypot(u, v)
    a2, p2, a3, p3 = d["wobble"]
    outline = r_k * (1 + a2 * np.cos(2 * phi + p2) + a3 * np.cos(3 * phi + p3))
    inside = (dist < outline).astype(np.uint8)
    mask = soft(outline - dist, d["edge"])
    if d["texture"] == "heterogeneous":
        mask = mask * np.clip(0.7 + 0.5 * hetero, 0.0, 1.6)
    elif d["texture"] == "rim":
        mask = mask - 1.6 * soft(0.5 * outline - dist, d["edge"] / 2)  # rim, opposite-sign core
    return d["contrast"] * mask, inside


def _write_slice(path: Path, hu: np.ndarray, seed: int, patient: int, k: int, size_mm: float) -> None:
    uid = lambda *parts: generate_uid(entropy_srcs=["vitlab-synthetic", str(seed), *map(str, parts)])  # noqa: E731
    sop_uid = uid(patient, k, "sop")
    ds = dicom_dataset(CTImageStorage, sop_uid)
    ds.StudyInstanceUID, ds.SeriesInstanceUID = uid(patient, "study"), uid(patient, "series")
    ds.FrameOfReferenceUID = uid(patient, "frame")
    ds.PatientID, ds.PatientName = f"SYN{seed:03d}-{patient:04d}", f"Synthetic^{patient:04d}"
    ds.Modality, ds.Manufacturer, ds.ImageType = "CT", "vitlab synthetic", ["DERIVED", "SECONDARY", "AXIAL"]
    ds.SeriesNumber, ds.InstanceNumber = 1, k + 1
    spacing = size_mm / hu.shape[0]
    ds.PixelSpacing, ds.SliceThickness = [spacing, spacing], 5.0
    ds.ImagePositionPatient = [-size_mm / 2, -size_mm / 2, 5.0 * k]
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = INTERCEPT_HU, 1.0, "HU"
    ds.WindowCenter, ds.WindowWidth = 40.0, 400.0
    stored = np.clip(np.rint(hu - INTERCEPT_HU), -32768, 32767).astype(np.int16)  # (S, S)
    ds.set_pixel_data(stored, photometric_interpretation="MONOCHROME2", bits_stored=16, generate_instance_uid=False)
    ds.save_as(path, enforce_file_format=True)


def generate(
    out: str | os.PathLike,
    seed: int = 0,
    patients: int = 48,
    slices: int = 6,
    size: int = 128,
    difficulty: float = 0.15,
) -> Path:
    """Write the synthetic dataset into ``out`` (created; must be empty if it exists).

    Args:
        out: Destination folder.
        seed: Everything is a deterministic function of the arguments.
        patients: Number of patients.
        slices: Slices per patient; the lesion shows on ``slices // 2`` of them.
        size: Image side in pixels.
        difficulty: From 0 (lesions of 150-300 HU contrast and 8-20 px radius at size 128: obvious)
            to 1 (10-30 HU, 2.5-8 px: near the noise); linear in between.

    Returns:
        Path of ``manifest.csv`` (columns ``path,label,patient_id,mask``).
    """
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    for name, value, low in (("patients", patients, 2), ("slices", slices, 2), ("size", size, 16)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not 0.0 <= difficulty <= 1.0:
        raise ValueError(f"difficulty must be in [0, 1], got {difficulty}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"refusing to write into non-empty folder {out}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in range(patients):
        volume, has_lesion, masks = _patient_volume(np.random.default_rng([seed, p]), slices, size, difficulty)
        (out / f"P{p:04d}").mkdir()
        for k in range(slices):
            rel = f"P{p:04d}/slice_{k:02d}.dcm"
            _write_slice(out / rel, volume[k], seed, p, k, size_mm=350.0)
            mask_rel = f"masks/P{p:04d}/slice_{k:02d}.png"  # a parallel tree: image folders hold images only
            (out / mask_rel).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(masks[k]).save(out / mask_rel)
            rows.append((rel, LABELS[0] if has_lesion[k] else LABELS[1], f"SYN{seed:03d}-{p:04d}", mask_rel))
    manifest = out / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        csv.writer(f).writerows([("path", "label", "patient_id", "mask"), *rows])
    params = dict(seed=seed, patients=patients, slices=slices, size=size, difficulty=difficulty)
    (out / "dataset.json").write_text(json.dumps({"generator_version": GENERATOR_VERSION, **params}, indent=1))
    return manifest
