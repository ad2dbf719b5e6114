"""Label maps beside the images and volumes: reading and checking them (2-D masks, volume label maps on their
image's grid), and the instances and boxes in a 2-D mask."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from vitlab.data.layouts import Sample
from vitlab.data.readers.errors import ImageReadError, VolumeError
from vitlab.data.readers.image import image_kind
from vitlab.data.readers.nifti import is_nifti
from vitlab.data.readers.volume import read_volume

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


def read_label_map(sample: Sample, image_shape: tuple, image_affine: np.ndarray) -> np.ndarray:
    """The volume label map of ``sample`` as uint8 (I, J, K), checked against its image's grid.

    Raises:
        VolumeError: A DICOM SEG, a shape or affine that differs from the image's (both said), or values that are
            not labels (negative or not whole numbers).
    """
    where = f"mask {sample.mask} of {sample.path}"
    if sample.mask.is_file() and image_kind(sample.mask) == "dicom" and not is_nifti(sample.mask):
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


def within_classes(sample: Sample, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``labels`` (int64) when every value is 0..``num_classes``, else a one-line :class:`MaskError` naming them."""
    if labels.max(initial=0) > num_classes:
        extra = sorted(set(np.unique(labels).tolist()) - set(range(num_classes + 1)))
        raise MaskError(f"mask {sample.mask} of {sample.path}: label value(s) {extra} not in the classes "
                        f"(0 = background, 1-{num_classes})")
    return labels
