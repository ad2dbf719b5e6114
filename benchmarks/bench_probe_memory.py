"""Benchmark: peak RSS and wall time of ``probe.py mi`` on ViT-B/16 (random weights), this tree against another.

Goals (issue 12 §7): peak RSS <= 2.5 GB at N = 2000 images, and wall time <= 0.5x today's at N = 600.
Each run is a fresh ``python probe.py mi --model vit_base_patch16_224 --images DIR --num-images N`` process
(224 px synthetic PNGs, random weights, no downloads); its peak RSS is the child's ``ru_maxrss`` (os.wait4).
``--reference-tree DIR`` runs the same command in another checkout, e.g. the code before the change:
``mkdir /tmp/old && git archive 598c802 | tar -x -C /tmp/old``. The runs alternate (reference, this tree) per N.

On a shared machine the full-size runs take long: ``--num-images 48 144`` runs two small sizes and
``--extrapolate 600 2000`` fits RSS = a + b N and time = a + b N per tree through them and prints the fitted
figures at the sizes asked for, marked as extrapolated (RSS: every array that grows is N x something, so
linear; time: the forward is linear, the rank-based estimators N log N, so a line is an approximation).
The batch size changes between small N (one batch of N < 64 images) and N >= 64, which bends such a line: keep
both sizes >= 64 (or read the fit with care). ``--estimation-phase 2000`` also runs the probe's estimation phase
alone at that N on random neurons of ViT-B/16's shapes (``_mi_estimation_phase.py``): in the new code the
recording phase holds one batch and writes the neurons to a file, so its peak does not grow with N, and the
peak of a run at N is the larger of the recording-phase peak (any N >= 64) and the estimation-phase peak at N.
Run: ``python benchmarks/bench_probe_memory.py --reference-tree /tmp/old [--num-images 600 2000] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_images(folder: Path, count: int, size: int = 224) -> Path:
    """``count`` smooth random greyscale PNGs (low-resolution noise, bicubic upsampled) in ``folder``."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = (rng.random((14, 14)) * 255).astype(np.uint8)
        Image.fromarray(small).resize((size, size), Image.BICUBIC).save(folder / f"img{i:05d}.png")
    return folder


def run_mi(tree: Path, images: Path, count: int, out: Path, threads: int, extra: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of one ``probe.py mi`` process run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "probe.py", "mi", "--model", "vit_base_patch16_224", "--images", str(images), "--num-images", str(count),
           "--out", str(out), "--overwrite", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{stderr[-3000:]}")
    return took, usage.ru_maxrss / 1024**2  # KB -> GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, nargs="+", default=[600, 2000])
    parser.add_argument("--reference-tree", type=Path, default=None, help="the checkout to compare with (the code before the change)")
    parser.add_argument("--extrapolate", type=int, nargs="*", default=[], help="also print linear fits at these N (needs two --num-images)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the probe processes (default 1: a shared machine)")
    parser.add_argument("--extra", default="", help="more probe.py mi options, e.g. '--blocks 0 11'")
    parser.add_argument("--estimation-phase", type=int, nargs="*", default=[], help="N at which to measure this tree's estimation phase alone")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-memory-"))
    images = make_images(tmp / "images", max(args.num_images))
    trees = {**({"before": args.reference_tree.resolve()} if args.reference_tree else {}), "after": ROOT}
    results: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in trees}
    try:
        for count in args.num_images:
            for name, tree in trees.items():
                results[name][count] = run_mi(tree, images, count, tmp / f"out-{name}", args.threads, args.extra.split())
                took, rss = results[name][count]
                print(f"measured  {name:<6s} N = {count:5d}: {took:7.1f} s   peak RSS {rss:5.2f} GB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fits = {}
    if args.extrapolate and len(args.num_images) >= 2:
        n = np.array(args.num_images, dtype=float)
        for name in trees:
            t = np.array([results[name][c][0] for c in args.num_images])
            r = np.array([results[name][c][1] for c in args.num_images])
            fits[name] = (np.polyfit(n, t, 1), np.polyfit(n, r, 1))
            print(f"fit       {name:<6s}: time {fits[name][0][1]:.1f} s + {fits[name][0][0]:.3f} s/image;  RSS {fits[name][1][1]:.2f} GB + {fits[name][1][0] * 1024:.3f} MB/image")
        for count in args.extrapolate:
            for name in trees:
                (tb, ta), (rb, ra) = fits[name]
                results[name].setdefault(count, (ta + tb * count, ra + rb * count))
                print(f"extrapolated {name:<6s} N = {count:5d}: {ta + tb * count:7.1f} s   peak RSS {ra + rb * count:5.2f} GB")
    for count in args.estimation_phase:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "_mi_estimation_phase.py"), str(count), str(tmp / "phase")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        shutil.rmtree(tmp, ignore_errors=True)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit("_mi_estimation_phase.py failed")
        phase = usage.ru_maxrss / 1024**2
        recording = max(rss for c, (_, rss) in results["after"].items() if c >= 64 and c in args.num_images) if any(c >= 64 for c in args.num_images) else float("nan")
        print(f"measured  after  estimation phase alone, N = {count}: {time.perf_counter() - start:.1f} s, peak RSS {phase:.2f} GB; "
              f"recording-phase peak (a run at N >= 64) {recording:.2f} GB -> peak of a run at N = {count}: {max(phase, recording):.2f} GB (composite)")
    sizes = sorted(set(args.num_images) | set(args.extrapolate))
    how = lambda c: "measured" if c in args.num_images else "extrapolated"  # noqa: E731
    if "before" in results:
        for count in sizes:
            (tb, rb), (ta, ra) = results["before"][count], results["after"][count]
            print(f"N = {count:5d} ({how(count)}): time after / before = {ta / tb:.2f}x   peak RSS {rb:.2f} GB -> {ra:.2f} GB")
    for count in sizes:
        ta, ra = results["after"][count]
        if count == 2000:
            print(f"goal peak RSS <= 2.5 GB at N = 2000 ({how(count)}): {'met' if ra <= 2.5 else 'NOT met'} ({ra:.2f} GB)")
        if count == 600 and "before" in results:
            ratio = ta / results["before"][count][0]
            print(f"goal time <= 0.5x at N = 600 ({how(count)}): {'met' if ratio <= 0.5 else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
