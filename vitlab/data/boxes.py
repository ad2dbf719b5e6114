"""Boxes: a manifest's ``boxes`` column, filled box masks, and COCO instances JSON rasterised into label maps."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from vitlab.data.cache import cache_root
from vitlab.data.layouts import Sample

from vitlab.data.masks import MASK_SUFFIXES, MaskError  # noqa: F401


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
