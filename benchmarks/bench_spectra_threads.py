"""Benchmark: the QK spectra of a ViT-B/16 epoch where the Q/K/V worker solves them, before and now.

Beside a GPU the QKSpectra callback's eigenproblems (12 blocks: 144 heads' 128 x 128 problems and 12 dense
768 x 768 head-summed ones, float64) run on the Q/K/V worker's background thread. Measured side by side in one
process with the same torch thread count (``--threads``, default: every core, at most 4 as ``runtime: auto``
beside a GPU), ``block_spectra`` of the same random weights, in this order:

1. ``training thread``: in the process's first thread, LAPACK on torch's threads (the reference);
2. ``worker now``: in a background thread set to one thread (:func:`vitlab.solver_pool.one_thread`) that hands the
   problems to a :class:`vitlab.solver_pool.SolverPool` of as many single-threaded workers; then the training
   thread again;
3. ``worker before``: in a plain background thread, LAPACK on torch's threads (the worker until now); then the
   training thread again: from here on a second team of threads exists, and its numbers show what that does to
   the training thread.

Target: the worker now takes <= 1/2 of the time it took before on a machine of 2+ cores, with figures (the
antisymmetric parts' eigenvalues too) and without, and leaves the training thread's time as it was.
Run: ``python benchmarks/bench_spectra_threads.py [--threads N] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vitlab.runtime import prepare_process  # noqa: E402

prepare_process()  # (OpenMP's spin policy, as in train.py: before torch)

import torch  # noqa: E402

from vitlab.analysis.spectra import block_spectra  # noqa: E402
from vitlab.solver_pool import SolverPool, one_thread  # noqa: E402
from _timing import best_of  # noqa: E402  benchmarks/_timing.py


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=min(4, cores))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks, heads, width = 12, 12, 768
    state = {f"blocks.{b}.{m}.weight": torch.randn(width, width, generator=g) / width ** 0.5 for b in range(blocks) for m in "qkv"}
    counts = {f"blocks.{b}": heads for b in range(blocks)}
    before = ThreadPoolExecutor(1, thread_name_prefix="qkv-before")  # (a plain background thread)
    now = ThreadPoolExecutor(1, thread_name_prefix="qkv-now", initializer=one_thread)  # (as the Q/K/V worker's now)
    pool = SolverPool(args.threads)
    print(f"ViT-B/16 QK spectra ({blocks} blocks x {heads} heads, C = {width}, float64), torch threads = {args.threads}, "
          f"{cores} core(s), best of {args.repeats}")

    def solve(figures: bool, executor=None):
        return block_spectra(state, counts, out_device="cpu", antisymmetric=figures, executor=executor)

    rows = {figures: {} for figures in (False, True)}
    for step in ("training thread", "worker now", "training thread after it", "worker before", "training thread after it "):
        for figures, row in rows.items():
            if step.startswith("training"):
                row[step] = best_of(lambda: solve(figures), args.repeats)[0]
            else:
                executor = now if step == "worker now" else before
                row[step] = executor.submit(best_of, lambda: solve(figures, pool if step == "worker now" else None), args.repeats).result()[0]
    for figures, row in rows.items():
        label = "with figures (antisymmetric parts too)" if figures else "without figures"
        times = ", ".join(f"{step.strip()} {seconds:.3f} s" for step, seconds in row.items())
        print(f"  {label}: {times}")
        print(f"    worker now = {row['worker before'] / row['worker now']:.2f}x faster than before (target >= 2x on 2+ cores); "
              f"the training thread after it {row['training thread after it'] / row['training thread']:.2f}x its time before "
              f"(target 1x), after the worker before {row['training thread after it '] / row['training thread']:.2f}x")
    pool.shutdown()
    now.shutdown()
    before.shutdown()

if __name__ == "__main__":
    main()
