"""The images and volumes the probes read: from files (``--images``) or from a run's data, as training reads them.

:func:`image_stream` lists them without reading (a 2-D model's images; with ``volumes``, a 3-D model's volumes:
:func:`volume_stream`), and the :class:`ImageStream` reads them on demand, a batch at a time; :func:`load_images`
reads them all at once into an :class:`ImageBatch`. A run's data is its recorded data module
(:class:`vitlab.run_record.DataRecord`; none recorded: the embedded synthetic set) rebuilt for evaluation
(:func:`evaluation_data`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vitlab import models
from vitlab.run_record import EMBEDDED, DataRecord

if TYPE_CHECKING:
    from vitlab.data.datasets.volumes import VolumeDataset
    from vitlab.data.layouts import Sample
    from vitlab.data.readers.options import ReadOptions
    from vitlab.data.volume_options import VolumeOptions
    from vitlab.probes.loading import LoadedModel

IMAGE_SUFFIXES = {".dcm", ".dicom", ".png", ".jpg", ".jpeg", ".tif", ".tiff"}
VOLUME_PROBES = "drift, spectra, claims, attention, mi, stats, features and ablate"


@dataclass
class ImageBatch:
    """Probe images: ``pixels`` in [0, 1] (for display / inversion targets) and the model input."""

    pixels: torch.Tensor  # (N, C, H, W) in [0, 1]; a 3-D model's volumes: (N, C, I, J, K)
    inputs: torch.Tensor  # (N, C, H, W) normalised with the model's mean/std (volumes: as training gave them)
    labels: torch.Tensor | None  # (N,) int64, when the source has labels
    names: list[str]
    class_names: list[str] | None = None
    spacing: tuple[float, float, float] | None = None  # volumes: mm per voxel along i, j, k (one for all)
    masks: torch.Tensor | None = None  # (N, I, J, K) int64 label maps on the volumes' grid, when the data has mask_classes
    mask_classes: list[str] | None = None  # names of the mask values 1..K


def image_labels(batch) -> list[str]:
    """A row label per image: its index, file name (shortened) and class where the images have labels."""
    out = []
    for i, name in enumerate(batch.names):
        stem = name.rsplit("/", 1)[-1]
        label = f"#{i} {stem if len(stem) <= 18 else stem[:8] + '..' + stem[-8:]}"
        if batch.labels is not None:
            cls = int(batch.labels[i])
            label += f"\n{batch.class_names[cls] if batch.class_names and 0 <= cls < len(batch.class_names) else f'class {cls}'}"
        out.append(label)
    return out


@dataclass
class ImageStream:
    """The probe images of :func:`load_images`, read on demand: memory holds one batch, not all N images."""

    count: int
    read: Callable[[int], tuple[torch.Tensor, int | None, str]]  # i -> ((C, H, W) pixels in [0, 1], label, name)
    mean: list[float]
    std: list[float]
    labelled: bool
    class_names: list[str] | None = None
    spacing: tuple[float, float, float] | None = None  # volumes: mm per voxel along i, j, k, the same for every volume
    read_mask: Callable[[int], torch.Tensor] | None = None  # i -> (I, J, K) int64 label map of volume i (data with mask_classes)
    mask_classes: list[str] | None = None  # names of the mask values 1..K

    @property
    def volumetric(self) -> bool:
        return self.spacing is not None

    def pixel_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(b, C, H, W) (volumes: (b, C, I, J, K)) pixels in [0, 1] and (b,) labels (None when unlabelled), in order."""
        for start in range(0, self.count, batch_size):
            items = [self.read(i) for i in range(start, min(start + batch_size, self.count))]
            labels = torch.tensor([label for _, label, _ in items]) if self.labelled else None
            yield torch.stack([pixel for pixel, _, _ in items]), labels

    def image_batches(self, batch_size: int) -> Iterator[ImageBatch]:
        """The stream as :class:`ImageBatch` chunks of ``batch_size`` (the last one shorter), in order, with their
        names, spacing and (when the stream has them) label maps: ``load_images`` a batch at a time."""
        for start in range(0, self.count, batch_size):
            yield self.batch(range(start, min(start + batch_size, self.count)))

    def batch(self, index: range) -> ImageBatch:
        """Items ``index`` as one :class:`ImageBatch`."""
        items = [self.read(i) for i in index]
        labels = torch.tensor([label for _, label, _ in items]) if self.labelled else None
        batch = _finish(torch.stack([pixel for pixel, _, _ in items]), labels, [name for _, _, name in items], self.class_names,
                        self.mean, self.std)
        batch.spacing = self.spacing
        if self.read_mask is not None:
            batch.masks, batch.mask_classes = torch.stack([self.read_mask(i) for i in index]), self.mask_classes
        return batch

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Normalised model inputs (b, C, H, W), the same values as ``load_images(...).inputs``, in order."""
        for pixels, _ in self.pixel_batches(batch_size):
            yield _finish(pixels, None, [], None, self.mean, self.std).inputs


def load_images(args: argparse.Namespace, loaded: LoadedModel, default_count: int, split: str | None = None,
                volumes: bool = False) -> ImageBatch:
    """Images from --images, else the split of the run's data, else of the embedded dataset (``volumes``: a 3-D
    model's volumes, else such a model is refused)."""
    stream = image_stream(args, loaded, default_count, split, volumes)
    return stream.batch(range(stream.count))


def planar_input(model: nn.Module, source: str) -> tuple[int, int, int]:
    """The model's (in_chans, H, W); a 3-D model (a volume input) is refused in one line naming the probes
    that take one."""
    shape = tuple(models.input_size(model))
    if len(shape) != 3:
        raise ValueError(f"{source}: a 3-D model (input {shape}: channels and a {len(shape) - 1}-D volume); this probe reads 2-D "
                         f"images and draws 2-D maps and does not take 3-D checkpoints (the probes that do: {VOLUME_PROBES})")
    return shape  # type: ignore[return-value]


def evaluation_data(data: DataRecord | None, **overrides: Any) -> Any:
    """The data module of a run's record (none: the embedded set) as validation reads it: no augmentation, no loader
    workers, only the labelled images (no ``unlabelled_root``), ``overrides`` for the model's input."""
    return (data or EMBEDDED).build(augment="none", num_workers=0, unlabelled_root=None, **overrides)


def drawn(dm: Any, split: str, count: int, seed: int, what: str) -> tuple[str, list[int], bool]:
    """The split to read (unlabelled data: ``train``, where all its images are), the indices of ``count`` of its
    samples in a random order drawn by ``seed``, and whether they have labels."""
    samples, labelled = dm.samples(split), dm.has_labels
    if not samples and not labelled:
        split, samples = "train", dm.samples("train")
    if not samples:
        raise ValueError(f"the data has no '{split}' {what}; choose --split among those present or pass --images")
    return split, torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed))[:count].tolist(), labelled


def image_stream(args: argparse.Namespace, loaded: LoadedModel, default_count: int, split: str | None = None,
                 volumes: bool = False) -> ImageStream:
    """The images :func:`load_images` would return, as a stream (the files are listed, not read); with
    ``volumes``, a 3-D model's volumes (:func:`volume_stream`)."""
    from vitlab.data import read_image

    count = args.num_images or default_count
    if count < 1:
        raise ValueError(f"--num-images must be >= 1, got {count}")
    split = split or args.split
    if volumes and len(models.input_size(loaded.model)) == 4:
        return volume_stream(args, loaded, count, split)
    in_chans, height, width = planar_input(loaded.model, loaded.source)
    mean, std = models.normalization(loaded.model)
    if args.images:
        files = _expand_images(args.images)[:count]
        return ImageStream(len(files), lambda i: (_to_tensor(read_image(files[i]), in_chans, height, width), None, str(files[i])), mean, std, False)
    dm = evaluation_data(loaded.data, in_chans=in_chans, image_size=height, mean=[0.0] * in_chans, std=[1.0] * in_chans)
    split, order, labelled = drawn(dm, split, count, args.seed, "images")
    samples, dataset = dm.samples(split), dm.image_dataset(split)  # (image, label) items, also of dense data

    def read(i: int) -> tuple[torch.Tensor, int, str]:
        image, label = dataset[order[i]]
        return image.float().clamp(0, 1), int(label), str(samples[order[i]].path)

    return ImageStream(len(order), read, mean, std, labelled, dm.class_names if labelled else None)


# ---------------------------------------------------------------------------------------------- volumes


@dataclass
class Volumes:
    """The volumes a :func:`volume_stream` reads and how training reads them."""

    samples: list[Sample]
    labelled: bool
    class_names: list[str] | None
    options: VolumeOptions
    read_options: ReadOptions
    mask_classes: list[str] | None = None  # names of the label-map values 1..K, when every volume has one


def volume_stream(args: argparse.Namespace, loaded: LoadedModel, count: int, split: str) -> ImageStream:
    """A 3-D model's probe volumes, read one at a time as training reads them (:class:`~vitlab.data.datasets.volumes.VolumeDataset`):
    resampled to ``--spacing`` (else the run's ``data.spacing``, else left at each volume's own), cropped / padded
    about the centre to the model's input size, intensities through the run's window / ``data.intensity``, no
    mean / std (training gives volumes to the model in [0, 1]). Volumes come from ``--images`` (NIfTI files, DICOM
    series folders, folders holding them, :func:`volume_files`), else the split of the run's data (:func:`run_volumes`).

    The stream's ``spacing`` is the voxel size in mm along i, j, k of every volume it gives: distances in the 3-D
    probes are millimetres (see docs/volumes.md). Volumes of different voxel sizes (no spacing to resample to) are
    refused in one line when read.

    With segmentation data (a data module with ``mask_classes``) and a label map for every chosen volume, the stream's
    ``read_mask`` gives each volume's label map on the volume's grid (resampled with nearest neighbours, as training
    reads it) and ``mask_classes`` names its values 1..K.
    """
    from vitlab.data.datasets.volumes import VolumeDataset
    from vitlab.data.layouts import UNLABELLED

    in_chans, *size = models.input_size(loaded.model)
    recorded = loaded.data.arguments if loaded.data is not None else {}
    spacing = args.spacing or recorded.get("spacing")
    if spacing is not None and (len(spacing) != 3 or min(spacing) <= 0):
        raise ValueError(f"--spacing / data.spacing must be three voxel sizes > 0 in mm, got {list(spacing)}")
    if args.images:
        volumes = volume_files(args.images, count, recorded, spacing, size)
    else:
        volumes = run_volumes(loaded.data, in_chans, size, spacing, split, count, args.seed)
    masks = volumes.mask_classes
    dataset = VolumeDataset(volumes.samples, volumes.class_names or [UNLABELLED], volumes.options, volumes.read_options,
                            on_bad_file="error", num_mask_classes=len(masks) if masks else None)
    first = None if spacing is not None else tuple(float(v) for v in dataset.load_volume(0)[0].spacing)
    reads = VolumeReads(dataset, in_chans, volumes.labelled, bool(masks), first)
    return ImageStream(len(volumes.samples), reads.read, [0.0] * in_chans, [1.0] * in_chans, volumes.labelled, volumes.class_names,
                       tuple(float(v) for v in (spacing or first)), reads.read_mask if masks else None, masks)


def volume_files(paths: list[str], count: int, recorded: dict[str, Any], spacing, size: list[int]) -> Volumes:
    """The first ``count`` volumes of ``--images`` (files, series folders, folders holding them; label maps left out),
    unlabelled, read through the run's window and ``data.intensity`` when known."""
    from vitlab.data.layouts import UNLABELLED, Sample
    from vitlab.data.readers.options import ReadOptions
    from vitlab.data.volume_layouts import volume_problem, volumes_under
    from vitlab.data.volume_options import VolumeOptions

    samples: list[Sample] = []
    for path in map(Path, paths):
        problem = None if path.is_dir() else volume_problem(path)
        if problem is not None:
            raise ValueError(f"--images {path} {problem}")
        found = volumes_under(path) if path.is_dir() else [(path, None)]  # NIfTI files and series folders under it
        samples += [Sample(p.resolve(), UNLABELLED, series_uid=uid) for p, uid in found]
    if not samples:
        raise ValueError(f"--images {' '.join(paths)}: no volumes (.nii / .nii.gz files or folders of DICOM files)")
    read_options = ReadOptions(**{k: recorded[k] for k in ("window", "window_center", "window_width", "window_index") if k in recorded})
    options = VolumeOptions("volume", intensity=recorded.get("intensity", "window"), spacing=spacing, volume_size=size)
    return Volumes(samples[:count], False, None, options, read_options)


def run_volumes(data: DataRecord | None, in_chans: int, size: list[int], spacing, split: str, count: int, seed: int) -> Volumes:
    """``count`` volumes of the run's ``split`` drawn by ``seed``, with the run's volume arguments, whole (cropped /
    padded to ``size``, no training patches), and their label maps' classes when every chosen volume has one."""
    overrides: dict[str, Any] = dict(in_chans=in_chans, volume_size=list(size), spacing=spacing, patch_size=None)
    if data is None or data.arguments.get("sample") != "volume":
        overrides["sample"] = "volume"
    dm = evaluation_data(data, **overrides)
    split, order, labelled = drawn(dm, split, count, seed, "volumes")
    samples = [dm.samples(split)[i] for i in order]
    mask_classes = getattr(dm, "mask_classes", None)  # segmentation data: label maps on the volumes' grid
    with_masks = bool(mask_classes) and all(s.mask is not None for s in samples)
    return Volumes(samples, labelled, dm.class_names if labelled else None, dm.volume_options, dm.read_options,
                   [str(name) for name in mask_classes] if with_masks else None)


class VolumeReads:
    """Volume ``i`` of a :class:`~vitlab.data.datasets.volumes.VolumeDataset` as the probes take it: (C, I, J, K) in
    [0, 1] with the model's channels, its label, its name; and its label map, from the same load.

    ``first``: the voxel size of the first volume when nothing resamples them; another voxel size is refused."""

    def __init__(self, dataset: VolumeDataset, in_chans: int, labelled: bool, masks: bool,
                 first: tuple[float, ...] | None) -> None:
        self.dataset, self.in_chans, self.labelled, self.masks, self.first = dataset, in_chans, labelled, masks, first
        self._mask: dict[int, torch.Tensor] = {}  # the label map of the volume read last: read and read_mask share one load

    def read(self, i: int) -> tuple[torch.Tensor, int | None, str]:
        volume, label = self.dataset[i]
        if self.masks:
            self._mask.clear()
            self._mask[i], label = label["mask"], self.dataset.labels[i]
        if self.first is not None:
            self._check_spacing(i)
        volume = volume.float().clamp(0, 1)
        if volume.shape[0] != self.in_chans:
            volume = volume[:1].repeat(self.in_chans, *[1] * (volume.ndim - 1))
        return volume, (int(label) if self.labelled else None), self.dataset.samples[i].key

    def read_mask(self, i: int) -> torch.Tensor:
        if i not in self._mask:
            self.read(i)
        return self._mask[i]

    def _check_spacing(self, i: int) -> None:
        own = tuple(float(v) for v in self.dataset.last_spacing)  # of the volume just read (not read again)
        if max(abs(a - b) / b for a, b in zip(own, self.first)) > 0.01:
            mm = lambda size: " x ".join(f"{v:.4g}" for v in size)  # noqa: E731
            raise ValueError(f"{self.dataset.samples[i].key}: voxel size {mm(own)} mm differs from {mm(self.first)} mm of "
                             f"{self.dataset.samples[0].key}; distances in mm need one voxel size: pass --spacing MM MM MM "
                             "(or set data.spacing) to resample every volume to it")


# ---------------------------------------------------------------------------------------------- helpers


def _finish(pixels, labels, names, class_names, mean, std) -> ImageBatch:
    shape = (1, -1) + (1,) * (pixels.ndim - 2)
    m = torch.tensor(mean).view(shape)
    s = torch.tensor(std).view(shape)
    return ImageBatch(pixels, (pixels - m) / s, labels, names, class_names)


def _to_tensor(array, in_chans: int, height: int, width: int) -> torch.Tensor:
    import torch.nn.functional as F

    t = torch.as_tensor(array, dtype=torch.float32)
    t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)  # (C, H, W)
    if t.shape[0] != in_chans:
        t = t.mean(0, keepdim=True).repeat(in_chans, 1, 1) if in_chans in (1, 3) else t[:1].repeat(in_chans, 1, 1)
    return F.interpolate(t[None], size=(height, width), mode="bilinear", align_corners=False, antialias=True)[0].clamp(0, 1)


def _expand_images(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
                            and "masks" not in f.relative_to(p).parts[:-1])  # label maps (vitlab.data.masks) are not images
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"--images {p}: no such file or folder")
    if not files:
        raise ValueError(f"--images {' '.join(paths)}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files
