"""Dense targets (detection, segmentation): label-map masks beside the images, instances and boxes.

A mask is one label map per image (PNG or TIFF, same height and width as the image): 0 is background,
value ``i`` is ``mask_classes[i - 1]``. Where the masks are:

* manifest: a ``mask`` column beside ``path`` (relative to the manifest's folder);
* class folders: a parallel tree ``root/masks/<class>/<same relative path>.png`` (or ``.tif``);
* COCO instances JSON (:func:`~vitlab.data.boxes.scan_coco`): polygons / RLE per annotation, rasterised into label maps.

Instances for detection are the connected components of each class (``scipy.ndimage.label``),
unless the manifest has a ``boxes`` column (:func:`parse_boxes`): a non-empty cell lists the image's boxes,
whose instance masks are the mask's pixels of the box's class inside the box, or the filled box when the
row has no mask (an empty cell: the mask's components, or no object without a mask). Boxes are computed
after augmentation from the moved instance masks (user boxes: from the moved filled boxes), so a box always
follows its object and an instance that leaves the crop is dropped. An image without instances is a valid
negative (boxes of shape (0, 4)).
"""

from __future__ import annotations

from collections.abc import Sequence

import albumentations as A
import numpy as np
import torch

from vitlab.data.boxes import box_masks, parse_boxes
from vitlab.data.datasets.images import MedicalImageDataset, finite_tensor, integer_downscale, to_channels
from vitlab.data.layouts import Sample, skip_or_raise
from vitlab.data.masks import MaskError, boxes_of, instances, read_mask


def check_masks(samples: Sequence[Sample], num_classes: int, on_bad_file: str = "skip",
                mask_classes: Sequence[str] | None = None) -> tuple[list[Sample], list[str]]:
    """Read every mask and ``boxes`` cell once (missing file, label values, malformed boxes); returns the usable
    samples and one message per drop."""
    kept, skipped = [], []
    classes = list(mask_classes or [str(i) for i in range(1, num_classes + 1)])
    for sample in samples:
        if sample.slice is not None:  # a volume's label map was read and checked with the volume
            kept.append(sample)
            continue
        try:
            if sample.boxes:
                parse_boxes(sample, classes)
            if sample.mask is not None or sample.boxes is None:  # a boxes column makes the mask optional
                read_mask(sample, num_classes)
        except MaskError as error:
            skip_or_raise(error, on_bad_file, skipped)
            continue
        kept.append(sample)
    return kept, skipped


class DenseDataset(MedicalImageDataset):
    """Images with their masks, moved together by the albumentations pipeline.

    Items are ``(image (C, S, S), target)`` with target ``mask`` (S, S) int64 (semantic label map),
    ``boxes`` (N, 4) float32 (x0, y0, x1, y1 in pixels), ``labels`` (N,) int64 (1-based class) and
    ``masks`` (N, S, S) uint8 (one per instance). A pair whose mask does not fit its image fails with a
    one-line :class:`MaskError` under ``on_bad_file="error"``, else it is warned about and skipped.

    Args:
        num_mask_classes: Foreground classes in the masks.
        Other arguments: as :class:`~vitlab.data.datasets.images.MedicalImageDataset`.
    """

    def __init__(self, samples: Sequence[Sample], class_names: Sequence[str], transform: A.Compose, *,
                 num_mask_classes: int = 1, mask_classes: Sequence[str] | None = None, **kwargs) -> None:
        super().__init__(samples, class_names, transform, **kwargs)
        self.num_mask_classes = num_mask_classes
        self.mask_classes = list(mask_classes or [str(i) for i in range(1, num_mask_classes + 1)])

    def _pair(self, index: int) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, list[int]] | None]:
        """Image (H, W, C), label map (None for a boxes-only row) and the row's boxes (None: from the mask)."""
        sample = self.samples[index]
        image = self.load_array(index)
        mask = None
        if sample.slice is not None:  # a slice / slab of a volume: the label map resliced with it
            mask = self.volumes.mask(sample, self.num_mask_classes)
        elif sample.mask is not None or sample.boxes is None:
            mask = read_mask(sample, self.num_mask_classes)
            if mask.shape != image.shape[:2]:
                raise MaskError(f"mask {sample.mask} of image {sample.path}: size {mask.shape[1]}x{mask.shape[0]} "
                                f"differs from the image's {image.shape[1]}x{image.shape[0]}")
        boxes = parse_boxes(sample, self.mask_classes, image.shape[:2]) if sample.boxes else None
        return image, mask, boxes

    def _kept_pair(self, index: int) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, list[int]] | None]:
        """:meth:`_pair` through the memory cache (decoded pairs; copies: a transform may change them)."""
        if self.memory is None:
            return self._pair(index)
        key = ("pair", self.samples[index].key)
        kept = self.memory.get(key)
        if kept is None:
            kept = self._pair(index)
            self.memory.put(key, kept, kept[0].nbytes + (0 if kept[1] is None else kept[1].nbytes))
        image, mask, user = kept
        return image.copy(), None if mask is None else mask.copy(), user

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.first_good(index, self._item, "image/mask pairs")[0]

    def _item(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sample ``index`` as ``(image (C, S, S), target)``; raises for a bad pair or a non-finite image tensor."""
        image, mask, user = self._kept_pair(index)
        image = to_channels(image, self.in_chans, self.keep_gray)  # (H, W, C or 1)
        boxes, user_labels = user if user is not None else (None, [])
        if self.prescale_to:
            factor_image = integer_downscale(image, self.prescale_to, self.in_chans)
            if factor_image.shape[:2] != image.shape[:2]:  # nearest for labels: every k-th pixel
                k = image.shape[0] // factor_image.shape[0]
                mask = None if mask is None else mask[: factor_image.shape[0] * k : k, : factor_image.shape[1] * k : k]
                boxes = None if boxes is None else boxes / k
            image = factor_image
        rects: list[np.ndarray] = []
        if boxes is not None:  # the row's boxes: instance = the mask's class pixels in the box (no mask: the box)
            rects, labels = box_masks(boxes, image.shape[:2]), user_labels
            inst = rects if mask is None else [r * (mask == c) for r, c in zip(rects, labels)]
        elif mask is not None:
            inst, labels = instances(mask, self.num_mask_classes)
        else:
            inst, labels = [], []  # an empty boxes cell and no mask: a negative
        if mask is None:  # a boxes-only row: the label map paints the boxes (later boxes win)
            mask = np.zeros(image.shape[:2], dtype=np.int64)
            for r, c in zip(rects, labels):
                mask[r.astype(bool)] = c
        out = self.transform(image=image, mask=mask, masks=[*inst, *rects] or [np.zeros_like(mask, dtype=np.uint8)])
        moved = [np.asarray(m, dtype=np.uint8) for m in out["masks"]]
        outline = moved[len(inst) :] if rects else moved[: len(inst)]  # what the boxes are measured on
        moved = moved[: len(inst)]
        keep = [i for i, m in enumerate(outline) if m.any()]  # an instance that left the crop is dropped
        picture = out["image"] if out["image"].ndim == 3 else out["image"][:, :, None]
        size = picture.shape[:2]
        target = {
            "mask": torch.from_numpy(np.asarray(out["mask"], dtype=np.int64)),  # (S, S)
            "boxes": torch.from_numpy(boxes_of([outline[i] for i in keep])).reshape(-1, 4),  # (N, 4)
            "labels": torch.tensor([labels[i] for i in keep], dtype=torch.int64),  # (N,)
            "masks": torch.from_numpy(np.stack([moved[i] for i in keep]) if keep
                                      else np.zeros((0, *size), dtype=np.uint8)),  # (N, S, S)
        }
        tensor = torch.from_numpy(np.ascontiguousarray(picture.transpose(2, 0, 1), dtype=np.float32))  # (C, S, S)
        return finite_tensor(self.samples[index].path, tensor), target


def dense_collate(batch: list, narrow_label_maps: bool = False) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Stack the images (B, C, S, S); keep the targets as a list (their instance counts differ).

    In a loader worker the list is a :class:`PackedTargets`: it reaches the training process as the same list of
    dicts, sent as a few tensors instead of four per image (with ``narrow_label_maps``, their label maps as uint8)."""
    images, targets = zip(*batch)
    if torch.utils.data.get_worker_info() is None:
        return torch.stack(images), list(targets)
    packed = PackedTargets(targets)
    packed.narrow_label_maps = narrow_label_maps
    return torch.stack(images), packed


class PackedTargets(list):
    """A batch's list of target dicts that a loader worker sends to the training process as one flat tensor per key
    (and dtype), unpickled there as a plain list of the same dicts, their tensors views into those.

    A worker sends each tensor of a batch through its own shared-memory segment, whose file descriptor the training
    process then fetches over a socket (torch's default sharing strategy), in Python that mostly holds the
    interpreter's lock (in the pin-memory thread beside a GPU, where the training thread needs the lock at every
    launch). With four target tensors an image, taking a batch of 16 cost the training process 5.5-7.4 ms of CPU,
    against 1.7-2.1 ms packed (``benchmarks/bench_loader_batches.py --task dense``). The values are the same, bit for
    bit; a value that is not a tensor, or a key whose tensors differ in dtype, is sent as it is.

    With ``narrow_label_maps`` (set by :func:`dense_collate` for batches on their way to a GPU), the semantic label
    maps (``mask``, int64) travel as uint8 when every label fits (up to 255 classes): an eighth of their bytes to
    share, pin and copy to the GPU (a SwinUNETR batch of two 96^3 patches: 8.8 instead of 21.2 MB with its images).
    They arrive as uint8, and the data module widens them back to int64 on the device (:func:`widen_label_maps`,
    Lightning's ``on_after_batch_transfer``): the same values. Not on the CPU, where widening them again in the
    training process (a new int64 tensor) would cost more than the bytes save."""

    narrow_label_maps = False

    def __reduce__(self):
        keys = list(dict.fromkeys(k for target in self for k in target))
        packed, plain = {}, {}
        for key in keys:
            values = [target.get(key) for target in self]
            tensors = [v for v in values if torch.is_tensor(v)]
            if len(tensors) == len(values) and len({t.dtype for t in tensors}) == 1:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                if self.narrow_label_maps and key == "mask" and flat.dtype == torch.int64 and flat.numel():
                    low, high = torch.aminmax(flat)
                    if low >= 0 and high <= 255:
                        flat = flat.to(torch.uint8)
                packed[key] = (flat, [tuple(t.shape) for t in tensors])
            else:  # (with whether each dict has the key)
                plain[key] = [(key in target, value) for target, value in zip(self, values)]
        return _unpack_targets, (len(self), keys, packed, plain)


def widen_label_maps(targets):
    """A batch's target dicts with their label maps (``mask``) as int64, the dtype the datasets make: those sent
    narrow by :class:`PackedTargets` (uint8) widened where they are, the rest as they are."""
    if not isinstance(targets, (list, tuple)) or not any(isinstance(t, dict) and torch.is_tensor(t.get("mask"))
                                                          and t["mask"].dtype == torch.uint8 for t in targets):
        return targets
    return [{**t, "mask": t["mask"].long()} if torch.is_tensor(t.get("mask")) and t["mask"].dtype == torch.uint8 else t
            for t in targets]


def _unpack_targets(count: int, keys: list, packed: dict, plain: dict) -> list[dict]:
    """:class:`PackedTargets`' list of dicts again (tensors: views of the flat tensors, in the order of the keys)."""
    targets: list[dict] = [{} for _ in range(count)]
    for key in keys:
        if key in packed:
            flat, shapes = packed[key]
            sizes = [int(np.prod(shape)) for shape in shapes]
            for target, part, shape in zip(targets, flat.split(sizes), shapes):
                target[key] = part.view(shape)
        else:
            for target, (present, value) in zip(targets, plain[key]):
                if present:
                    target[key] = value
    return targets
