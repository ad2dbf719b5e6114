"""Benchmark: row_drift over ViT-B/16-sized Q/K/V against cloning the same tensors.

Target: row_drift on 12 blocks x (Q, K, V) of 768 x 768 (float32 ref and cur) takes <= 3x the time of
cloning those tensors (both snapshots). Run: ``python benchmarks/bench_drift.py [--threads N]``.
"""

from __future__ import annotations

import argparse

import torch

from vitlab.analysis.drift import matrix_drift, row_drift
from _timing import best_of  # benchmarks/_timing.py



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks, width = 12, 768
    refs = [torch.randn(width, width, generator=g) * 0.02 for _ in range(blocks * 3)]
    curs = [r + 1e-4 * torch.randn(width, width, generator=g) for r in refs]

    t_clone, _ = best_of(lambda: [(r.clone(), c.clone()) for r, c in zip(refs, curs)], args.repeats)
    t_rows, _ = best_of(lambda: [row_drift(r, c) for r, c in zip(refs, curs)], args.repeats)
    t_matrix, _ = best_of(lambda: [matrix_drift(r, c) for r, c in zip(refs, curs)], args.repeats)
    print(f"{blocks} blocks x Q/K/V of {width}x{width} float32, {args.threads} thread(s), best of {args.repeats}")
    print(f"  clone ref+cur      {t_clone * 1e3:8.2f} ms")
    print(f"  row_drift          {t_rows * 1e3:8.2f} ms   ratio to clone {t_rows / t_clone:5.2f}x (target <= 3x)")
    print(f"  matrix_drift       {t_matrix * 1e3:8.2f} ms   ratio to clone {t_matrix / t_clone:5.2f}x")


if __name__ == "__main__":
    main()
