"""Benchmark: vectorised Gaussian-copula MI vs distance against sklearn's KSG on the same pairs.

Workload (Philip et al.'s MI at ViT-B/16 scale): N = 2000 images, 196 tokens (14 x 14), 64 channels all used as
centres: 64 x 196 same-channel pairs. Target: >= 100x faster than sklearn ``mutual_info_regression``.
sklearn is timed on a subset of centre channels and extrapolated linearly (it costs ~10 ms per pair, the
full set would take minutes). Activations are a planted Gaussian field (corr exp(-d / 2) between tokens,
squared-exponential so the dependence is non-trivial), stored in fp16 as the callers do.
Run: ``python benchmarks/bench_mi.py [--threads N] [--sklearn-channels K]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from vitlab.analysis.mi import gaussian_copula_mi, ksg_mi, mi_vs_distance
from _timing import best_of  # benchmarks/_timing.py


def planted_acts(n: int, side: int, channels: int, g: torch.Generator) -> torch.Tensor:
    pos = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    chol = torch.linalg.cholesky(torch.exp(-torch.cdist(pos.double(), pos.double()) / 2.0))  # (T, T)
    field = torch.randn(n, channels, side * side, generator=g, dtype=torch.float64) @ chol.T  # (N, C, T)
    return field.transpose(1, 2).contiguous().half()  # (N, T, C)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sklearn-channels", type=int, default=2, help="centre channels timed with sklearn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, side, channels = 2000, 14, 64
    tokens = side * side
    acts = planted_acts(n, side, channels, torch.Generator().manual_seed(0))
    t0 = (side // 2) * side + side // 2

    t_same, _ = best_of(lambda: mi_vs_distance(acts, (side, side), channels, cross_channels=0), args.repeats)
    t_full, _ = best_of(lambda: mi_vs_distance(acts, (side, side), channels, cross_channels=16), args.repeats)

    sub = range(args.sklearn_channels)
    start = time.perf_counter()
    ksg = torch.cat([ksg_mi(acts[:, t0, c], acts[:, :, c]) for c in sub])  # (K' * T,)
    t_sklearn_sub = time.perf_counter() - start
    t_sklearn = t_sklearn_sub * channels / args.sklearn_channels
    copula = torch.cat([gaussian_copula_mi(acts[:, t0, c], acts[:, :, c]) for c in sub])
    keep = torch.arange(ksg.numel()) % tokens != t0  # the centre paired with itself is infinite for the copula

    print(f"N = {n}, {tokens} tokens x {channels} centre channels = {channels * tokens} same-channel pairs; "
          f"{args.threads} thread(s)")
    print(f"  sklearn mutual_info_regression (KSG k=3) {t_sklearn:9.2f} s  "
          f"(timed on {args.sklearn_channels * tokens} pairs: {t_sklearn_sub:.2f} s, extrapolated linearly)")
    print(f"  mi_vs_distance, same-channel only        {t_same:9.3f} s  speed-up {t_sklearn / t_same:7.1f}x "
          "(target >= 100x)")
    print(f"  mi_vs_distance, + 16 cross channels      {t_full:9.3f} s  speed-up {t_sklearn / t_full:7.1f}x "
          f"(does {1 + 16 / 1:.0f}x the pairs)")
    diff = (copula[keep] - ksg[keep]).abs()
    print(f"  copula vs KSG on the timed pairs: mean |diff| {diff.mean():.4f} nats, max {diff.max():.4f} "
          f"(mean MI {ksg[keep].mean():.4f})")


if __name__ == "__main__":
    main()
