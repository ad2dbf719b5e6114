"""Dense targets (detection, segmentation): label-map masks beside the images, instances and boxes.

A mask is one label map per image (PNG or TIFF, same height and width as the image): 0 is background,
value ``i`` is ``mask_classes[i - 1]``. Where the masks are:

* manifest: a ``mask`` column beside ``path`` (relative to the manifest's folder);
* class folders: a parallel tree ``root/masks/<class>/<same relative path>.png`` (or ``.tif``);
* COCO instances JSON (:func:`scan_coco`): polygons / RLE per annotation, rasterised into label maps.

Instances for detection are the connected components of each class (``scipy.ndimage.label``),
unless the manifest has a ``boxes`` column (:func:`parse_boxes`): a non-empty cell lists the image's boxes,
whose instance masks are the mask's pixels of the box's class inside the box, or the filled box when the
row has no mask (an empty cell: the mask's components, or no object without a mask). Boxes are computed
after augmentation from the moved instance masks (user boxes: from the moved filled boxes), so a box always
follows its object and an instance that leaves the crop is dropped. An image without instances is a valid
negative (boxes of shape (0, 4)).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import albumentations as A
import numpy as np
import torch
from PIL import Image
from scipy import ndimage

from vitlab.data.cache import cache_root
from vitlab.data.dataset import MedicalImageDataset, integer_downscale, to_channels
from vitlab.data.io import ImageReadError
from vitlab.data.layouts import Sample, SkippedFileWarning, skip_or_raise

MASK_SUFFIXES = (".png", ".tif", ".tiff")


class MaskError(ImageReadError):
    """A mask that does not fit its image (missing, wrong size, label value outside the classes)."""


def read_mask(sample: Sample, num_classes: int) -> np.ndarray:
    """The label map of ``sample`` as int64 (H, W), checked against ``num_classes`` foreground classes.

    Raises:
        MaskError: No mask, a missing / unreadable file, a colour mask or a value > ``num_classes``;
            the message names the image and the mask.
    """
    if sample.mask is None:
        raise MaskError(f"image {sample.path} has no mask (add a 'mask' column / a masks/ tree)")
    where = f"mask {sample.mask} of image {sample.path}"
    if not Path(sample.mask).is_file():
        raise MaskError(f"{where}: mask file does not exist")
    if _is_dicom(sample.mask):
        raise MaskError(f"{where}: DICOM (SEG) masks are not read; export the segmentation as a PNG / TIFF label map "
                        "(0 = background, 1..K = classes), e.g. with highdicom's Segmentation.get_pixels_by_source_frame")
    try:
        with Image.open(sample.mask) as img:
            mask = np.asarray(img)
    except OSError as err:
        raise MaskError(f"{where}: cannot read it ({err})") from None
    if mask.ndim != 2:
        raise MaskError(f"{where}: shape {mask.shape}; a mask is a single-channel label map (H, W)")
    mask = mask.astype(np.int64)
    bad = np.unique(mask[(mask < 0) | (mask > num_classes)])
    if bad.size:
        raise MaskError(f"{where}: label value(s) {bad.tolist()} not in the classes (0 = background, 1-{num_classes})")
    return mask


def _is_dicom(path) -> bool:
    """A DICOM file by its extension or its 'DICM' marker after the 128-byte preamble."""
    if str(path).lower().endswith(".dcm"):
        return True
    with open(path, "rb") as handle:
        head = handle.read(132)
    return len(head) == 132 and head[128:] == b"DICM"


BOX_FORMAT = "'x0 y0 x1 y1 label' in pixels (x1, y1 = edges after the last column / row), boxes separated by ';'"


def parse_boxes(sample: Sample, mask_classes: Sequence[str],
                size: tuple[int, int] | None = None) -> tuple[np.ndarray, list[int]]:
    """The ``boxes`` cell of ``sample`` -> boxes (N, 4) float32 ``x0, y0, x1, y1`` and 1-based class ids.

    Each box is ``x0 y0 x1 y1 label`` in the image's pixels (``label`` a name of ``mask_classes`` or its number
    1..K); boxes are separated by ``;``. With ``size`` = (height, width) the boxes must lie inside the image.

    Raises:
        MaskError: A malformed box, x1 <= x0 or y1 <= y0, an unknown label or a box outside the image; the message
            names the image, the box and what would be valid.
    """
    boxes, labels = [], []
    items = [item.strip() for item in (sample.boxes or "").split(";") if item.strip()]
    for number, item in enumerate(items, start=1):
        where = f"boxes of image {sample.path}: box {number} {item!r}"
        fields = item.split()
        try:
            x0, y0, x1, y1 = (float(v) for v in fields[:4])
        except ValueError:
            raise MaskError(f"{where}: coordinates are not numbers; expected {BOX_FORMAT}") from None
        if len(fields) != 5 or not np.isfinite([x0, y0, x1, y1]).all():
            raise MaskError(f"{where}: expected {BOX_FORMAT}")
        if x1 <= x0 or y1 <= y0:
            raise MaskError(f"{where}: needs x0 < x1 and y0 < y1 ({BOX_FORMAT})")
        label = fields[4]
        if label in mask_classes:
            labels.append(list(mask_classes).index(label) + 1)
        elif label.isdigit() and 1 <= int(label) <= len(mask_classes):
            labels.append(int(label))
        else:
            raise MaskError(f"{where}: label {label!r} is not a class: use one of {list(mask_classes)} "
                            f"or its number 1-{len(mask_classes)}")
        if size is not None and (x0 < 0 or y0 < 0 or x1 > size[1] or y1 > size[0]):
            raise MaskError(f"{where}: outside the {size[1]}x{size[0]} image (0 <= x0 < x1 <= {size[1]}, "
                            f"0 <= y0 < y1 <= {size[0]})")
        boxes.append((x0, y0, x1, y1))
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4), labels


def box_masks(boxes: np.ndarray, size: tuple[int, int]) -> list[np.ndarray]:
    """Filled boxes as uint8 (H, W) masks; fractional edges are rounded outward."""
    out = []
    for x0, y0, x1, y1 in boxes:
        m = np.zeros(size, dtype=np.uint8)
        m[int(np.floor(y0)) : int(np.ceil(y1)), int(np.floor(x0)) : int(np.ceil(x1))] = 1
        out.append(m)
    return out


def check_masks(samples: Sequence[Sample], num_classes: int, on_bad_file: str = "skip",
                mask_classes: Sequence[str] | None = None) -> tuple[list[Sample], list[str]]:
    """Read every mask and ``boxes`` cell once (missing file, label values, malformed boxes); returns the usable
    samples and one message per drop."""
    kept, skipped = [], []
    classes = list(mask_classes or [str(i) for i in range(1, num_classes + 1)])
    for sample in samples:
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


def instances(mask: np.ndarray, num_classes: int) -> tuple[list[np.ndarray], list[int]]:
    """Connected components of each class: instance masks (H, W) uint8 and their class ids (1-based)."""
    masks, labels = [], []
    for cls in range(1, num_classes + 1):
        components, count = ndimage.label(mask == cls)
        for i in range(1, count + 1):
            masks.append((components == i).astype(np.uint8))
            labels.append(cls)
    return masks, labels


def boxes_of(masks: Sequence[np.ndarray]) -> np.ndarray:
    """Tight boxes (N, 4) float32 ``x0, y0, x1, y1`` (pixel edges: x1 = last column + 1) of non-empty masks."""
    boxes = np.zeros((len(masks), 4), dtype=np.float32)
    for i, m in enumerate(masks):
        ys, xs = np.nonzero(m)
        boxes[i] = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    return boxes


class DenseDataset(MedicalImageDataset):
    """Images with their masks, moved together by the albumentations pipeline.

    Items are ``(image (C, S, S), target)`` with target ``mask`` (S, S) int64 (semantic label map),
    ``boxes`` (N, 4) float32 (x0, y0, x1, y1 in pixels), ``labels`` (N,) int64 (1-based class) and
    ``masks`` (N, S, S) uint8 (one per instance). A pair whose mask does not fit its image fails with a
    one-line :class:`MaskError` under ``on_bad_file="error"``, else it is warned about and skipped.

    Args:
        num_mask_classes: Foreground classes in the masks.
        Other arguments: as :class:`~vitlab.data.dataset.MedicalImageDataset`.
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
        if sample.mask is not None or sample.boxes is None:
            mask = read_mask(sample, self.num_mask_classes)
            if mask.shape != image.shape[:2]:
                raise MaskError(f"mask {sample.mask} of image {sample.path}: size {mask.shape[1]}x{mask.shape[0]} "
                                f"differs from the image's {image.shape[1]}x{image.shape[0]}")
        boxes = parse_boxes(sample, self.mask_classes, image.shape[:2]) if sample.boxes else None
        return image, mask, boxes

    def _first_pair(self, index: int) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, list[int]] | None]:
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            try:
                return self._pair(candidate)
            except (ImageReadError, OSError) as error:
                if self.on_bad_file == "error":
                    raise
                path = str(self.samples[candidate].path)
                if path not in self.bad_paths:
                    self.bad_paths.add(path)
                    warnings.warn(f"skipping bad file: {error}", SkippedFileWarning, stacklevel=2)
        raise RuntimeError(f"none of the {len(self)} image/mask pairs could be read (see the warnings above)")

    def _kept_pair(self, index: int) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, list[int]] | None]:
        """:meth:`_first_pair` through the memory cache (decoded pairs; copies: a transform may change them)."""
        if self.memory is None:
            return self._first_pair(index)
        key = ("pair", str(self.samples[index].path))
        kept = self.memory.get(key)
        if kept is None:
            kept = self._first_pair(index)
            self.memory.put(key, kept, kept[0].nbytes + (0 if kept[1] is None else kept[1].nbytes))
        image, mask, user = kept
        return image.copy(), None if mask is None else mask.copy(), user

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image, mask, user = self._kept_pair(index)
        image = to_channels(image, self.in_chans)  # (H, W, C)
        boxes, user_labels = user if user is not None else (None, [])
        if self.prescale_to:
            factor_image = integer_downscale(image, self.prescale_to)
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
        return tensor, target


def dense_collate(batch: list) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Stack the images (B, C, S, S); keep the targets as a list (their instance counts differ)."""
    images, targets = zip(*batch)
    return torch.stack(images), list(targets)


def scan_coco(annotation_file: str | os.PathLike, image_root: str | os.PathLike | None = None,
              mask_dir: str | os.PathLike | None = None) -> tuple[Path, list[str]]:
    """Turn a COCO instances JSON into a vitlab manifest with rasterised label-map masks.

    Each image's annotations (polygons or RLE, via pycocotools) are painted into one label map
    (value = position of the category in the JSON's ``categories`` list + 1; later annotations win
    where they overlap) and written as PNG into ``mask_dir`` (default: the vitlab cache folder); the manifest's ``label`` column is
    ``<category>`` of the image's first annotation or ``background`` for an image without any.

    Returns:
        The manifest path (in ``mask_dir``) and the category names (the mask classes).

    Raises:
        ValueError: A file that is not a COCO instances JSON, or an annotation naming an unknown
            image / category (naming both).
    """
    from pycocotools import mask as mask_utils

    annotation_file = Path(annotation_file)
    try:
        coco = json.loads(annotation_file.read_text())
        images, annotations, categories = coco["images"], coco.get("annotations", []), coco["categories"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{annotation_file}: not a COCO instances JSON ({type(err).__name__}: {err})") from None
    image_root = Path(image_root) if image_root is not None else annotation_file.parent
    if mask_dir is None:  # never write into the user's data folder: the cache, keyed by the JSON's path and content
        key = hashlib.sha256(str(annotation_file.resolve()).encode() + annotation_file.read_bytes()).hexdigest()[:12]
        mask_dir = cache_root() / f"coco-{key}"
    mask_dir = Path(mask_dir)
    mask_dir.mkdir(parents=True, exist_ok=True)
    class_of = {c["id"]: i + 1 for i, c in enumerate(categories)}
    names = [c["name"] for c in categories]
    by_image: dict = {img["id"]: [] for img in images}
    for ann in annotations:
        if ann.get("image_id") not in by_image:
            raise ValueError(f"{annotation_file}: annotation {ann.get('id')} names unknown image_id {ann.get('image_id')}")
        if ann.get("category_id") not in class_of:
            raise ValueError(f"{annotation_file}: annotation {ann.get('id')} has category_id {ann.get('category_id')} "
                             f"not in categories {sorted(class_of)}")
        by_image[ann["image_id"]].append(ann)
    rows = [("path", "label", "mask")]
    for img in images:
        h, w = int(img["height"]), int(img["width"])
        label_map = np.zeros((h, w), dtype=np.uint8)
        for ann in by_image[img["id"]]:
            seg = ann["segmentation"]
            if isinstance(seg, list):
                rle = mask_utils.merge(mask_utils.frPyObjects(seg, h, w))
            elif isinstance(seg.get("counts"), list):
                rle = mask_utils.frPyObjects(seg, h, w)
            else:
                rle = seg
            label_map[mask_utils.decode(rle).astype(bool)] = class_of[ann["category_id"]]
        out = mask_dir / (Path(img["file_name"]).with_suffix("").as_posix().replace("/", "__") + ".png")
        Image.fromarray(label_map).save(out)
        first = by_image[img["id"]][0]["category_id"] if by_image[img["id"]] else None
        label = names[class_of[first] - 1] if first is not None else "background"
        rows.append((str((image_root / img["file_name"]).resolve()), label, out.name))
    manifest = mask_dir / "manifest.csv"
    with open(manifest, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return manifest, names
