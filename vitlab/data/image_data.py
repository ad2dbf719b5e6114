"""Files -> splits -> augmented, normalised batches, without Lightning (probes use it; ``train.py`` uses the
LightningDataModule over it, :class:`vitlab.data.datamodule.MedicalDataModule`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Literal

import albumentations as A
import torch
from torch.utils.data import DataLoader

from vitlab.data.cache import ArrayCache, MemoryCache, cache_root
from vitlab.data.datasets.images import MedicalImageDataset, SkippedFiles
from vitlab.data.datasets.slices import VolumeStore
from vitlab.data.datasets.volumes import VolumeDataset
from vitlab.data.layouts import (SPLITS, UNLABELLED, Sample, check_files, check_validation, patient_overlap, scan, split_by_patient,
                                 training_only, warn_unlabelled_overlap)
from vitlab.data.readers.image import ImageReader
from vitlab.data.readers.options import ReadOptions
from vitlab.data.sampling import EpochLoader, EpochSampler, KeyedAugmentation
from vitlab.data.synthetic import embedded as embedded_sets  # (looked up at call time: tests replace them)
from vitlab.data.synthetic.embedded import EmbeddedOptions, embedded_options
from vitlab.data.transforms import (deferred_normalize, eval_transform, normalization_stats, normalize_images, seed_worker,
                                    single_opencv_thread, train_transform)
from vitlab.data.volume_layouts import MASK_CLASSES, check_volumes, volume_layout
from vitlab.data.volume_options import VolumeOptions


class ImageData:
    """Medical images from class folders, a CSV manifest or the embedded synthetic CT set (see
    :class:`MedicalDataModule` for the LightningDataModule over it).

    ``__init__`` only scans the layout (file names, labels), so ``num_classes``, ``class_names``
    and ``in_chans`` exist right after construction for LightningCLI's argument links. Headers are
    checked and splits assigned on first need (``setup`` or :meth:`samples`); pixels are decoded
    only by the dataloaders.

    Bad files, without decoding anything twice: ``setup`` reads every header once (missing files,
    non-DICOM, no pixel data, missing decoder plugin, truncated uncompressed pixels; DICOM
    PatientIDs for the split). Under ``on_bad_file="skip"`` each is warned about and dropped and
    ``skipped_files`` counts them; under ``"error"`` the first one stops the run. The headers stay in
    ``self.reader``, so the loaders read uncompressed pixels without parsing again; a file that still fails
    at decode time (e.g. corrupt compressed data, or a sample tensor that is not finite) is warned about and
    replaced by the next image, and counted in ``skipped_files`` whichever process loaded it (the loader
    workers share :attr:`skipped` with this one). A training run logs the count as ``data/skipped_files``
    (:class:`vitlab.callbacks.RuntimeCallback`); the data knows nothing of the trainer.

    Args:
        root: Class-folder root or a ``.csv`` manifest; None -> the embedded synthetic dataset.
        image_size: Side of the square model input in pixels.
        in_chans: 1 (grayscale) or 3 (colour; grayscale images are replicated).
        batch_size: Images per batch.
        num_workers: DataLoader worker processes (0 = load in the main process); they change the speed, never the
            batches. ``train.py`` sets it from ``runtime.workers``.
        window: Window preset name (see ``vitlab.data.readers.window.WINDOW_PRESETS``); None -> file tags / min-max.
        window_center: Explicit window center (HU for CT); needs ``window_width``.
        window_width: Explicit window width.
        window_index: Which of the file's windows to use when it lists several.
        frames: ``"middle"`` or a frame index for multi-frame files.
        val_fraction: Share of patients for validation when the manifest has no split column.
        test_fraction: Share of patients for test when the manifest has no split column.
        seed: Seed of the patient split, the shuffling and the augmentations.
        on_bad_file: ``"skip"`` (warn, drop, count in ``skipped_files``) or ``"error"``.
        augment: Built-in recipe: ``"none"``, ``"light"``, ``"default"`` or ``"strong"``.
        train_transforms: Full override of the training augmentations (vitlab appends resize + Normalize).
        mean: Normalize mean per channel; None -> ImageNet (averaged for one channel).
        std: Normalize std per channel; None -> ImageNet.
        cache: Keep decoded arrays on disk so epochs >= 2 skip decoding.
        memory_cache_mb: Keep decoded images (before augmentation; with their masks for detection and
            segmentation) and finished validation / test tensors in memory, up to this many MiB per process
            (each loader worker holds its own; nothing is added once full); 0: off. The quickstart's embedded
            dataset takes 9 MiB; a 512 x 512 CT slice for a 224 input 0.25 MiB (kept at 256 x 256).
        cache_dir: Folder of that cache; None -> ``$VITLAB_CACHE/arrays`` or ``~/.cache/vitlab/arrays``.
        embedded_kwargs: Options of the embedded dataset when ``root`` is None (:class:`EmbeddedOptions` or a
            dict of its fields; typed, so ``--data.embedded_kwargs.patients 24`` reaches it as an int).
        classes: Fix the class names and their order; any other label is an error.
        labels: False: unlabelled images for self-supervised pretraining (``task: dino``): every image under
            ``root`` (any folder structure), or a manifest's ``path`` column (a ``label`` column is ignored).
            All of them train (no labels to validate with: ``val_fraction`` / ``test_fraction`` are unused), unless
            the manifest has a ``split`` column: then only its ``train`` rows do, and its val / test rows are left
            out (test patients stay out of pretraining). Batches are ``(images, labels)`` with label -1; ``num_classes`` is 0.
        sample: ``"image"``: 2-D image files. ``"slice"`` / ``"slab"`` / ``"volume"``: the items of ``root`` are volumes
            (NIfTI files, DICOM series folders, enhanced multi-frame files; see :mod:`vitlab.data.volume_options`) and
            the samples are their slices, their 2.5-D slabs (``2 * slab_radius + 1`` slices as channels: ``in_chans``
            follows) or the whole volumes. ``root`` None -> the embedded synthetic volumes.
        slab_radius: Slices each side of the centre in a slab.
        slice_labels: ``"volume"``: a slice has its volume's label; ``"mask"``: ``present`` when the slice holds at
            least ``min_mask_voxels`` voxels of the volume's label map, else ``absent`` (``classes`` renames them,
            negative first).
        min_mask_voxels: See ``slice_labels`` (a lesion's tip of a few voxels is hard to call in either class).
        intensity: How volume values become model values: ``"window"`` (``window`` / ``window_center`` +
            ``window_width`` on HU; none given: the volume's min-max), ``"percentile"`` (0.5-99.5 percentiles of
            the non-zero voxels to [0, 1], for MRI) or ``"zscore"`` (mean / std of the non-zero voxels).
        volumes_in_memory: Prepared volumes each loader process keeps at once (slices and slabs); the training
            order visits the volumes this many at a time, so each is read once per epoch and process.
        spacing: ``sample: volume``: voxel size in mm (along i, j, k) every volume is resampled to (trilinear); None
            keeps each volume's own.
        volume_size: ``sample: volume``: voxels along i, j, k after a centred crop / pad (a batch stacks volumes of
            one shape); null (only with ``patch_size``) keeps each volume's resampled size, and validation and test
            then take one volume per batch (sliding-window inference, ``model.sliding_window``).
        patch_size: ``sample: volume``: training items are random patches of this many voxels along i, j, k (MONAI's
            ``RandCropByPosNegLabeld``), one per volume and epoch, a function of (seed, epoch, index); validation
            and test keep whole volumes. None: training on whole volumes.
        patch_foreground: With ``patch_size`` and label maps: the probability that a patch is centred on a random
            lesion (foreground) voxel rather than placed uniformly (MONAI's ``pos / (pos + neg)``; default 0.5).
        volume_flip: ``sample: volume``: training volumes or patches (and their label maps) flipped along each of i,
            j, k with probability 0.5, drawn from (seed, epoch, index) as the 2-D augmentations are (whatever the loader
            workers); validation and test volumes are never flipped.
        volume_intensity: ``sample: volume``: random intensity scale and shift of training volumes or patches, e.g.
            ``{scale: 0.1, scale_prob: 0.1, shift: 0.1, shift_prob: 0.5}`` (MONAI's BTCV recipe:
            ``RandScaleIntensityd`` / ``RandShiftIntensityd``): with probability ``scale_prob`` the windowed values are
            multiplied by 1 + u, u uniform in [-scale, scale], and with ``shift_prob`` shifted by v in [-shift, shift];
            keyed by (seed, epoch, index) as the flips. None: no change.
        unlabelled_root: More images without labels that join the training split only (a folder, any nesting, or
            a manifest's ``path`` column; with a ``split`` column only its train rows), for ``task: dino`` on many unlabelled scans while the labelled ``root``
            scores the k-NN (its train split is the memory bank, its val split the queries). Warns when some of them
            belong to labelled val / test patients (their k-NN score would be optimistic).
    """

    def __init__(
        self,
        root: str | None = None,
        image_size: int = 224,
        in_chans: int = 1,
        batch_size: int = 32,
        num_workers: int = 0,
        window: str | None = None,
        window_center: float | None = None,
        window_width: float | None = None,
        window_index: int = 0,
        frames: str | int = "middle",
        val_fraction: float = 0.2,
        test_fraction: float = 0.0,
        seed: int = 0,
        on_bad_file: Literal["skip", "error"] = "skip",
        augment: str = "default",
        train_transforms: A.Compose | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        cache: bool = False,
        cache_dir: str | None = None,
        memory_cache_mb: int = 512,
        embedded_kwargs: EmbeddedOptions | None = None,
        classes: list[str] | None = None,
        labels: bool = True,
        unlabelled_root: str | None = None,
        sample: Literal["image", "slice", "slab", "volume"] = "image",
        slab_radius: int = 1,
        slice_labels: Literal["volume", "mask"] = "volume",
        intensity: Literal["window", "percentile", "zscore"] = "window",
        min_mask_voxels: int = 1,
        volumes_in_memory: int = 4,
        spacing: list[float] | None = None,
        volume_size: list[int] | None = None,
        patch_size: list[int] | None = None,
        patch_foreground: float = 0.5,
        volume_flip: bool = False,
        volume_intensity: dict[str, float] | None = None,
    ) -> None:
        embedded = embedded_options(embedded_kwargs)
        embedded_kwargs = dataclasses.asdict(embedded)  # plain dict in hparams: checkpoints load with weights_only
        # every argument but the user's Compose (an object, no hyperparameter), in the form this class takes it: a run
        # rebuilds its data module from this record alone (it is the LightningDataModule's hparams)
        self.arguments = {k: v for k, v in locals().items() if k not in ("self", "embedded", "train_transforms", "__class__")}
        _check_loading(image_size, batch_size, num_workers, memory_cache_mb, on_bad_file, val_fraction, test_fraction, frames)
        self.read_options = ReadOptions(window, window_center, window_width, window_index, frames)
        self.reader = ImageReader(self.read_options)  # remembers headers from setup's check for the loaders
        options = VolumeOptions(sample, slab_radius, slice_labels, intensity, min_mask_voxels, volumes_in_memory, spacing,
                                volume_size, patch_size, patch_foreground, volume_flip, volume_intensity)  # (checks them all)
        in_chans = options.input_channels(in_chans)
        if options.sample != "image" and unlabelled_root:
            raise ValueError("data.unlabelled_root is not read with data.sample slice / slab / volume; "
                             "give the unlabelled volumes as root with data.labels false")
        self.volume_options = None if options.sample == "image" else options  # None: 2-D image files
        self.volumes = None if self.volume_options is None else VolumeStore(options, self.read_options)  # slices, slabs
        self.memory = MemoryCache(memory_cache_mb * 2**20) if memory_cache_mb else None
        self.mean, self.std = normalization_stats(in_chans, mean, std)
        self.image_size, self.in_chans, self.batch_size = image_size, in_chans, batch_size
        self.num_workers, self.seed, self.on_bad_file = num_workers, seed, on_bad_file
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.augment, self.user_transforms = augment, train_transforms
        self.train_transform = train_transform(  # validates the recipe / the user's Compose now
            image_size, self.mean, self.std, augment=augment, user_transforms=train_transforms, seed=seed
        )
        self.eval_transform = eval_transform(image_size, self.mean, self.std)

        if root is None:
            self.root = (embedded_sets.embedded_dataset if sample == "image" else embedded_sets.embedded_volumes)(**embedded_kwargs)
        else:
            self.root = Path(root).expanduser()
        self.labelled = bool(labels)
        if self.volume_options is None:
            layout = scan(self.root, classes=classes, on_bad_file=on_bad_file, labels=self.labelled)
        else:
            layout = volume_layout(self.root, classes, labelled=self.labelled, slice_labels=options.slice_labels,
                                   on_bad_file=on_bad_file)
        self._layout = layout
        self.unlabelled_root = Path(unlabelled_root).expanduser() if unlabelled_root else None
        self._unlabelled = scan(self.unlabelled_root, on_bad_file=on_bad_file, labels=False) if self.unlabelled_root else None
        self.class_names: list[str] = layout.class_names
        self.num_classes: int = len(layout.class_names)
        self._skipped_at_setup: int = len(layout.skipped or [])
        self.skipped = SkippedFiles()  # files the datasets skip at decode time (indexed by the samples at setup)
        self._samples: list[Sample] | None = None
        self.array_cache = _array_cache(self.root, self.read_options, cache_dir) if cache else None

    def _check(self, samples: list[Sample]) -> tuple[list[Sample], list[str]]:
        """Header-check image files, or read every volume once and expand it into its samples."""
        if self.volume_options is None:
            return check_files(samples, self.on_bad_file, inspect=self.reader.inspect)
        kept, skipped = check_volumes(samples, self.volume_options, self.on_bad_file, needs_mask=self.needs_masks)
        if self.volume_options.slice_labels == "mask":  # absent / present -> the class names chosen
            kept = [replace(s, label=self.class_names[MASK_CLASSES.index(s.label)]) for s in kept]
        return kept, skipped

    needs_masks = False  # (dense tasks: every volume needs its label map)

    # ------------------------------------------------------------------ splits
    def _prepare(self) -> list[Sample]:
        """Header-check the files and assign splits (once)."""
        if self._samples is not None:
            return self._samples
        kept, skipped = self._check(self._layout.samples)
        self._skipped_at_setup = len(self._layout.skipped or []) + len(skipped)
        extra: list[Sample] = []
        if self._unlabelled is not None:
            extra, extra_skipped = self._check(self._unlabelled.samples)
            self._skipped_at_setup += len(self._unlabelled.skipped or []) + len(extra_skipped)
            extra = training_only(extra)
        samples = self._split(kept)
        if extra:
            warn_unlabelled_overlap(self.unlabelled_root, extra, samples)
        self._samples = samples + extra
        self.skipped = SkippedFiles(str(s.path) for s in self._samples)  # (before any loader: workers share it)
        return self._samples

    def _split(self, kept: list[Sample]) -> list[Sample]:
        """The splits of the (labelled, or unlabelled with ``labels=False``) samples of ``root``."""
        if not self.labelled:
            if not kept:
                raise ValueError(f"{self.root}: no readable images after skipping {self.skipped_files} bad file(s)")
            samples = training_only(kept)
            if not samples:
                raise ValueError(f"{self.root}: the manifest's split column puts no readable image in 'train'")
            return samples
        present = sorted({s.label for s in kept})
        if len(present) < 2:
            raise ValueError(
                f"{self.root}: only {len(present)} class(es) {present} have readable images after "
                f"skipping {self.skipped_files} bad file(s); need at least two"
            )
        if self._layout.has_split_column:
            samples = kept
            shared = patient_overlap(samples)
            if shared:
                example = next(iter(shared.items()))
                warnings.warn(
                    f"{self.root}: {len(shared)} patient(s) appear in several splits "
                    f"(e.g. {example[0]!r} in {sorted(example[1])}); validation may be optimistic",
                    stacklevel=2,
                )
        else:
            samples = split_by_patient(
                kept, val_fraction=self.val_fraction, test_fraction=self.test_fraction, seed=self.seed
            )
        missing = [c for c in self.class_names if not any(s.label == c and s.split == "train" for s in samples)]
        if missing:
            warnings.warn(f"{self.root}: class(es) {missing} have no training images", stacklevel=2)
        if not self._layout.has_split_column and self.val_fraction > 0:
            check_validation(self.root, samples, self.val_fraction)
        return samples

    @property
    def skipped_files(self) -> int:
        """Bad files left out: at setup (layout, headers, masks) and at decode time, in this process or its loader
        workers."""
        return self._skipped_at_setup + len(self.bad_paths)

    @property
    def bad_paths(self) -> set[str]:
        """The files skipped at decode time so far, in this process or its loader workers."""
        return self.skipped.found

    def samples(self, split: str) -> list[Sample]:
        """Samples of one split (``"train"``, ``"val"`` or ``"test"``) with their patient ids."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        return [s for s in self._prepare() if s.split == split]

    @property
    def has_labels(self) -> bool:
        """False for unlabelled images (``labels=False``): nothing to classify or validate against."""
        return self.labelled

    @property
    def has_test(self) -> bool:
        """True when a test split exists."""
        return bool(self.samples("test"))

    def split_counts(self) -> dict[str, dict[str, int]]:
        """Images per class in each split, e.g. ``{"train": {"lesion": 115, ...}, ...}``."""
        return {split: dict(Counter(s.label for s in self.samples(split))) for split in SPLITS}

    def batch_sizes_vary(self, ranks: int = 1) -> bool:
        """Whether the training or the validation loader ends an epoch with a smaller batch (a rank's share of its
        split, ``ceil(n / ranks)`` as Lightning's distributed sampler pads it, is not a multiple of ``batch_size``;
        whole volumes go one a batch): a compiled network then sees two batch sizes (see
        :func:`vitlab.models.compile_in_place`)."""
        whole = self.volume_options is not None and self.volume_options.own_size
        return any(-(-len(self.samples(split)) // ranks) % (1 if whole and split == "val" else self.batch_size)
                   for split in ("train", "val"))

    def setup(self, stage: str | None = None) -> None:
        """Check headers and assign splits (once; ``skipped_files`` then counts the files left out)."""
        self._prepare()

    # ------------------------------------------------------------------ datasets and loaders
    def dataset(self, split: str, *, augmented: bool = False, labelled_only: bool = False) -> MedicalImageDataset:
        """Dataset of one split; ``augmented`` applies the training augmentations, else resize only;
        ``labelled_only`` leaves out the unlabelled images (the k-NN memory bank)."""
        if self.volume_options is not None and self.volume_options.sample == "volume":
            return self.volume_dataset(self._chosen(split, labelled_only), augmented)
        return self.image_dataset(split, augmented=augmented, labelled_only=labelled_only)

    def _chosen(self, split: str, labelled_only: bool) -> list[Sample]:
        samples = self.samples(split)
        return [s for s in samples if s.label != UNLABELLED] if labelled_only else samples

    def image_dataset(self, split: str, *, augmented: bool = False, labelled_only: bool = False) -> MedicalImageDataset:
        """``(image, label)`` items of one split's 2-D samples (image files, slices, slabs), whatever the task: a dense
        data module's images without their targets (the probes read them so); arguments as :meth:`dataset`."""
        return MedicalImageDataset(
            self._chosen(split, labelled_only), self.class_names, self.train_transform if augmented else self.eval_transform,
            in_chans=self.in_chans, read_options=self.read_options,
            on_bad_file=self.on_bad_file, cache=self.array_cache, reader=self.reader, prescale_to=self.image_size,
            memory=self.memory, deterministic=not augmented, skipped=self.skipped, volumes=self.volumes,
        )  # fmt: skip

    collate_fn = None  # (the dense data module's batches of targets)

    def batch_collate(self):
        """The loaders' ``collate_fn``: torch's default, or the data's own (:attr:`collate_fn`)."""
        return self.collate_fn

    _normalize_on_device = False
    _device_normalization = None  # (means, reciprocal stds) as float32 arrays, once a loader leaves them to the batch
    _normalization_on: dict = {}  # device -> the same as tensors there

    @property
    def normalize_on_device(self) -> bool:
        """Where the loaders made from now on normalise their batches: False, in their pipelines (in the loader
        workers); True, in :meth:`normalize_batch` where each batch is sent (``train.py`` beside a GPU:
        :class:`vitlab.callbacks.RuntimeCallback` sets it before the loaders are made; the same values, bit for bit).
        Never a hyperparameter: probes reading a run's data get normalised samples. Set False, no batch is
        normalised by :meth:`normalize_batch` any more (the loaders made then normalise their own)."""
        return self._normalize_on_device

    @normalize_on_device.setter
    def normalize_on_device(self, value: bool) -> None:
        self._normalize_on_device = bool(value)
        if not value:
            self._device_normalization = None

    def normalize_batch(self, batch):
        """A batch of a loader whose pipeline left :class:`~vitlab.data.transforms.Normalize` to the batch
        (:attr:`normalize_on_device`), normalised where it is (:func:`~vitlab.data.transforms.normalize_images`): its
        images (the first item) (B, C, S, S). Any other batch is returned as it is."""
        if self._device_normalization is None or not isinstance(batch, (tuple, list)) or not torch.is_tensor(batch[0]):
            return batch
        images = batch[0]
        stats = self._normalization_on.get(images.device)
        if stats is None:  # (moved once per device: a copy from pageable memory would wait for the device each batch)
            stats = tuple(torch.from_numpy(a).to(images.device) for a in self._device_normalization)
            self._normalization_on = {**self._normalization_on, images.device: stats}
        return type(batch)([normalize_images(images, *stats), *batch[1:]])

    def volume_dataset(self, samples: list[Sample], augmented: bool, num_mask_classes: int | None = None) -> VolumeDataset:
        """Whole volumes of ``samples`` (``data.sample: volume``); ``augmented`` (training): random patches when
        ``data.patch_size`` is set, flips with ``data.volume_flip``, intensity jitter with ``data.volume_intensity``."""
        return VolumeDataset(samples, self.class_names, self.volume_options, self.read_options, augmented=augmented,
                             on_bad_file=self.on_bad_file, skipped=self.skipped, num_mask_classes=num_mask_classes)

    def _loader(self, split: str, train: bool) -> DataLoader:
        """Batches of one split; training batches in the order and with the augmentations (seed, epoch, index) give,
        whatever ``num_workers`` (see :mod:`vitlab.data.sampling`)."""
        dataset = self.dataset(split, augmented=train)
        deferred = deferred_normalize(getattr(dataset, "transform", None)) if self.normalize_on_device else None
        if deferred is not None:  # (volumes have no pipeline: normalised as they are read)
            dataset.transform, *stats = deferred
            self._device_normalization = tuple(stats)
        sampler = None
        if train:
            groups = None if self.volumes is None else [(s.path, s.series_uid) for s in dataset.samples]
            block = 0 if self.volumes is None else self.volume_options.volumes_in_memory
            sampler = EpochSampler(len(dataset), self.seed, shuffle=True, groups=groups, block=block)  # (set_epoch: Lightning)
            dataset = KeyedAugmentation(dataset, self.seed)
        workers = self.num_workers
        single_opencv_thread()  # (here, before any worker forks)
        # validation / test volumes of their own sizes: one per batch (sliding-window inference)
        whole = not train and self.volume_options is not None and self.volume_options.own_size
        return (EpochLoader if train else DataLoader)(
            dataset, batch_size=1 if whole else self.batch_size, sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(), worker_init_fn=seed_worker, collate_fn=self.batch_collate(),
            # worker seeds from a generator of the loader's own, not torch's global stream: 0 workers (an iterator
            # per epoch) and persistent workers (one) then leave the same draws for the model's dropout / drop path
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, augmented training batches ``(images (B, C, S, S), labels (B,))``."""
        if not self.samples("train"):
            raise ValueError(f"{self.root}: the training split is empty")
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches; an empty list (no validation) when the split is empty."""
        return self._loader("val", train=False) if self.samples("val") else []

    def test_dataloader(self) -> DataLoader:
        """Test batches; only when a test split exists (see :attr:`has_test`)."""
        if not self.has_test:
            raise ValueError(
                f"{self.root}: no test split; set test_fraction > 0 or add split=test rows to the manifest"
            )
        return self._loader("test", train=False)


def _check_loading(image_size, batch_size, num_workers, memory_cache_mb, on_bad_file, val_fraction, test_fraction,
                  frames) -> None:
    """One line for a loading argument out of its range (the volume arguments: :class:`VolumeOptions`)."""
    for name, value in (("image_size", image_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if isinstance(memory_cache_mb, bool) or not isinstance(memory_cache_mb, int) or memory_cache_mb < 0:
        raise ValueError(f"memory_cache_mb must be an int >= 0 (MiB per process; 0 = off), got {memory_cache_mb!r}")
    if on_bad_file not in ("skip", "error"):
        raise ValueError(f"on_bad_file must be 'skip' or 'error', got {on_bad_file!r}")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must be in [0, 1) "
            "and sum to less than 1"
        )
    if frames == "all":
        raise ValueError("frames='all' gives a volume per file; the DataModule needs 'middle' or a frame index")


def _array_cache(root: Path, read_options: ReadOptions, cache_dir: str | None) -> ArrayCache:
    """The decoded-array cache in ``cache_dir`` (default: the vitlab cache), never inside the data folder."""
    folder = Path(cache_dir).expanduser().resolve() if cache_dir else cache_root() / "arrays"
    data_folder = (root if root.is_dir() else root.parent).resolve()
    if folder.resolve().is_relative_to(data_folder):
        raise ValueError(f"cache_dir {folder} is inside the data folder {data_folder}; vitlab never writes there")
    return ArrayCache(folder, repr(dataclasses.astuple(read_options)))
