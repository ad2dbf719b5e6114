"""Benchmark: peak RSS and wall time of ``probe.py mi`` on ViT-B/16 (random weights), this tree against the baseline.

Goals: peak RSS <= 2.5 GB at N = 2000 images, and wall time <= 0.5x today's at N = 600.
Each run is a fresh ``python probe.py mi --model vit_base_patch16_224 --images DIR --num-images N`` process
(224 px synthetic PNGs, random weights, no downloads); its peak RSS is the child's ``ru_maxrss`` (os.wait4).
The baseline ("before") is the same command in the pre-fix code: by default ``git archive 598c802`` (the tree
the issue measured: all images and all channels in memory, fp32 forward) extracted into a temporary folder;
``--reference-tree DIR`` runs another checkout instead. The runs alternate (before, this tree) per N, and the
MI curves of the two runs (same images, same channel draws) are compared: with the bf16 forward (``--precision
auto`` on a CPU with native bf16) the largest |mi_same / mi_cross difference| is printed beside the ratio.

On a shared machine the full-size runs take long: ``--num-images 48 144`` runs two small sizes and
``--extrapolate 600 2000`` fits RSS = a + b N and time = a + b N per tree through them and prints the fitted
figures at the sizes asked for, marked as extrapolated (RSS: every array that grows is N x something, so
linear; time: the forward is linear, the rank-based estimators N log N, so a line is an approximation).
The batch size changes between small N (one batch of N < 64 images) and N >= 64, which bends such a line: keep
both sizes >= 64 (or read the fit with care). ``--estimation-phase 2000`` also runs the probe's estimation phase
alone at that N on random neurons of ViT-B/16's shapes (``_mi_estimation_phase.py``): in the new code the
recording phase holds one batch and writes the neurons to a file, so its peak does not grow with N, and the
peak of a run at N is the larger of the recording-phase peak (any N >= 64) and the estimation-phase peak at N.
``--also-fp32`` adds this tree with ``--precision fp32`` (same MI as the baseline), ``--forward-only`` the bare
forward alone in fp32 and bf16 (what no change to the probe itself can go below).
Run: ``python benchmarks/bench_probe_memory.py [--num-images 600] [--estimation-phase 2000] [--also-fp32] [--forward-only]``.
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


BASELINE_COMMIT = "598c802"  # the last commit before probe.py mi streamed its images


def baseline_tree(commit: str, folder: Path) -> Path:
    """The pre-fix code, ``git archive COMMIT``, extracted into ``folder``."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def mi_difference(out_before: Path, out_after: Path) -> tuple[float, float, int]:
    """Largest |after - before| of mi_same and of mi_cross over the rows of two mi.csv files, and the row count."""
    import csv

    rows = []
    for out in (out_before, out_after):
        with open(out / "mi.csv") as handle:
            rows.append({(r["layer"], r["sublayer"], r["distance"]): r for r in csv.DictReader(handle)})
    if set(rows[0]) != set(rows[1]):
        raise SystemExit("mi.csv of the two trees have different rows")
    diffs = {col: np.array([abs(float(rows[1][k][col]) - float(rows[0][k][col])) for k in rows[0]]) for col in ("mi_same", "mi_cross")}
    return float(np.nanmax(diffs["mi_same"])), float(np.nanmax(diffs["mi_cross"])), len(rows[0])


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


def forward_child(count: int, precision: str) -> None:
    """(Child process) the bare forward of ViT-B/16 over ``count`` images in the probe's batches of 64; prints seconds."""
    import torch

    from vitlab import models

    model = models.build_model("vit_base_patch16_224", 2, in_chans=3).eval()
    x = torch.randn(64, 3, 224, 224)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for first in range(0, count, 64):
            model(x[: min(64, count - first)])
    print(time.perf_counter() - start)


def time_forward(count: int, precision: str, threads: int) -> float:
    """Seconds of :func:`forward_child` in a fresh process (the same threads as the probe runs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--forward-child", str(count), precision], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--forward-child":
        return forward_child(int(sys.argv[2]), sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, nargs="+", default=[600, 2000])
    parser.add_argument("--reference-tree", type=Path, default=None, help="the checkout to compare with (default: git archive of --baseline-commit)")
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT, help=f"pre-fix commit run as the baseline (default {BASELINE_COMMIT}); 'none': no baseline")
    parser.add_argument("--extrapolate", type=int, nargs="*", default=[], help="also print linear fits at these N (needs two --num-images)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the probe processes (default 1: a shared machine)")
    parser.add_argument("--extra", default="", help="more probe.py mi options, e.g. '--blocks 0 11'")
    parser.add_argument("--extra-after", default="", help="probe.py mi options for this tree only, e.g. '--precision fp32'")
    parser.add_argument("--also-fp32", action="store_true", help="also run this tree with --precision fp32 (the fp32 path's own ratio)")
    parser.add_argument("--forward-only", action="store_true", help="also time the bare forward alone (fp32 and bf16) at each N")
    parser.add_argument("--estimation-phase", type=int, nargs="*", default=[], help="N at which to measure this tree's estimation phase alone")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-memory-"))
    images = make_images(tmp / "images", max(args.num_images))
    if args.reference_tree:
        reference = args.reference_tree.resolve()
    elif args.baseline_commit != "none":
        reference = baseline_tree(args.baseline_commit, tmp / "baseline")
        print(f"before = git archive {args.baseline_commit} (pre-fix baseline); after = {ROOT}", flush=True)
    else:
        reference = None
    trees = {**({"before": reference} if reference else {}), "after": ROOT, **({"after-fp32": ROOT} if args.also_fp32 else {})}
    results: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in trees}
    try:
        for count in args.num_images:
            for name, tree in trees.items():
                extra = args.extra.split() + (args.extra_after.split() if name == "after" else ["--precision", "fp32"] if name == "after-fp32" else [])
                results[name][count] = run_mi(tree, images, count, tmp / f"out-{name}-{count}", args.threads, extra)
                took, rss = results[name][count]
                print(f"measured  {name:<6s} N = {count:5d}: {took:7.1f} s   peak RSS {rss:5.2f} GB", flush=True)
            if args.forward_only:
                for precision in ("fp32", "bf16"):
                    took = time_forward(count, precision, args.threads)
                    share = f" = {took / results['before'][count][0]:.2f}x the baseline's whole run" if reference else ""
                    print(f"measured  bare ViT-B/16 forward alone, {precision}, N = {count:5d}: {took:7.1f} s{share}", flush=True)
            if reference:
                same, cross, rows = mi_difference(tmp / f"out-before-{count}", tmp / f"out-after-{count}")
                print(f"MI after vs before, N = {count:5d}: max |diff| mi_same {same:.4f} nats, mi_cross {cross:.4f} nats over {rows} rows", flush=True)
                if args.also_fp32:
                    same, cross, rows = mi_difference(tmp / f"out-before-{count}", tmp / f"out-after-fp32-{count}")
                    print(f"MI after-fp32 vs before, N = {count:5d}: max |diff| mi_same {same:.2e} nats, mi_cross {cross:.2e} nats over {rows} rows", flush=True)
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
            for name in [t for t in trees if t != "before"]:
                (tb, rb), (ta, ra) = results["before"][count], results[name][count]
                print(f"N = {count:5d} ({how(count)}): time {name} / before = {ta / tb:.2f}x   peak RSS {rb:.2f} GB -> {ra:.2f} GB")
    for count in sizes:
        ta, ra = results["after"][count]
        if count == 2000:
            print(f"goal peak RSS <= 2.5 GB at N = 2000 ({how(count)}): {'met' if ra <= 2.5 else 'NOT met'} ({ra:.2f} GB)")
        if count == 600 and "before" in results:
            ratio = ta / results["before"][count][0]
            print(f"goal time <= 0.5x at N = 600 ({how(count)}): {'met' if ratio <= 0.5 else 'NOT met'} "
                  f"(after {ta:.1f} s, before {results['before'][count][0]:.1f} s: {ratio:.2f}x)")


if __name__ == "__main__":
    main()
