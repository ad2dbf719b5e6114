"""Volumes as training data: layouts of volumes, their slices and slabs as samples, and a bounded volume store.

``data.sample`` (docs/volumes.md) turns each volume (a NIfTI file, a DICOM series folder, an enhanced multi-frame file)
into samples:

* ``slice``: every 2-D slice along k (the slice normal of a DICOM series, the third axis of a NIfTI file), shown
  as DICOM shows it (rows along j, columns along i);
* ``slab``: 2.5-D, the ``2r + 1`` slices around each slice as channels (``r = data.slab_radius``; at the ends the
  end slice repeats), for any 2-D family (the first convolution takes ``2r + 1`` channels, adapted from pretrained
  weights as for grayscale);
* ``volume``: the whole volume, resampled to ``data.spacing`` and cropped / padded to ``data.volume_size``.

A slice's label is its volume's, or with ``data.slice_labels: mask`` whether the slice holds at least
``data.min_mask_voxels`` voxels of the volume's label map (classes ``absent`` / ``present``, renamed by
``data.classes``). Every sample of one patient
(the manifest's ``patient_id``, else the DICOM PatientID, else the volume itself) stays in one split.

Setup reads every volume once (the refusals of :func:`~vitlab.data.volume.read_volume` happen there, and a
volume that is refused is skipped as a whole in skip mode), keeping only its slice count and per-slice mask
flags. The loaders then read volumes through a :class:`VolumeStore`: each process holds at most
``volumes_in_memory`` prepared volumes (least recently used out), and the training order visits the volumes in
blocks of that many (:class:`~vitlab.data.sampling.EpochSampler`'s ``groups``), so an epoch decodes each volume
once per process whatever the number of volumes, and the memory held stays bounded.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vitlab.data.dataset import MedicalImageDataset
from vitlab.data.io import image_kind
from vitlab.data.layouts import MASKS_FOLDER, UNLABELLED, Layout, Sample, _read_manifest, skip_or_raise
from vitlab.data.read_options import ImageReadError, ReadOptions, VolumeError, min_max, window_values
from vitlab.data.volume import NIFTI_SUFFIXES, read_volume

SAMPLE_MODES = ("image", "slice", "slab", "volume")
INTENSITIES = ("window", "percentile", "zscore")
SLICE_LABELS = ("volume", "mask")
MASK_CLASSES = ("absent", "present")  # slice_labels: mask


def _is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def _dicom_files(folder: Path) -> list[Path]:
    with os.scandir(folder) as entries:
        return sorted(Path(e.path) for e in entries if e.is_file() and not _is_nifti(Path(e.name)) and image_kind(e.path) == "dicom")


def volume_problem(path: Path) -> str | None:
    """Why ``path`` is not a volume vitlab reads (None: a NIfTI file, a folder with DICOM files, a DICOM file)."""
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return None if _dicom_files(path) else "is a folder without DICOM files (a volume is a NIfTI file or a DICOM series folder)"
    if _is_nifti(path) or image_kind(path) == "dicom":
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


def _volumes_under(folder: Path, skip_top: str | None = None) -> list[tuple[Path, str | None]]:
    """(path, series_uid) of every volume under ``folder``: NIfTI files (not ``*_mask``) and DICOM series folders."""
    found = []
    for here, subdirs, names in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not (Path(here) == folder and d == skip_top))
        here = Path(here)
        found += [(here / n, None) for n in sorted(names) if not n.startswith(".") and _is_nifti(Path(n))
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


def scan_volumes(root: Path, *, labels: bool, on_bad_file: str) -> Layout:
    """Volumes under ``root``: class folders ``root/<class>/**`` (masks in a parallel ``root/masks/<class>/**``
    tree), every volume under a folder (``labels`` False), or a ``.csv`` manifest whose ``path`` is a NIfTI file,
    a series folder or a multi-frame DICOM file (``mask``, ``label``, ``split``, ``patient_id`` as for images)."""
    if root.is_file():
        if root.suffix.lower() != ".csv":
            raise ValueError(f"data root {root} is a file but not a .csv manifest")
        return _read_manifest(root, on_bad_file, labels, problem=volume_problem)
    if not labels:
        found = _volumes_under(root, skip_top=MASKS_FOLDER)
        if not found:
            raise ValueError(f"data root {root} holds no volumes (.nii / .nii.gz files or folders of DICOM files)")
        return Layout([Sample(p.resolve(), UNLABELLED, series_uid=uid) for p, uid in found], [], skipped=[])
    samples = []
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != MASKS_FOLDER)
    for class_dir in class_dirs:
        found = _volumes_under(class_dir)
        if not found:
            raise ValueError(f"class folder {class_dir} holds no volumes (.nii / .nii.gz files or folders of DICOM files)")
        samples += [Sample(p.resolve(), class_dir.name, mask=_parallel_mask(root, p), series_uid=uid) for p, uid in found]
    return Layout(samples, [d.name for d in class_dirs], skipped=[])


@dataclass(frozen=True)
class VolumeOptions:
    """How volumes become samples and values (``data.sample``, ``data.slab_radius``, ...; see :class:`ImageData`)."""

    sample: str = "slice"
    slab_radius: int = 1
    slice_labels: str = "volume"
    intensity: str = "window"
    min_mask_voxels: int = 1

    def __post_init__(self) -> None:
        if self.sample not in SAMPLE_MODES[1:]:
            raise ValueError(f"data.sample must be one of {list(SAMPLE_MODES)}, got {self.sample!r}")
        if isinstance(self.slab_radius, bool) or not isinstance(self.slab_radius, int) or self.slab_radius < 0:
            raise ValueError(f"data.slab_radius must be an int >= 0 (slices each side of the centre), got {self.slab_radius!r}")
        if self.slice_labels not in SLICE_LABELS:
            raise ValueError(f"data.slice_labels must be one of {list(SLICE_LABELS)}, got {self.slice_labels!r}")
        if isinstance(self.min_mask_voxels, bool) or not isinstance(self.min_mask_voxels, int) or self.min_mask_voxels < 1:
            raise ValueError(f"data.min_mask_voxels must be an int >= 1, got {self.min_mask_voxels!r}")
        if self.intensity not in INTENSITIES:
            raise ValueError(f"data.intensity must be one of {list(INTENSITIES)}, got {self.intensity!r}")

    @property
    def channels(self) -> int:
        return 2 * self.slab_radius + 1 if self.sample == "slab" else 1


def read_label_map(sample: Sample, image_shape: tuple, image_affine: np.ndarray) -> np.ndarray:
    """The volume label map of ``sample`` as uint8 (I, J, K), checked against its image's grid.

    Raises:
        VolumeError: A DICOM SEG, a shape or affine that differs from the image's (both said), or values that are
            not labels (negative or not whole numbers).
    """
    where = f"mask {sample.mask} of {sample.path}"
    if sample.mask.is_file() and image_kind(sample.mask) == "dicom" and not _is_nifti(sample.mask):
        raise VolumeError(f"{where}: DICOM SEG masks are not read; export the segmentation as a NIfTI label map "
                          "(0 = background, 1..K = classes, the image's grid), e.g. with highdicom or dcmqi")
    try:
        mask = read_volume(sample.mask)
    except ImageReadError as exc:
        raise VolumeError(f"{where}: {exc}") from None
    if mask.shape != tuple(image_shape) or not np.allclose(mask.affine, image_affine, atol=1e-3, rtol=1e-5):
        raise VolumeError(
            f"{where}: its grid does not match the image's: shape {mask.shape} vs {tuple(image_shape)}, affine "
            f"{np.round(mask.affine[:3], 3).tolist()} vs {np.round(image_affine[:3], 3).tolist()}; a label map lies on its image's voxels"
        )
    values = np.unique(mask.array)
    bad = values[(values < 0) | (values != np.round(values)) | (values > 255)]
    if bad.size:
        raise VolumeError(f"{where}: value(s) {bad[:5].tolist()} are not labels (0 = background, 1..255 = classes)")
    return mask.array.astype(np.uint8)


def check_volumes(samples: Sequence[Sample], options: VolumeOptions, on_bad_file: str = "skip",
                  needs_mask: bool = False) -> tuple[list[Sample], list[str]]:
    """Read every volume (and label map) once; return its samples (one per slice, or the volume) with patient
    ids and labels, and one message per volume dropped."""
    kept, skipped = [], []
    for sample in samples:
        try:
            if sample.mask is None and (needs_mask or options.slice_labels == "mask"):
                raise VolumeError(f"{sample.path}: no label map (a manifest 'mask' column or a masks/<class>/ tree), "
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


def intensities(hu: np.ndarray, read_options: ReadOptions, intensity: str) -> np.ndarray:
    """Modality values -> model values (float32): the window (explicit / preset; else the volume's min-max) to
    [0, 1]; ``percentile``: clipped to the 0.5-99.5 percentiles of the non-zero voxels, scaled to [0, 1];
    ``zscore``: (x - mean) / std of the non-zero voxels (not clipped)."""
    if intensity == "window":
        window = read_options.explicit_window
        return min_max(hu) if window is None else window_values(hu, *window)
    body = hu[hu != 0]
    body = body if body.size else hu.ravel()
    if intensity == "percentile":
        low, high = np.percentile(body, [0.5, 99.5])
        if high <= low:
            return np.zeros_like(hu, dtype=np.float32)
        return np.clip((hu - np.float32(low)) / np.float32(high - low), 0.0, 1.0).astype(np.float32)
    mean, std = float(body.mean()), float(body.std())
    return ((hu - np.float32(mean)) / np.float32(std if std > 0 else 1.0)).astype(np.float32)


class VolumeStore:
    """Prepared volumes of this process, at most ``capacity`` at a time (least recently used out).

    A prepared volume is (K, J, I) float32, C-ordered (a slab is contiguous), values through :func:`intensities`;
    its label map (K, J, I) uint8 is read on first need. ``decodes`` counts volumes read, ``most_held`` the most
    held at once. A copy sent to a loader worker starts empty.
    """

    def __init__(self, options: VolumeOptions, read_options: ReadOptions, capacity: int = 4) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"data.volumes_in_memory must be an int >= 1, got {capacity!r}")
        self.options, self.read_options, self.capacity = options, read_options, capacity
        self._held: OrderedDict = OrderedDict()
        self.decodes = self.most_held = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_held=OrderedDict(), decodes=0, most_held=0)
        return state

    def _entry(self, sample: Sample) -> dict:
        key = (str(sample.path), sample.series_uid)
        entry = self._held.get(key)
        if entry is not None:
            self._held.move_to_end(key)
            return entry
        volume = read_volume(sample.path, series_uid=sample.series_uid)
        values = intensities(volume.array, self.read_options, self.options.intensity)  # (I, J, K)
        entry = {"image": np.ascontiguousarray(values.transpose(2, 1, 0)), "grid": (volume.shape, volume.affine)}  # (K, J, I)
        while len(self._held) >= self.capacity:
            self._held.popitem(last=False)
        self._held[key] = entry
        self.decodes += 1
        self.most_held = max(self.most_held, len(self._held))
        return entry

    def image(self, sample: Sample) -> np.ndarray:
        """The slice (J, I, 1) or slab (J, I, 2r + 1) around ``sample.slice``; slices past an end repeat it."""
        image = self._entry(sample)["image"]
        r = self.options.slab_radius if self.options.sample == "slab" else 0
        ks = np.clip(np.arange(sample.slice - r, sample.slice + r + 1), 0, image.shape[0] - 1)
        return np.ascontiguousarray(image[ks].transpose(1, 2, 0))  # (J, I, C)

    def mask(self, sample: Sample, num_classes: int) -> np.ndarray:
        """The label map's slice (J, I) int64 at ``sample.slice``, its values checked against ``num_classes``."""
        entry = self._entry(sample)
        if "mask" not in entry:
            entry["mask"] = np.ascontiguousarray(read_label_map(sample, *entry["grid"]).transpose(2, 1, 0))
        return within_classes(sample, entry["mask"][sample.slice].astype(np.int64), num_classes)  # (J, I)


def within_classes(sample: Sample, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``labels`` (int64) when every value is 0..``num_classes``, else a one-line :class:`MaskError` naming them."""
    from vitlab.data.masks import MaskError

    if labels.max(initial=0) > num_classes:
        extra = sorted(set(np.unique(labels).tolist()) - set(range(num_classes + 1)))
        raise MaskError(f"mask {sample.mask} of {sample.path}: label value(s) {extra} not in the classes "
                        f"(0 = background, 1-{num_classes})")
    return labels


INTENSITY_JITTER_KEYS = ("scale", "scale_prob", "shift", "shift_prob")


def intensity_jitter(value: dict[str, float] | None) -> dict[str, float] | None:
    """``data.volume_intensity`` checked: None, or a mapping of ``scale`` / ``shift`` (>= 0, default 0) and
    ``scale_prob`` / ``shift_prob`` (in [0, 1], default 1); one line naming the key otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - set(INTENSITY_JITTER_KEYS):
        unknown = sorted(set(value) - set(INTENSITY_JITTER_KEYS)) if isinstance(value, dict) else value
        raise ValueError(f"data.volume_intensity takes {', '.join(INTENSITY_JITTER_KEYS)} (e.g. {{scale: 0.1, "
                         f"scale_prob: 0.1, shift: 0.1, shift_prob: 0.5}}), got {unknown!r}")
    out = {"scale": 0.0, "scale_prob": 1.0, "shift": 0.0, "shift_prob": 1.0}
    for key, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0 or (key.endswith("_prob") and number > 1):
            valid = "in [0, 1]" if key.endswith("_prob") else ">= 0"
            raise ValueError(f"data.volume_intensity.{key} must be a number {valid}, got {number!r}")
        out[key] = float(number)
    return out


class KeyedVolumeTransform:
    """The transform of a :class:`VolumeDataset`, drawn from the generator
    :class:`~vitlab.data.sampling.KeyedAugmentation` sets for each sample (unseeded outside it: a fresh draw):

    - ``flip``: which of the axes i, j, k an item is flipped along (each with probability 0.5);
    - ``intensity`` (:func:`intensity_jitter`): with probability ``scale_prob`` the intensities are multiplied by
      ``1 + u``, u uniform in [-scale, scale] (MONAI's ``RandScaleIntensity``), and with probability ``shift_prob``
      ``v`` uniform in [-shift, shift] is added (``RandShiftIntensity``), on the windowed values.

    Every item draws the same count of numbers whatever comes out (3 for the flips, 4 for the intensities)."""

    def __init__(self, flip: bool, intensity: dict[str, float] | None = None) -> None:
        self.flip, self.intensity = flip, intensity_jitter(intensity)
        self._rng: np.random.Generator | None = None

    def set_random_state(self, rng: np.random.Generator, py_random=None) -> None:  # as albumentations' Compose
        self._rng = rng

    def draw(self) -> tuple[list[int], float, float]:
        """(axes to flip, factor, offset): values become ``values * factor + offset``."""
        rng = self._rng if self._rng is not None else np.random.default_rng()
        axes = [axis for axis, draw in enumerate(rng.random(3)) if draw < 0.5] if self.flip else []
        factor, offset = 1.0, 0.0
        if self.intensity is not None:
            scaled, u, shifted, v = rng.random(4)
            jitter = self.intensity
            if scaled < jitter["scale_prob"]:
                factor = 1.0 + (2.0 * u - 1.0) * jitter["scale"]
            if shifted < jitter["shift_prob"]:
                offset = (2.0 * v - 1.0) * jitter["shift"]
        return axes, factor, offset


class VolumeDataset(MedicalImageDataset):
    """Whole volumes (``data.sample: volume``): each resampled to ``spacing`` mm (trilinear, :func:`resample`),
    cropped / padded about its centre to ``size`` voxels, values through :func:`intensities`; items are
    ``(tensor (1, I, J, K), label)`` in the volume's array axes (MONAI's channel-first layout). Bad volumes are
    skipped as images are (:meth:`first_good`). ``size`` None keeps each volume's resampled size (batches of
    one, or patches). The augmentations are ``flip`` and ``intensity`` (``transform`` is a
    :class:`KeyedVolumeTransform`), seeded per sample
    with the patch draw by :class:`~vitlab.data.sampling.KeyedAugmentation` from (seed, epoch, index) in the
    training loader, so neither depends on the loader workers.

    With ``num_mask_classes`` (segmentation) items are ``(tensor, {"mask": (I, J, K) int64})``: the label map
    resampled with nearest neighbours onto the same grid and padded with background.

    With ``patch_size`` (training) each item is a random patch of that many voxels of the volume (padded first
    where smaller), as MONAI's ``RandCropByPosNegLabeld`` draws them: with probability ``patch_foreground`` the
    patch is centred on a random foreground voxel of the label map (when it has one), else placed uniformly
    (shifted inside the volume). The draws come from the generator :meth:`set_random_state` gives, which
    :class:`~vitlab.data.sampling.KeyedAugmentation` seeds with (seed, epoch, index): whatever the loader
    workers, one patch per sample and epoch.

    Args:
        samples: One per volume (``slice`` None).
        class_names: Class order.
        options: The volume options (intensity).
        read_options: The window.
        spacing: Voxel size in mm along i, j, k; None keeps each volume's own.
        size: Voxels along i, j, k after crop / pad; None keeps each volume's size.
        on_bad_file: ``"skip"`` or ``"error"``.
        bad_paths: The set that collects volumes skipped at load time.
        num_mask_classes: Foreground classes of the label maps (segmentation); None: items carry the volume's label.
        patch_size: Voxels along i, j, k of a random training patch; None: the whole (cropped / padded) volume.
        patch_foreground: Probability that a patch is centred on a foreground voxel (segmentation).
        flip: Flip each item (volume and label map) along each of i, j, k with probability 0.5 (``data.volume_flip``,
            training only).
        intensity: Random intensity scale / shift of each item (``data.volume_intensity``, training only; see
            :class:`KeyedVolumeTransform`).
    """

    def __init__(self, samples: Sequence[Sample], class_names: Sequence[str], options: VolumeOptions,
                 read_options: ReadOptions, spacing: Sequence[float] | None, size: Sequence[int] | None, *,
                 on_bad_file: str = "skip", bad_paths: set[str] | None = None, num_mask_classes: int | None = None,
                 patch_size: Sequence[int] | None = None, patch_foreground: float = 0.5, flip: bool = False,
                 intensity: dict[str, float] | None = None) -> None:
        super().__init__(samples, class_names, KeyedVolumeTransform(flip, intensity), read_options=read_options, on_bad_file=on_bad_file,
                         bad_paths=bad_paths)
        self.options, self.spacing = options, spacing
        self.size = None if size is None else tuple(int(n) for n in size)
        self.num_mask_classes = num_mask_classes
        self.patch_size = None if patch_size is None else tuple(int(n) for n in patch_size)
        self.patch_foreground = float(patch_foreground)
        self.rng = np.random.default_rng(0)  # reseeded per item by KeyedAugmentation
        self.last_spacing: tuple[float, ...] | None = None

    def set_random_state(self, rng: np.random.Generator, py_rng) -> None:
        super().set_random_state(rng, py_rng)
        self.rng = rng

    def draw_patch(self, volume, mask):
        """A random ``patch_size`` block of ``volume`` (padded with its lowest value where smaller) and the same
        block of ``mask`` (None without one), drawn from ``self.rng`` (see the class docstring)."""
        from vitlab.data.resample import crop_at, crop_or_pad

        patch = np.asarray(self.patch_size)
        if np.any(patch > np.asarray(volume.shape)):
            grown = tuple(int(n) for n in np.maximum(patch, volume.shape))
            volume = crop_or_pad(volume, grown, fill=float(volume.array.min()))
            mask = None if mask is None else crop_or_pad(mask, grown, fill=0.0)
        high = np.asarray(volume.shape) - patch  # origins 0..high along each axis
        centred = self.rng.random() < self.patch_foreground  # drawn for every patch: the stream does not depend on the mask
        pick = self.rng.random()
        origin = np.array([self.rng.integers(0, h + 1) for h in high])
        if mask is not None and centred:
            foreground = np.flatnonzero(mask.array > 0.5)
            if foreground.size:
                centre = np.array(np.unravel_index(foreground[min(int(pick * foreground.size), foreground.size - 1)], mask.shape))
                origin = np.clip(centre - patch // 2, 0, high)
        return crop_at(volume, origin, patch), None if mask is None else crop_at(mask, origin, patch)

    def load_volume(self, index: int):
        """The resampled, cropped / padded :class:`~vitlab.data.volume.Volume` of sample ``index`` (values: HU) and
        its label map on the same grid (None without ``num_mask_classes``)."""
        from vitlab.data.resample import crop_or_pad, resample

        sample = self.samples[index]
        volume = read_volume(sample.path, series_uid=sample.series_uid)
        mask = None
        if self.num_mask_classes is not None:
            from vitlab.data.volume import Volume

            mask = Volume(read_label_map(sample, volume.shape, volume.affine).astype(np.float32), volume.affine)
        if self.spacing is not None:
            volume = resample(volume, self.spacing, mode="linear")
            mask = None if mask is None else resample(mask, self.spacing, mode="nearest", fill=0.0)
        self.last_spacing = volume.spacing  # voxel size in mm of the volume loaded last (crop / pad keep it)
        fill = float(volume.array.min())  # outside the field of view: the volume's lowest value (air in CT)
        if self.size is not None:
            volume, mask = crop_or_pad(volume, self.size, fill=fill), None if mask is None else crop_or_pad(mask, self.size, fill=0.0)
        return volume, mask

    def _item(self, index: int):
        import torch

        from vitlab.data.dataset import finite_tensor

        volume, mask = self.load_volume(index)
        values = intensities(volume.array, self.read_options, self.options.intensity)  # (I, J, K), of the whole volume
        if self.patch_size is not None:
            from vitlab.data.volume import Volume

            patch, mask = self.draw_patch(Volume(values, volume.affine), mask)
            values = patch.array
        axes, factor, offset = self.transform.draw()  # drawn before the checks: one draw per item, whatever its outcome
        tensor = finite_tensor(self.samples[index].path, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))[None])
        if factor != 1.0 or offset != 0.0:
            tensor = tensor * factor + offset
        if axes:
            tensor = tensor.flip([a + 1 for a in axes])
        if mask is None:
            return tensor, self.labels[index]  # (1, I, J, K)
        labels = within_classes(self.samples[index], np.rint(mask.array).astype(np.int64), self.num_mask_classes)  # (I, J, K)
        labels = torch.from_numpy(labels)
        return tensor, {"mask": labels.flip(axes) if axes else labels}
