"""Tiny generated files for the data tests: a PNG with planted squares and its mask, a manifest CSV."""

from __future__ import annotations

import csv

import numpy as np
from PIL import Image

from vitlab.data.layouts import Sample


def planted(tmp_path, name, squares, size=48, mask_size=None, value=1):
    """A PNG image with bright squares (y0, x0, side) and its label map."""
    image = np.full((size, size), 20, np.uint8)
    mask = np.zeros((mask_size or size,) * 2, np.uint8)
    for y0, x0, side in squares:
        image[y0 : y0 + side, x0 : x0 + side] = 230
        mask[y0 : y0 + side, x0 : x0 + side] = value
    Image.fromarray(image).save(tmp_path / f"{name}.png")
    Image.fromarray(mask).save(tmp_path / f"{name}_mask.png")
    return Sample(tmp_path / f"{name}.png", "a", "p", "train", tmp_path / f"{name}_mask.png")



def write_manifest(path, rows, header=("path", "label", "patient_id", "mask")):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path
