"""Where the volumes are, and the samples they give: the volume counterpart of :mod:`vitlab.data.layouts`.

A volume is a NIfTI file, a folder holding a DICOM series, or an enhanced multi-frame DICOM file. Three layouts,
as for images: class folders ``root/<class>/**`` (label maps in a parallel ``root/masks/<class>/**`` tree), every
volume under a folder (unlabelled), or a ``.csv`` manifest (:func:`~vitlab.data.layouts.read_manifest`).

Setup reads every volume once (:func:`check_volumes`: the refusals of
:func:`~vitlab.data.readers.volume.read_volume` happen there, and a volume that is refused is skipped as a whole
in skip mode), keeping only its slice count and per-slice mask flags, and turns it into its samples
(``data.sample``, :mod:`vitlab.data.volume_options`): one per slice (``slice``, ``slab``) or the volume itself
(``volume``). A slice's label is its volume's, or with ``data.slice_labels: mask`` whether the slice holds at
least ``data.min_mask_voxels`` voxels of the volume's label map (classes ``absent`` / ``present``, renamed by
``data.classes``). Every sample of one patient (the manifest's ``patient_id``, else the DICOM PatientID, else the
volume itself) stays in one split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from vitlab.data.layouts import MASKS_FOLDER, UNLABELLED, Layout, Sample, read_manifest, skip_or_raise
from vitlab.data.masks import read_label_map
from vitlab.data.readers.errors import ImageReadError, VolumeError
from vitlab.data.readers.image import image_kind
from vitlab.data.readers.nifti import is_nifti
from vitlab.data.readers.volume import read_volume
from vitlab.data.volume_options import VolumeOptions

MASK_CLASSES = ("absent", "present")  # slice_labels: mask


def _dicom_files(folder: Path) -> list[Path]:
    with os.scandir(folder) as entries:
        return sorted(Path(e.path) for e in entries if e.is_file() and not is_nifti(Path(e.name)) and image_kind(e.path) == "dicom")


def volume_problem(path: Path) -> str | None:
    """Why ``path`` is not a volume vitlab reads (None: a NIfTI file, a folder with DICOM files, a DICOM file)."""
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return None if _dicom_files(path) else "is a folder without DICOM files (a volume is a NIfTI file or a DICOM series folder)"
    if is_nifti(path) or image_kind(path) == "dicom":
        return None
    return "is not a volume (a .nii / .nii.gz file, a DICOM series folder or an enhanced multi-frame DICOM file)"


def _series_uids(folder: Path, files: list[Path]) -> list[str | None]:
    """The SeriesInstanceUIDs in a folder: [None] for one series (read_volume takes the folder), else each uid."""
    import pydicom

    uids = set()
    for path in files:
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SeriesInstanceUID"], force=True)
            uids.add(str(ds.get("SeriesInstanceUID", "") or "").strip())
        except Exception:  # noqa: BLE001 - a broken file is refused with its series when the volume is read
            pass
    return [None] if len(uids) <= 1 else sorted(uids)


def volumes_under(folder: Path, skip_top: str | None = None) -> list[tuple[Path, str | None]]:
    """(path, series_uid) of every volume under ``folder``: NIfTI files (not ``*_mask``) and DICOM series folders."""
    found = []
    for here, subdirs, names in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not (Path(here) == folder and d == skip_top))
        here = Path(here)
        found += [(here / n, None) for n in sorted(names) if not n.startswith(".") and is_nifti(Path(n))
                  and not n.lower().split(".nii")[0].endswith("_mask")]  # fmt: skip
        dicom = _dicom_files(here)
        if dicom:
            found += [(here, uid) for uid in _series_uids(here, dicom)]
    return found


def _parallel_mask(root: Path, volume: Path) -> Path | None:
    """``root/<class>/a/P.nii.gz`` -> ``root/masks/<class>/a/P.nii.gz``; a series folder ``root/<class>/a/S`` ->
    ``root/masks/<class>/a/S.nii.gz``; None without a ``masks`` folder."""
    if not (root / MASKS_FOLDER).is_dir():
        return None
    relative = volume.relative_to(root)
    if volume.is_dir():
        relative = relative.with_name(relative.name + ".nii.gz")
    return (root / MASKS_FOLDER / relative).resolve()


def _existing(path: Path | None) -> Path | None:
    return path if path is not None and path.is_file() else None


def scan_volumes(root: Path, *, labels: bool, on_bad_file: str) -> Layout:
    """Volumes under ``root``: class folders ``root/<class>/**`` (masks in a parallel ``root/masks/<class>/**``
    tree), every volume under a folder (``labels`` False), or a ``.csv`` manifest whose ``path`` is a NIfTI file,
    a series folder or a multi-frame DICOM file (``mask``, ``label``, ``split``, ``patient_id`` as for images)."""
    if root.is_file():
        if root.suffix.lower() != ".csv":
            raise ValueError(f"data root {root} is a file but not a .csv manifest")
        return read_manifest(root, on_bad_file, labels, problem=volume_problem)
    if not labels:  # (also class folders read for slice_labels: mask, whose labels come from the label maps)
        found = volumes_under(root, skip_top=MASKS_FOLDER)
        if not found:
            raise ValueError(f"data root {root} holds no volumes (.nii / .nii.gz files or folders of DICOM files)")
        return Layout([Sample(p.resolve(), UNLABELLED, mask=_existing(_parallel_mask(root, p)), series_uid=uid)
                       for p, uid in found], [], skipped=[])
    samples = []
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != MASKS_FOLDER)
    for class_dir in class_dirs:
        found = volumes_under(class_dir)
        if not found:
            raise ValueError(f"class folder {class_dir} holds no volumes (.nii / .nii.gz files or folders of DICOM files)")
        samples += [Sample(p.resolve(), class_dir.name, mask=_parallel_mask(root, p), series_uid=uid) for p, uid in found]
    return Layout(samples, [d.name for d in class_dirs], skipped=[])


def check_volumes(samples: Sequence[Sample], options: VolumeOptions, on_bad_file: str = "skip",
                  needs_mask: bool = False) -> tuple[list[Sample], list[str]]:
    """Read every volume (and label map) once; return its samples (one per slice, or the volume) with patient
    ids and labels, and one message per volume dropped."""
    kept, skipped = [], []
    for sample in samples:
        try:
            if sample.mask is None and (needs_mask or options.slice_labels == "mask"):
                raise VolumeError(f"{sample.path}: no label map (a manifest 'mask' column, or a file at the same relative "
                                  "path under the data root's masks/ folder: masks/<class>/.../<name>.nii.gz), "
                                  f"needed by {'data.slice_labels: mask' if options.slice_labels == 'mask' else 'this task'}")
            volume = read_volume(sample.path, series_uid=sample.series_uid)
            present = None
            if sample.mask is not None:
                labelled = (read_label_map(sample, volume.shape, volume.affine) > 0).sum(axis=(0, 1))  # (K,) voxels per slice
                present = labelled >= options.min_mask_voxels
        except (ImageReadError, OSError) as error:
            skip_or_raise(error if isinstance(error, ImageReadError) else VolumeError(f"{sample.path}: {error}"),
                          on_bad_file, skipped)
            continue
        patient = sample.patient_id or volume.patient_id or sample.key
        whole = replace(sample, patient_id=patient)
        if options.sample == "volume":
            kept.append(whole)
            continue
        for k in range(volume.shape[2]):
            label = sample.label
            if options.slice_labels == "mask":
                label = MASK_CLASSES[int(present[k])]
            kept.append(replace(whole, slice=k, label=label))
    return kept, skipped


def volume_layout(root: Path, classes: Sequence[str] | None, *, labelled: bool, slice_labels: str, on_bad_file: str) -> Layout:
    """The volumes under ``root`` (:func:`scan_volumes`) with their class names: the class folders' or the manifest's
    labels (``classes`` fixes them and their order), or with ``slice_labels: mask`` a slice's absent / present
    (``classes`` renames them, negative first)."""
    by_mask = slice_labels == "mask"
    if not root.exists():
        raise FileNotFoundError(f"data root {root} does not exist (a folder of volumes or a .csv manifest)")
    if by_mask and not labelled:
        raise ValueError("data.slice_labels: mask labels slices; unlabelled volumes (data.labels false) have none")
    layout = scan_volumes(root, labels=labelled and not by_mask, on_bad_file=on_bad_file)
    if by_mask:
        if classes is not None and len(classes) != 2:
            raise ValueError(f"data.classes {classes}: slice_labels mask has two classes, [absent, present] in that order")
        layout.class_names = list(classes or MASK_CLASSES)
    elif labelled:
        found = sorted({s.label for s in layout.samples})
        unknown = [c for c in found if classes is not None and c not in classes]
        if unknown:
            raise ValueError(f"{root}: label(s) {unknown} are not among the classes {list(classes)}")
        layout.class_names = list(classes) if classes is not None else found
        if len(layout.class_names) < 2:
            raise ValueError(f"{root}: found {len(layout.class_names)} class(es) {layout.class_names} of volumes; "
                             "need at least two (or data.slice_labels: mask, or data.labels false)")
    return layout
