"""Detection and segmentation data: images + label-map masks (see :mod:`vitlab.data.datasets.targets`), without Lightning."""

from __future__ import annotations

import functools

from vitlab.data.image_data import ImageData
from vitlab.data.boxes import scan_coco
from vitlab.data.datasets.targets import DenseDataset, check_masks, dense_collate
from vitlab.data.layouts import Sample


class DenseImageData(ImageData):
    """:class:`~vitlab.data.datamodule.ImageData` whose batches carry masks, boxes and instances.

    Batches are ``(images (B, C, S, S), targets)`` with one dict per image (see
    :class:`~vitlab.data.datasets.targets.DenseDataset`). The split is the classifier's (patient-grouped, stratified
    by the ``label`` column), so a detector and a classifier on the same data see the same patients.

    Args:
        mask_classes: Foreground class names; mask value ``i`` is ``mask_classes[i - 1]``.
        coco_json: A COCO instances JSON (third layout): its images and categories replace ``root``
            (masks are rasterised into ``coco_mask_dir``, default the vitlab cache) and ``mask_classes``.
        coco_mask_dir: Where the rasterised COCO masks and their manifest are written.
        Other arguments: as :class:`~vitlab.data.MedicalDataModule` (``root`` None -> the embedded
            synthetic set, whose manifest has a ``mask`` column with the lesion outlines).
    """

    def __init__(self, *args, mask_classes: list[str] | None = None, coco_json: str | None = None,
                 coco_mask_dir: str | None = None, **kwargs) -> None:
        if kwargs.get("labels") is False or kwargs.get("unlabelled_root"):
            raise ValueError("data.labels false / data.unlabelled_root (unlabelled images) are for self-supervised pretraining "
                             "(task: dino); detection and segmentation learn from masks or boxes")
        if coco_json is not None:
            manifest, mask_classes = scan_coco(coco_json, mask_dir=coco_mask_dir)
            kwargs["root"] = str(manifest)
        super().__init__(*args, **kwargs)
        self.mask_classes = list(mask_classes or ["lesion"])
        if not self.mask_classes:
            raise ValueError("mask_classes must name at least one foreground class")
        self.num_mask_classes = len(self.mask_classes)
        self.collate_fn = dense_collate
        self.arguments.update(mask_classes=self.mask_classes, coco_json=coco_json, coco_mask_dir=coco_mask_dir)

    needs_masks = True  # (volumes: each needs its label map)

    narrow_label_maps = False
    """Whether the loaders made from now on send their batches' label maps from the workers as uint8
    (:class:`~vitlab.data.datasets.targets.PackedTargets`), widened to int64 again on the device: ``train.py`` beside a
    GPU (:class:`vitlab.callbacks.RuntimeCallback` sets it before the loaders are made). Never a hyperparameter."""

    def batch_collate(self):
        if self.narrow_label_maps and self.collate_fn is dense_collate:
            return functools.partial(dense_collate, narrow_label_maps=True)
        return self.collate_fn

    def _prepare(self) -> list[Sample]:
        if self._samples is not None:
            return self._samples
        samples = super()._prepare()
        if self.volume_options is not None:  # the label maps were read and checked with their volumes
            return samples
        kept, skipped = check_masks(samples, self.num_mask_classes, self.on_bad_file, self.mask_classes)
        self._skipped_at_setup += len(skipped)
        self._samples = kept
        return kept

    def dataset(self, split: str, *, augmented: bool = False) -> DenseDataset:
        """Image + mask dataset of one split; ``augmented`` moves the masks with the image. Whole volumes
        (``sample: volume``): their label maps on the resampled grid (:class:`~vitlab.data.datasets.volumes.VolumeDataset`)."""
        if self.volume_options is not None and self.volume_options.sample == "volume":
            return self.volume_dataset(self.samples(split), augmented, self.num_mask_classes)
        return DenseDataset(
            self.samples(split), self.class_names, self.train_transform if augmented else self.eval_transform,
            num_mask_classes=self.num_mask_classes, mask_classes=self.mask_classes, in_chans=self.in_chans, read_options=self.read_options,
            on_bad_file=self.on_bad_file, cache=self.array_cache, reader=self.reader, prescale_to=self.image_size,
            memory=self.memory, skipped=self.skipped, volumes=self.volumes,
        )  # fmt: skip
