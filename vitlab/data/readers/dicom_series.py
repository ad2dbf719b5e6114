"""DICOM volumes: a folder holding a series, or one enhanced multi-frame file, with the geometry the headers give.

The headers are read first (no pixel data; :func:`~vitlab.data.readers.dicom.dicom_header`, which also refuses files
that cannot be decoded), grouped by SeriesInstanceUID, and the chosen series' slices ordered by the projection of
ImagePositionPatient on the slice normal (row direction x column direction of ImageOrientationPatient), never by
InstanceNumber or file name. Then each slice's pixels are decoded with vitlab's DICOM readers (the ``np.fromfile``
fast path for uncompressed files, pydicom's decoders for the rest) through the modality LUT, into one
preallocated array. Everything here is in DICOM's LPS patient space; :mod:`vitlab.data.readers.volume` turns it into
nibabel's RAS+.

Array layout: ``array[i, j, k]`` is column ``i`` and row ``j`` of slice ``k`` (the transposed pixel array, stored
in Fortran order as NIfTI stores it, so that each slice is one contiguous copy).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.multival import MultiValue
from pydicom.pixels import apply_modality_lut
from pydicom.tag import Tag

from vitlab.data.readers.dicom import DicomHeader, decode, dicom_header, native_plan, native_values
from vitlab.data.readers.dicom_checks import numbers
from vitlab.data.readers.errors import ImageReadError, VolumeError, file_errors
from vitlab.data.readers.image import image_kind
from vitlab.data.readers.options import ReadOptions

_GEOMETRY_TAGS = [Tag(k) for k in ("SeriesInstanceUID", "ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing")]
# native_plan resolves a display window; modality values need none, and an explicit one keeps it off the file's tags
_NO_WINDOW = ReadOptions(window_center=0.0, window_width=1.0)
_ORIENTATION_TOLERANCE = 1e-4  # max |difference| of direction cosines within one series
_UNIT_TOLERANCE = 1e-3  # direction cosines: unit length and orthogonal within this
_POSITION_FLOOR_MM = 0.01  # spacing tolerance: 1 % of the spacing, and never below this (rounded positions)
_ACCEPTS = "read_volume reads a folder holding a DICOM series, an enhanced multi-frame DICOM file or a .nii/.nii.gz file"


class DicomVolume(NamedTuple):
    """A DICOM volume in LPS: ``array`` (I, J, K) float32 modality values, ``affine_lps`` voxel -> LPS mm."""

    array: np.ndarray
    affine_lps: np.ndarray
    patient_id: str | None
    series_uid: str | None
    modality: str | None


class Plane(NamedTuple):
    """One slice's geometry as its header gives it (LPS mm)."""

    name: str  # the file name, or "frame 3" of a multi-frame file (for messages)
    position: np.ndarray  # (3,) ImagePositionPatient: centre of the first transmitted pixel
    orientation: np.ndarray  # (6,) ImageOrientationPatient: row direction, column direction
    pixel_spacing: tuple[float, float]  # PixelSpacing: (between rows, between columns)
    shape: tuple[int, int]  # (Rows, Columns)


# ---------------------------------------------------------------- geometry of a stack of planes
def _examples(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _same_everywhere(where: str, planes: list[Plane], what: str, values: np.ndarray, tolerance: float, show) -> None:
    """Refuse planes whose ``values`` (n, d) differ by more than ``tolerance``; the message sets the odd ones
    against the majority (``show`` formats one row)."""
    if (np.abs(values - values[0]).max(axis=1) <= tolerance).all():
        return
    candidates = np.unique(values, axis=0)  # the error path only: n x distinct comparisons
    support = [(np.abs(values - c).max(axis=1) <= tolerance).sum() for c in candidates]
    majority = candidates[int(np.argmax(support))]
    same = np.abs(values - majority).max(axis=1) <= tolerance
    odd = [p.name for p, s in zip(planes, same) if not s]
    usual = next(p.name for p, s in zip(planes, same) if s)
    raise VolumeError(
        f"{where}: slices differ in {what}: {show(majority)} ({int(same.sum())} slices, e.g. {usual}) and "
        f"{show(values[~same][0])} ({len(odd)} slices: {_examples(odd)}); one volume needs the same {what} on every slice"
    )


def _numbers(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def stack_geometry(where: str, planes: list[Plane]) -> tuple[np.ndarray, np.ndarray]:
    """The slices' order along the normal and the voxel -> LPS affine of the stack, after the checks.

    Refused: fewer than two slices, mixed sizes / orientations / pixel spacings, direction cosines that are not
    two orthogonal unit vectors, duplicate positions, gaps (a neighbour spacing that differs from the median by
    more than 1 % of it and more than 0.01 mm), and positions off the line through the first and last slice.

    Returns:
        ``order`` (K,): plane indices by increasing projection on the normal; ``affine`` (4, 4) float64 whose
        columns are the steps along i (columns), j (rows), k (slices) and the first slice's position.
    """
    if len(planes) < 2:
        raise VolumeError(
            f"{where}: a single slice ({planes[0].name}) is not a volume (its slice spacing is unknown); "
            "a volume needs at least 2 slices of one series"
        )
    _same_everywhere(where, planes, "size (Rows x Columns)", np.array([p.shape for p in planes]), 0,
                     lambda v: f"{int(v[0])}x{int(v[1])}")  # fmt: skip
    _same_everywhere(where, planes, "orientation (ImageOrientationPatient)", np.stack([p.orientation for p in planes]),
                     _ORIENTATION_TOLERANCE, _numbers)  # fmt: skip
    spacings = np.array([p.pixel_spacing for p in planes])
    _same_everywhere(where, planes, "pixel spacing (PixelSpacing)", spacings, 1e-4 * float(np.abs(spacings).max()), _numbers)
    row, col = planes[0].orientation[:3], planes[0].orientation[3:]
    if (abs(np.linalg.norm(row) - 1) > _UNIT_TOLERANCE or abs(np.linalg.norm(col) - 1) > _UNIT_TOLERANCE
            or abs(row @ col) > _UNIT_TOLERANCE):  # fmt: skip
        raise VolumeError(
            f"{where}: ImageOrientationPatient {_numbers(planes[0].orientation)} is not two orthogonal unit vectors"
        )
    spacing_between_rows, spacing_between_columns = planes[0].pixel_spacing
    if not (spacing_between_rows > 0 and spacing_between_columns > 0):
        raise VolumeError(f"{where}: PixelSpacing {list(planes[0].pixel_spacing)} is not positive")
    normal = np.cross(row, col)
    positions = np.stack([p.position for p in planes])  # (K, 3)
    order = np.argsort(positions @ normal, kind="stable")
    positions = positions[order]
    names = [planes[i].name for i in order]
    along = positions @ normal  # (K,) increasing
    steps = np.diff(along)  # (K-1,)
    same = np.flatnonzero(steps <= _POSITION_FLOOR_MM)
    if same.size:
        a = same[0]
        raise VolumeError(
            f"{where}: duplicate slice positions: {names[a]} and {names[a + 1]} both lie at {along[a]:.6g} mm along "
            f"the normal ({same.size} such pairs); a volume has one slice per position (two acquisitions in one "
            "series? remove the extra slices)"
        )
    median = float(np.median(steps))
    tolerance = max(0.01 * median, _POSITION_FLOOR_MM)
    off = np.flatnonzero(np.abs(steps - median) > tolerance)
    if off.size:
        a = off[0]
        raise VolumeError(
            f"{where}: uneven slice spacing: {names[a]} and {names[a + 1]} are {steps[a]:.6g} mm apart where the "
            f"series' spacing is {median:.6g} mm ({off.size} such places: a missing slice or a gap?); neighbouring "
            f"slices must be evenly spaced (within 1 % or {_POSITION_FLOOR_MM} mm)"
        )
    step = (positions[-1] - positions[0]) / (len(planes) - 1)  # (3,): along the normal, or sheared (gantry tilt)
    expected = positions[0] + np.arange(len(planes))[:, None] * step  # (K, 3)
    miss = np.linalg.norm(positions - expected, axis=1)
    worst = int(np.argmax(miss))
    if miss[worst] > tolerance:
        raise VolumeError(
            f"{where}: slice positions do not lie on one line: {names[worst]} is {miss[worst]:.6g} mm off the line "
            f"through {names[0]} and {names[-1]}; a volume's slice positions must step evenly"
        )
    affine = np.eye(4)
    affine[:3, 0] = row * spacing_between_columns  # i: along a row, column to column
    affine[:3, 1] = col * spacing_between_rows  # j: down a column, row to row
    affine[:3, 2] = step
    affine[:3, 3] = positions[0]
    return order, affine


# ---------------------------------------------------------------- a folder holding a series
def _plane(where: str, path: Path, ds: Dataset) -> Plane:
    """The geometry of one single-frame slice; refuses missing or malformed geometry elements."""
    values = {}
    for keyword, count in (("ImagePositionPatient", 3), ("ImageOrientationPatient", 6), ("PixelSpacing", 2)):
        try:
            found = numbers(path, ds, keyword)
        except ImageReadError as exc:
            raise VolumeError(f"{where}: {exc}") from None
        if len(found) != count:
            what = "has no" if not found else f"has {len(found)} values in"
            raise VolumeError(
                f"{where}: slice {path.name} {what} {keyword} ({count} numbers needed); a volume needs "
                "ImagePositionPatient, ImageOrientationPatient and PixelSpacing on every slice"
            )
        values[keyword] = np.array(found)
    return Plane(path.name, values["ImagePositionPatient"], values["ImageOrientationPatient"],
                 tuple(values["PixelSpacing"]), (int(ds.Rows), int(ds.Columns)))  # fmt: skip


def _series_of(path: Path) -> tuple[str | None, bool]:
    """(SeriesInstanceUID, is an image) of a file whose full header check failed; (None, True) when unparseable.

    A file that names its SOP class and has no Rows is no image (a DICOMDIR, a report, a presentation state) and
    is passed over; one that names neither could be a broken slice.
    """
    tags = [Tag("SeriesInstanceUID"), Tag("Rows"), Tag("SOPClassUID")]
    try:
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=tags)
        except InvalidDicomError:
            ds = pydicom.dcmread(path, stop_before_pixels=True, force=True, specific_tags=tags)
        uid = str(ds.get("SeriesInstanceUID", "") or "").strip()
        has_rows = "Rows" in ds
        has_class = "SOPClassUID" in ds or "MediaStorageSOPClassUID" in getattr(ds, "file_meta", {})
    except Exception:  # noqa: BLE001 - whatever pydicom raises, the file is not readable
        return None, True
    if not has_rows and not has_class:
        return None, True
    return uid, has_rows


def _describe(series: dict[str, list]) -> str:
    return ", ".join(f"{uid or '(no SeriesInstanceUID)'} ({len(files)} slices)" for uid, files in sorted(series.items()))


def _choose_series(folder: Path, series: dict[str, list], series_uid: str | None) -> str:
    if series_uid is not None:
        if series_uid not in series:
            raise VolumeError(f"{folder}: no series with SeriesInstanceUID {series_uid}; the folder holds {_describe(series)}")
        return series_uid
    if len(series) > 1:
        raise VolumeError(
            f"{folder}: the folder holds {len(series)} series: {_describe(series)}; choose one with series_uid="
        )
    return next(iter(series))


def _no_dicom(folder: Path, entries: list[os.DirEntry]) -> VolumeError:
    subfolders = sorted(e.name for e in entries if e.is_dir())
    others = [e for e in entries if e.is_file()]
    if subfolders:
        return VolumeError(
            f"{folder}: no DICOM files directly in the folder ({len(others)} other files); it has subfolders "
            f"{_examples(subfolders)}: pass the folder of one series. {_ACCEPTS}"
        )
    return VolumeError(f"{folder}: no DICOM files in the folder ({len(others)} other files); {_ACCEPTS}")


def read_series_folder(folder: str | os.PathLike, series_uid: str | None = None) -> DicomVolume:
    """The DICOM series in ``folder`` (its files, not its subfolders) as modality values and an LPS affine.

    Non-DICOM files and DICOM files without an image (DICOMDIR, reports) are passed over. A file that cannot
    be read refuses its series as a whole, and the folder when its series cannot be told.

    Args:
        folder: The folder.
        series_uid: The SeriesInstanceUID to read when the folder holds several.

    Raises:
        VolumeError: See :func:`stack_geometry` and the module docstring; one line naming the folder.
    """
    folder = Path(folder)
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    files = [Path(e.path) for e in entries if e.is_file() and image_kind(e.path) == "dicom"]
    if not files:
        raise _no_dicom(folder, entries)
    series: dict[str, list[tuple[Path, DicomHeader]]] = defaultdict(list)
    broken: dict[str | None, list[tuple[Path, ImageReadError]]] = defaultdict(list)
    for path in files:
        try:
            header = dicom_header(path, _GEOMETRY_TAGS)
        except ImageReadError as exc:
            uid, is_image = _series_of(path)
            if is_image:
                broken[uid].append((path, exc))
            continue
        series[str(header.ds.get("SeriesInstanceUID", "") or "").strip()].append((path, header))
    if None in broken:
        path, exc = broken[None][0]
        raise VolumeError(
            f"{folder}: {path.name} is not a readable DICOM file and may be a slice of the series, so the folder is "
            f"refused ({exc}); remove the file or move it out"
        )
    if not series and not broken:
        raise _no_dicom(folder, entries)
    counts = {uid: series.get(uid, []) + broken.get(uid, []) for uid in {*series, *broken}}
    uid = _choose_series(folder, counts, series_uid)
    where = f"{folder} (series {uid})" if series_uid is not None or len(counts) > 1 else str(folder)
    if broken.get(uid):
        path, exc = broken[uid][0]
        raise VolumeError(
            f"{where}: {len(broken[uid])} of {len(counts[uid])} slices cannot be read, the series is refused as a whole; "
            f"first: {exc}"
        )
    slices = series[uid]
    for path, header in slices:
        ds = header.ds
        if int(ds.get("NumberOfFrames") or 1) > 1:
            raise VolumeError(f"{where}: {path.name} is a multi-frame file in a series folder; pass the file itself")
        if int(ds.get("SamplesPerPixel") or 1) > 1 or str(ds.get("PhotometricInterpretation", "")) == "PALETTE COLOR":
            raise VolumeError(f"{where}: slice {path.name} is a colour image; a volume holds grayscale slices")
    order, affine = stack_geometry(where, [_plane(where, path, header.ds) for path, header in slices])
    rows, columns = int(slices[0][1].ds.Rows), int(slices[0][1].ds.Columns)
    array = np.empty((columns, rows, len(order)), dtype=np.float32, order="F")  # (I, J, K)
    for k, index in enumerate(order):
        path, header = slices[index]
        try:
            with file_errors(path, "cannot read slice"):
                array[:, :, k] = _finite(path, _slice_values(path, header)).T  # (rows, columns) -> (I, J)
        except ImageReadError as exc:
            raise VolumeError(f"{where}: the series is refused as a whole: {exc}") from None
    first = slices[order[0]][1].ds
    return DicomVolume(array, affine, _text(first, "PatientID"), uid or None, _text(first, "Modality"))


def _slice_values(path: Path, header: DicomHeader) -> np.ndarray:
    """One slice's modality values (rows, columns): the fast path when it applies, else pydicom's decoders."""
    plan = native_plan(path, _NO_WINDOW, header)
    if plan is not None:
        return native_values(path, plan, 0)
    stored, ds = decode(path, 0, header_checked=True)
    return apply_modality_lut(stored, ds)


def _finite(path: Path, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise ImageReadError(f"{path}: NaN or infinite values after the modality LUT; a volume must be finite")
    return values


def _text(ds: Dataset, keyword: str) -> str | None:
    return str(ds.get(keyword, "") or "").strip() or None


# ---------------------------------------------------------------- one enhanced multi-frame file
def _functional(ds: Dataset, frame: Dataset | None, sequence: str, keyword: str) -> list[float] | None:
    """``keyword`` in the frame's functional group ``sequence``, else in the shared one (None when in neither)."""
    shared = ds.get("SharedFunctionalGroupsSequence")
    for group in (frame, shared[0] if shared else None):
        items = group.get(sequence) if group is not None else None
        if items and keyword in items[0]:
            value = items[0][keyword].value
            return [float(v) for v in (value if isinstance(value, (list, tuple, MultiValue)) else [value])]
    return None


def read_multiframe(path: str | os.PathLike) -> DicomVolume:
    """One enhanced multi-frame DICOM file (CT, MR, ...) as modality values and an LPS affine.

    Frame geometry comes from the functional groups (per frame, else shared): PlanePositionSequence,
    PlaneOrientationSequence, PixelMeasuresSequence; the rescale from PixelValueTransformationSequence (else the
    top-level RescaleSlope / RescaleIntercept). Frames are ordered along the normal as slices of a series are.

    Raises:
        VolumeError: A single-frame file, a multi-frame file without per-frame positions, or a geometry refusal.
    """
    path = Path(path)
    with file_errors(path, "cannot read header"):
        header = dicom_header(path)
        frames = int(header.ds.get("NumberOfFrames") or 1)
        if frames == 1:
            raise VolumeError(
                f"{path}: one single-frame DICOM file is one slice, not a volume; pass the folder that holds its "
                f"series ({path.parent})"
            )
        ds = pydicom.dcmread(path, stop_before_pixels=True)
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if not per_frame or len(per_frame) != frames:
        raise VolumeError(
            f"{path}: multi-frame DICOM file without a PerFrameFunctionalGroupsSequence for its {frames} frames (not "
            f"an enhanced image: frame positions unknown); {_ACCEPTS}"
        )
    if int(ds.get("SamplesPerPixel") or 1) > 1:
        raise VolumeError(f"{path}: colour multi-frame file; a volume holds grayscale frames")
    with file_errors(path, "cannot read the frames' functional groups"):
        planes, rescale = _frame_geometry(path, ds, per_frame)
    order, affine = stack_geometry(str(path), planes)
    stored, _ = decode(path, "all", header_checked=True)  # (F, rows, columns)
    array = np.empty((stored.shape[2], stored.shape[1], frames), dtype=np.float32, order="F")  # (I, J, K)
    for k, f in enumerate(order):
        slope, intercept = rescale[f]
        values = stored[f].astype(np.float64) * slope + intercept  # as pydicom's apply_modality_lut computes it
        array[:, :, k] = _finite(path, values).T
    return DicomVolume(array, affine, _text(ds, "PatientID"), _text(ds, "SeriesInstanceUID"), _text(ds, "Modality"))


def _frame_geometry(path: Path, ds: Dataset, per_frame) -> tuple[list[Plane], list[tuple[float, float]]]:
    """Each frame's plane and (slope, intercept) from the functional groups."""
    planes, rescale = [], []
    for f, group in enumerate(per_frame):
        geometry = {}
        for sequence, keyword, count in (("PlanePositionSequence", "ImagePositionPatient", 3),
                                         ("PlaneOrientationSequence", "ImageOrientationPatient", 6),
                                         ("PixelMeasuresSequence", "PixelSpacing", 2)):  # fmt: skip
            value = _functional(ds, group, sequence, keyword)
            if value is None or len(value) != count or not np.isfinite(value).all():
                raise VolumeError(
                    f"{path}: frame {f + 1} has no valid {sequence} {keyword} ({count} numbers needed, per frame or "
                    "shared); an enhanced volume needs each frame's position, orientation and pixel spacing"
                )
            geometry[keyword] = np.array(value)
        planes.append(Plane(f"frame {f + 1}", geometry["ImagePositionPatient"], geometry["ImageOrientationPatient"],
                            tuple(geometry["PixelSpacing"]), (int(ds.Rows), int(ds.Columns))))  # fmt: skip
        slope = _functional(ds, group, "PixelValueTransformationSequence", "RescaleSlope")
        intercept = _functional(ds, group, "PixelValueTransformationSequence", "RescaleIntercept")
        rescale.append((slope[0] if slope else float(ds.get("RescaleSlope", 1.0)),
                        intercept[0] if intercept else float(ds.get("RescaleIntercept", 0.0))))  # fmt: skip
    return planes, rescale
