"""Slab sampling from volumes against slice sampling of 2-D files, on the same data, side by side in one run.

The synthetic CT patients of :func:`vitlab.data.synthetic.volumes.generate_volumes` are written as NIfTI volumes
and as DICOM series (one 2-D file per slice). One training epoch (augmentation ``light``, loader in this process,
no memory cache, so every epoch decodes) is timed for:

1. 2-D files: every slice file of the series as its own image (``data.sample: image``) - the baseline;
2. slices of the NIfTI volumes (``data.sample: slice``);
3. slabs of 5 slices of the NIfTI volumes (``data.sample: slab``, ``slab_radius: 2``);
4. slabs of 5 slices of the DICOM series.

Printed: samples/s, the ratio to the baseline (> 1: faster), volumes decoded per epoch and the most volumes held
at once by the store (``data.volumes_in_memory``). Times are the fastest of ``--repeats`` interleaved epochs.

    python benchmarks/bench_volume_samples.py [--patients 16] [--size 256] [--slices 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

from vitlab.data.image_data import ImageData
from vitlab.data.synthetic import generate_volumes


def slice_manifest(root: Path) -> Path:
    """A manifest of every 2-D slice file of the DICOM series, with the patient's label and id."""
    rows = []
    for row in csv.DictReader(open(root / "manifest_dicom.csv")):
        for path in sorted((root / row["path"]).iterdir()):
            rows.append((str(path), row["label"], row["patient_id"]))
    out = root / "manifest_slices.csv"
    with open(out, "w", newline="") as f:
        csv.writer(f).writerows([("path", "label", "patient_id"), *rows])
    return out


def epoch_time(data: ImageData) -> tuple[float, int]:
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in data.train_dataloader())
    return time.perf_counter() - start, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patients", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--slices", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = generate_volumes(Path(tmp) / "v", patients=args.patients, size=args.size, slices=args.slices, seed=0)
        common = dict(image_size=224, window="soft_tissue", augment="light", memory_cache_mb=0, val_fraction=0.25, batch_size=32)
        runs = {
            "2-D slice files": ImageData(str(slice_manifest(manifest.parent)), **common),
            "NIfTI slices": ImageData(str(manifest), sample="slice", **common),
            "NIfTI slabs (5 slices)": ImageData(str(manifest), sample="slab", slab_radius=2, **common),
            "DICOM-series slabs (5)": ImageData(str(manifest.parent / "manifest_dicom.csv"), sample="slab", slab_radius=2, **common),
        }
        best = {name: float("inf") for name in runs}
        counts = {}
        for data in runs.values():
            data.setup()
        for _ in range(args.repeats):
            for name, data in runs.items():
                seconds, counts[name] = epoch_time(data)
                best[name] = min(best[name], seconds)
        base = counts["2-D slice files"] / best["2-D slice files"]
        print(f"{args.patients} patients of {args.size} x {args.size} x {args.slices} voxels; one training epoch, fastest of {args.repeats}")
        for name, data in runs.items():
            rate = counts[name] / best[name]
            store = data.volumes
            held = "" if store is None else (f"  volumes read {store.decodes // args.repeats}/epoch, at most {store.most_held} held "
                                             f"(volumes_in_memory {store.capacity})")
            print(f"  {name:24s} {rate:8.1f} samples/s  {rate / base:5.2f}x the 2-D files{held}")


if __name__ == "__main__":
    main()
