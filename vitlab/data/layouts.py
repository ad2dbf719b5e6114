"""Where the images are and which split each belongs to.

Two layouts:

* class folders ``root/<class>/**/<file>`` (files vitlab does not read, e.g. ``.txt``, are ignored);
* a CSV manifest with a header ``path,label[,split][,patient_id]``; paths are relative to the
  manifest's folder (absolute paths work too); other columns are ignored.

Unlabelled images (``labels=False``, self-supervised pretraining): every image file anywhere under a folder
(flat, or nested by patient / study / series), or a manifest whose ``label`` column may be absent (labels are
ignored when present). Their samples carry :data:`UNLABELLED` and the layout has no class names.

Splits come from the manifest's ``split`` column when it has one, otherwise from a deterministic
split stratified by label and grouped by patient (no patient in two splits).

Bad files are found in two passes without decoding pixels twice: :func:`check_files` reads only
headers before training (missing files, non-DICOM files, missing decoders, truncated uncompressed
pixel data; it also collects DICOM PatientIDs for the split, and the DataModule keeps the parsed
headers for the loaders), and whatever slips through fails at decode time in the dataset, which
warns and substitutes the next image.
"""

from __future__ import annotations

import csv
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vitlab.data.readers.errors import ImageReadError
from vitlab.data.readers.image import SUPPORTED_TYPES, header_info, image_kind

SPLITS = ("train", "val", "test")
MANIFEST_COLUMNS = ("path", "label", "split", "patient_id", "mask", "boxes")
MASKS_FOLDER = "masks"  # class-folder layout: root/masks/<class>/<relative path>.png holds the label maps


UNLABELLED = ""  # the label of a sample from an unlabelled layout


class SkippedFileWarning(UserWarning):
    """A bad file was dropped because ``on_bad_file="skip"``."""


@dataclass(frozen=True)
class Sample:
    """One image file.

    Args:
        path: Absolute path of the file.
        label: Class name (:data:`UNLABELLED` in an unlabelled layout).
        patient_id: Patient the image belongs to (manifest column, DICOM PatientID, else the path);
            None until :func:`check_files` has run.
        split: ``"train"``, ``"val"``, ``"test"`` or None when not assigned yet.
        mask: Label map of the image (detection / segmentation; see :mod:`vitlab.data.datasets.targets`), or None.
        boxes: The manifest's ``boxes`` cell (``"x0 y0 x1 y1 label;..."``, see :func:`vitlab.data.boxes.parse_boxes`;
            ``""`` for an empty cell), or None without a ``boxes`` column.
        series_uid: The series of a DICOM folder that holds several (volumes, see :mod:`vitlab.data.volume_layouts`).
        slice: Index k of the slice (or the slab's centre) in the volume ``path``; None for a 2-D image or a whole
            volume.
    """

    path: Path
    label: str
    patient_id: str | None = None
    split: str | None = None
    mask: Path | None = None
    boxes: str | None = None
    series_uid: str | None = None
    slice: int | None = None

    @property
    def key(self) -> str:
        """Names this sample among all others: the path, with the series and the slice of a volume."""
        series = f"#{self.series_uid}" if self.series_uid else ""
        return f"{self.path}{series}" if self.slice is None else f"{self.path}{series}@{self.slice}"


@dataclass
class Layout:
    """What a scan of ``root`` found.

    Args:
        samples: Files found, in a deterministic order.
        class_names: Sorted class names (or the order given by ``classes``).
        has_split_column: True when the manifest assigns the splits.
        skipped: One message per dropped file.
    """

    samples: list[Sample]
    class_names: list[str]
    has_split_column: bool = False
    skipped: list[str] | None = None


def skip_or_raise(error: Exception, on_bad_file: str, skipped: list[str]) -> None:
    """Raise ``error`` under ``on_bad_file="error"``; otherwise warn once and record it."""
    if on_bad_file == "error":
        raise error
    skipped.append(str(error))
    warnings.warn(f"skipping bad file: {error}", SkippedFileWarning, stacklevel=3)


def scan(
    root: str | os.PathLike, *, classes: Sequence[str] | None = None, on_bad_file: str = "skip", labels: bool = True
) -> Layout:
    """Find the samples under a class-folder root or in a CSV manifest (no pixel decoding).

    Args:
        root: A folder of class folders, or a ``.csv`` manifest.
        classes: Fix the class names and their order; any other label / folder is an error.
        on_bad_file: ``"skip"`` drops (with a warning) manifest rows whose file is missing or of
            an unsupported type; ``"error"`` raises.
        labels: False: unlabelled images (every image under the folder, or the manifest's paths; no classes).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: Layout problems (empty class folder, fewer than two classes, bad manifest row).
    """
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"data root {root} does not exist (a class-folder directory or a .csv manifest)")
    if root.is_file():
        if root.suffix.lower() != ".csv":
            raise ValueError(f"data root {root} is a file but not a .csv manifest")
        layout = read_manifest(root, on_bad_file, labels)
    else:
        layout = _scan_class_folders(root) if labels else _scan_unlabelled(root)
    if not labels:
        if classes:
            raise ValueError(f"data.classes {list(classes)} names classes of unlabelled images (data.labels false): drop one of them")
        return layout
    found = sorted({s.label for s in layout.samples})
    if classes is not None:
        unknown = [c for c in found if c not in classes]
        if unknown:
            raise ValueError(f"{root}: label(s) {unknown} are not among the classes {list(classes)}")
        layout.class_names = list(classes)
    else:
        layout.class_names = found
    if len(layout.class_names) < 2:
        hint = " (a manifest.csv is there: pass its path as root)" if (root / "manifest.csv").exists() else ""
        found_text = f"found {len(layout.class_names)} class(es) {layout.class_names}"
        hint = hint or " (unlabelled images, for self-supervised pretraining: data.labels false)"
        raise ValueError(f"{root}: {found_text}; need at least two{hint}")
    return layout


def _scan_class_folders(root: Path) -> Layout:
    samples: list[Sample] = []
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != MASKS_FOLDER)
    masks = root / MASKS_FOLDER
    for class_dir in class_dirs:
        files = []
        for folder, subdirs, names in os.walk(class_dir):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            files += [Path(folder, n) for n in sorted(names) if not n.startswith(".")]
        images = [f for f in files if image_kind(f) is not None]
        if not images:
            raise ValueError(f"class folder {class_dir} contains no image files (supported: {SUPPORTED_TYPES})")
        samples += [Sample(path=f.resolve(), label=class_dir.name, mask=_parallel_mask(masks, root, f)) for f in images]
    return Layout(samples=samples, class_names=[d.name for d in class_dirs], skipped=[])


def _scan_unlabelled(root: Path) -> Layout:
    """Every image file under ``root`` (sorted walk; hidden entries and a top-level ``masks/`` folder skipped)."""
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not (Path(folder) == root and d == MASKS_FOLDER))
        files += [Path(folder, n) for n in sorted(names) if not n.startswith(".")]
    images = [f for f in files if image_kind(f) is not None]
    if not images:
        raise ValueError(f"data root {root} holds no image files (supported: {SUPPORTED_TYPES})")
    return Layout(samples=[Sample(path=f.resolve(), label=UNLABELLED) for f in images], class_names=[], skipped=[])


def _parallel_mask(masks: Path, root: Path, image: Path) -> Path | None:
    """``root/<class>/a/b.dcm`` -> ``root/masks/<class>/a/b.png`` (or ``.tif`` / ``.tiff`` when that exists)."""
    if not masks.is_dir():
        return None
    stem = masks / image.relative_to(root).with_suffix("")
    for suffix in (".tif", ".tiff"):
        if stem.with_suffix(suffix).is_file():
            return stem.with_suffix(suffix).resolve()
    return stem.with_suffix(".png").resolve()


def _image_problem(path: Path) -> str | None:
    """Why ``path`` is not a 2-D image file vitlab reads (None: it is one)."""
    if not path.is_file():
        return "does not exist"
    return None if image_kind(path) is not None else f"is not a supported image ({SUPPORTED_TYPES})"


def read_manifest(
    manifest: Path, on_bad_file: str, labels: bool = True, problem: Callable[[Path], str | None] = _image_problem
) -> Layout:
    try:
        with open(manifest, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"cannot read manifest {manifest}: {exc}") from None
    if not rows or not any(cell.strip() for cell in rows[0]):
        raise ValueError(
            f"manifest {manifest} is empty or starts with a blank line; "
            "expected a header 'path,label[,split][,patient_id]'"
        )
    header = [h.strip().lower() for h in rows[0]]
    required = ("path", "label") if labels else ("path",)
    missing = [c for c in required if c not in header]
    if missing:
        raise ValueError(
            f"manifest {manifest} header {rows[0]} lacks column(s) {missing}; "
            f"expected a header line '{','.join(required)}[,split][,patient_id]'"
        )
    column = {name: header.index(name) for name in MANIFEST_COLUMNS if name in header}
    samples, skipped = [], []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # blank line
        if len(row) != len(header):
            raise ValueError(f"manifest {manifest} line {line}: expected {len(header)} fields, got {len(row)}")
        cell = {name: row[i].strip() for name, i in column.items()}
        for name in required:
            if not cell[name]:
                raise ValueError(f"manifest {manifest} line {line}: empty '{name}'")
        split = cell.get("split")
        if split is not None and split not in SPLITS:
            raise ValueError(f"manifest {manifest} line {line}: split {split!r} is not one of {list(SPLITS)}")
        path = (manifest.parent / cell["path"]).resolve()
        reason = problem(path)
        if reason is not None:
            error_type = FileNotFoundError if not path.exists() else ImageReadError
            skip_or_raise(error_type(f"manifest {manifest} line {line}: {path} {reason}"), on_bad_file, skipped)
            continue
        mask = (manifest.parent / cell["mask"]).resolve() if cell.get("mask") else None
        label = cell["label"] if labels else UNLABELLED
        samples.append(Sample(path, label, cell.get("patient_id") or None, split, mask, cell.get("boxes")))
    if not samples:
        raise ValueError(f"manifest {manifest} lists no usable image files")
    return Layout(samples=samples, class_names=[], has_split_column="split" in column, skipped=skipped)


def check_files(
    samples: Sequence[Sample],
    on_bad_file: str = "skip",
    inspect: Callable[[Path], dict] = header_info,
) -> tuple[list[Sample], list[str]]:
    """Header-check every file and fill in patient ids (no pixel decoding).

    Args:
        samples: Samples from :func:`scan`.
        on_bad_file: ``"skip"`` (warn and drop) or ``"error"`` (raise the first problem).
        inspect: The header check; :meth:`~vitlab.data.readers.image.ImageReader.inspect` also remembers
            each header so that reading the pixels later needs no second parse.

    Returns:
        The usable samples, each with a ``patient_id`` (manifest value, else DICOM PatientID, else
        the file's own path), and one message per dropped file.
    """
    kept, skipped = [], []
    for sample in samples:
        try:
            info = inspect(sample.path)
        except ImageReadError as error:
            skip_or_raise(error, on_bad_file, skipped)
            continue
        patient = sample.patient_id or info["patient_id"] or str(sample.path)
        kept.append(replace(sample, patient_id=patient))
    return kept, skipped


def split_by_patient(
    samples: Sequence[Sample],
    *,
    val_fraction: float,
    test_fraction: float,
    seed: int,
) -> list[Sample]:
    """Assign splits: deterministic, stratified by label, grouped by patient.

    Patients are stratified by their most frequent label (ties: the smallest label). Within each
    stratum, patients sorted by id are shuffled with ``seed`` and the first
    ``round(n * test_fraction)`` go to test, the next ``round(n * val_fraction)`` to val, the rest to
    train; a split with a positive fraction gets at least one patient of the stratum while train keeps one.

    Args:
        samples: Samples with ``patient_id`` set.
        val_fraction: Share of patients for validation, in [0, 1).
        test_fraction: Share of patients for test, in [0, 1).
        seed: Seed of the shuffle; the result does not depend on the order of ``samples``.

    Returns:
        The samples with ``split`` set, in the input order.
    """
    labels_of: dict[str, Counter] = defaultdict(Counter)
    for sample in samples:
        labels_of[sample.patient_id][sample.label] += 1
    strata: dict[str, list[str]] = defaultdict(list)
    for patient in sorted(labels_of):
        counts = labels_of[patient]
        strata[min(counts, key=lambda label: (-counts[label], label))].append(patient)
    rng = np.random.default_rng(seed)
    split_of: dict[str, str] = {}
    for label in sorted(strata):
        patients = [strata[label][i] for i in rng.permutation(len(strata[label]))]
        n_test, n_val = _split_sizes(len(patients), val_fraction, test_fraction)
        for i, patient in enumerate(patients):
            split_of[patient] = "test" if i < n_test else "val" if i < n_test + n_val else "train"
    return [replace(s, split=split_of[s.patient_id]) for s in samples]


def _split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(n_test, n_val) for a stratum of ``n`` patients; train keeps at least one when n >= 1."""
    n_val = max(round(n * val_fraction), int(val_fraction > 0 and n >= 2))
    n_test = max(round(n * test_fraction), int(test_fraction > 0 and n - n_val >= 2))
    while n_val + n_test > n - 1 and n_val + n_test > 0:  # keep one training patient
        if n_test >= n_val and n_test > 0:
            n_test -= 1
        else:
            n_val -= 1
    return n_test, n_val


def patient_overlap(samples: Sequence[Sample]) -> dict[str, set[str]]:
    """Patients that appear in more than one split: ``{patient_id: {splits}}``."""
    splits_of: dict[str, set[str]] = defaultdict(set)
    for sample in samples:
        splits_of[sample.patient_id].add(sample.split)
    return {p: s for p, s in splits_of.items() if len(s) > 1}


def check_validation(root: Path, samples: list[Sample], val_fraction: float) -> None:
    """An empty validation split stops the run (nothing to monitor); a class missing from it is warned about."""
    patients: dict[str, set] = {}
    for sample in samples:
        patients.setdefault(sample.label, set()).add(sample.patient_id)
    counts = ", ".join(f"{label}: {len(ids)}" for label, ids in sorted(patients.items()))
    in_val = {s.label for s in samples if s.split == "val"}
    if not in_val:
        raise ValueError(
            f"{root}: the patient-grouped split left validation empty (patients per class: {counts}; "
            f"val_fraction {val_fraction}); add patients, give the manifest a 'split' column, or raise data.val_fraction")
    absent = sorted(set(patients) - in_val)
    if absent:
        warnings.warn(
            f"{root}: class(es) {absent} have no validation images (patients per class: {counts}); "
            "validation metrics ignore them", stacklevel=3)


def training_only(unlabelled: list[Sample]) -> list[Sample]:
    """Unlabelled images train and nothing else: a manifest's val / test rows stay out (there are no labels to
    score them with, and test patients stay out of pretraining); the rest get ``split="train"``."""
    return [replace(s, split="train") for s in unlabelled if s.split in (None, "train")]


def warn_unlabelled_overlap(root: Path, extra: list[Sample], samples: list[Sample]) -> None:
    """Warn when unlabelled training images belong to patients of the labelled val / test splits."""
    held_out = {s.patient_id: s.split for s in samples if s.split in ("val", "test")}
    shared = [s for s in extra if s.patient_id in held_out]
    if shared:
        example = shared[0]
        warnings.warn(
            f"unlabelled_root {root}: {len(shared)} image(s) belong to labelled {sorted({held_out[s.patient_id] for s in shared})} "
            f"patients (e.g. {example.path.name}: {example.patient_id!r}); pretraining on them makes the k-NN score optimistic",
            stacklevel=3)
