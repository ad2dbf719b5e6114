"""Benchmark: low-rank qk_spectra against dense per-head eigvalsh on ViT-B/16 shapes.

Target: qk_spectra for 12 blocks x 12 heads (C = 768, hd = 64) >= 20x faster than a dense float64
``eigvalsh`` of each head's C x C symmetric part S = (M + M^T)/2, with the same values.
The per-head path is timed (``summed=False``); the head-summed spectra (one dense C x C problem per block,
no low-rank form exists) are timed and printed separately.
Run: ``python benchmarks/bench_spectra.py [--threads N] [--dense-blocks K]``.
"""

from __future__ import annotations

import argparse

import torch

from vitlab.analysis.spectra import qk_spectra
from _timing import best_of  # benchmarks/_timing.py



def dense_sym_eigvals(wq: torch.Tensor, wk: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The dense reference: per head, form M_h and S in float64 and take all C eigenvalues."""
    hd = wq.shape[0] // heads
    out = []
    for h in range(heads):
        m = wq[h * hd : (h + 1) * hd].double().T @ wk[h * hd : (h + 1) * hd].double()  # (C, C)
        out.append(torch.linalg.eigvalsh(0.5 * (m + m.T)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense-blocks", type=int, default=12, help="blocks timed densely (rest extrapolated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks, heads, width = 12, 12, 768
    hd = width // heads
    weights = [tuple(torch.randn(width, width, generator=g) * 0.02 for _ in range(2)) for _ in range(blocks)]

    t_low = t_summed = t_dense = 0.0
    max_rel = 0.0
    for b, (wq, wk) in enumerate(weights):
        dt, spec = best_of(lambda: qk_spectra(wq, wk, heads, summed=False), args.repeats)
        t_low += dt
        t_summed += best_of(lambda: qk_spectra(wq, wk, heads, summed=True), 1)[0]
        if b < args.dense_blocks:
            dt, dense = best_of(lambda: dense_sym_eigvals(wq, wk, heads), 1)
            t_dense += dt
            for h, eig in enumerate(dense):
                nonzero = eig[eig.abs().argsort(descending=True)[: 2 * hd]].sort(descending=True).values
                max_rel = max(max_rel, ((spec.sym_eigvals[h] - nonzero).abs().max() / nonzero.abs().max()).item())
    t_dense_all = t_dense * blocks / args.dense_blocks
    note = "" if args.dense_blocks == blocks else f" (timed on {args.dense_blocks} blocks, extrapolated)"
    print(f"{blocks} blocks x {heads} heads, C = {width}, hd = {hd}; {args.threads} thread(s)")
    print(f"  dense eigvalsh per head (S only) {t_dense_all * 1e3:9.1f} ms{note}")
    print(f"  qk_spectra per head (S, A, svd)  {t_low * 1e3:9.1f} ms   speed-up {t_dense_all / t_low:5.1f}x "
          "(target >= 20x)")
    print(f"  qk_spectra incl. head-summed     {t_summed * 1e3:9.1f} ms   speed-up {t_dense_all / t_summed:5.1f}x")
    print(f"  max relative difference of S's nonzero eigenvalues (to the largest |lambda|): {max_rel:.2e}")


if __name__ == "__main__":
    main()
