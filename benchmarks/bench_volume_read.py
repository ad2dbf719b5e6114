"""Volume reading: vitlab's ``read_volume`` against the bare libraries on the same files, side by side in one run.

1. A 512 x 512 x 200 int16 CT series (200 single-frame files, written in shuffled order): ``read_volume(folder)``
   against bare pydicom (``dcmread`` every file, ``pixel_array * slope + intercept``, stack in position order).
   Goal: vitlab >= 0.8x bare pydicom's speed.
2. The same volume as ``.nii.gz``: ``read_volume(path)`` against ``nibabel.load(path).get_fdata(dtype=float32)``.
   Goal: >= 0.9x.

Speed ratio = bare time / vitlab time (> 1: vitlab is faster). Times are the fastest of interleaved repeats,
after one warm-up read of each (the files are then in the page cache for both readers alike); wall and CPU
time are both printed (CPU time moves less with other jobs on a shared machine).

    python benchmarks/bench_volume_read.py [--size 512] [--slices 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nibabel
import numpy as np
import pydicom

from vitlab.data import read_volume
from vitlab.data.readers.volume import LPS_TO_RAS
from vitlab.data.synthetic.phantom import INTERCEPT_HU
from vitlab.data.synthetic.volumes import write_nifti, write_series


def ct_like(size: int, slices: int, seed: int = 0) -> np.ndarray:
    """(size, size, slices) int16 stored values: air around an elliptic body of soft tissue with noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size - 0.5
    body = (x / 0.42) ** 2 + (y / 0.32) ** 2 < 1  # (size, size)
    hu = np.where(body[..., None], 40.0, -1000.0) + rng.normal(0, 12, (size, size, slices))
    return np.rint(hu - INTERCEPT_HU).astype(np.int16)


def bare_pydicom(folder: Path) -> np.ndarray:
    """What a script without vitlab does: read every file, rescale, sort by position along the normal, stack."""
    datasets = [pydicom.dcmread(path) for path in folder.iterdir()]
    orientation = np.array(datasets[0].ImageOrientationPatient, dtype=float)
    normal = np.cross(orientation[:3], orientation[3:])
    datasets.sort(key=lambda ds: float(np.dot(np.array(ds.ImagePositionPatient, dtype=float), normal)))
    slices = [ds.pixel_array.astype(np.float32) * float(ds.RescaleSlope) + float(ds.RescaleIntercept) for ds in datasets]
    return np.stack(slices, axis=-1)  # (rows, columns, slices)


def bare_nibabel(path: Path) -> np.ndarray:
    return nibabel.load(path).get_fdata(dtype=np.float32)


def fastest(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """Fastest wall and CPU time of each function over ``repeats`` interleaved rounds, after one warm-up round.

    Both readers run on one thread, so CPU time is the figure that other jobs on a shared machine disturb least.
    """
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--slices", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-volume-") as tmp:
        folder, nifti = Path(tmp) / "series", Path(tmp) / "volume.nii.gz"
        stored = ct_like(args.size, args.slices)
        affine = np.diag([0.7, 0.7, 2.5, 1.0])
        start = time.perf_counter()
        write_series(folder, stored, affine)
        write_nifti(nifti, stored, LPS_TO_RAS @ affine, (1.0, INTERCEPT_HU))
        print(f"wrote {args.size}x{args.size}x{args.slices} int16 as a DICOM series and .nii.gz "
              f"in {time.perf_counter() - start:.1f} s")  # fmt: skip
        ours, bare = read_volume(folder).array, bare_pydicom(folder)
        assert np.array_equal(ours, bare.transpose(1, 0, 2)), "read_volume and bare pydicom disagree"
        assert np.array_equal(read_volume(nifti).array, bare_nibabel(nifti)), "read_volume and nibabel disagree"
        for label, fns, goal in (
            ("DICOM series", {"vitlab": lambda: read_volume(folder), "bare": lambda: bare_pydicom(folder)}, 0.8),
            (".nii.gz", {"vitlab": lambda: read_volume(nifti), "bare": lambda: bare_nibabel(nifti)}, 0.9),
        ):
            best = fastest(fns, args.repeats)
            (ours_wall, ours_cpu), (bare_wall, bare_cpu) = best["vitlab"], best["bare"]
            ratio = bare_wall / ours_wall
            verdict = "meets" if ratio >= goal else "MISSES"
            print(f"{label:12s} wall: vitlab {ours_wall:.3f} s, bare {bare_wall:.3f} s, speed ratio {ratio:.2f}x "
                  f"({verdict} the goal >= {goal}x); CPU: vitlab {ours_cpu:.3f} s, bare {bare_cpu:.3f} s, "
                  f"ratio {bare_cpu / ours_cpu:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
