"""Ranks, Gaussian-copula normal scores and equal-frequency bins of many columns at once.

The MI estimators of :mod:`vitlab.analysis.mi` rank every column of an activation table (thousands of
neurons x N images). ``torch.sort`` on CPU costs ~100 ns per element, so on CPU the columns are sorted by
an LSD radix sort over 16-bit digits of order-preserving integer keys of the raw floats (numpy's stable
argsort is a radix sort for 16-bit integers): one pass for fp16 storage, two for fp32. On GPU
``torch.sort`` is used. Ties (frequent in fp16) share their average rank, as ``scipy.stats.rankdata``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["average_ranks", "copula_normalize", "equal_frequency_bins", "column_scores"]

_CHUNK_ELEMENTS = 1 << 22  # columns are processed in blocks of about this many elements (bounded memory)


def _radix_argsort(block: Tensor) -> Tensor:
    """Stable argsort of every row of a (c, N) CPU float block, by LSD radix sort on 16-bit digits."""
    values = block if block.dtype in (torch.float16, torch.float32, torch.float64) else block.float()
    arr = values.numpy()  # -0 sorts just before +0: adjacent, so the tie detection still merges them
    bits = arr.dtype.itemsize * 8
    signed = arr.view(f"int{bits}")
    # Flip the magnitude bits of negatives: the integers now order like the floats; then shift to unsigned.
    keys = (signed ^ ((signed >> (bits - 1)) & np.iinfo(signed.dtype).max)).view(f"uint{bits}")
    keys = keys ^ np.array(1 << (bits - 1), dtype=keys.dtype)
    order = None
    for shift in range(0, bits, 16):  # least significant digit first; each pass is stable
        digit = ((keys >> np.array(shift, dtype=keys.dtype)) & np.array(0xFFFF, dtype=keys.dtype)).astype(np.uint16)
        step = np.argsort(digit, axis=-1, kind="stable")
        order = step if order is None else np.take_along_axis(order, step, -1)
        if shift + 16 < bits:
            keys = np.take_along_axis(keys, step, -1)
    return torch.from_numpy(order)


def _twice_ranks(block: Tensor) -> tuple[Tensor, Tensor]:
    """Twice the average rank (integers 2..2N) of every entry of a (c, N) block, in sorted order.

    Returns (twice_rank_sorted (c, N) int32 (int64 for huge blocks), order (c, N) int64) with
    sorted[:, i] = block[:, order[:, i]].
    """
    cols, n = block.shape
    if block.device.type == "cpu":
        order = _radix_argsort(block)
    else:
        order = torch.sort(block, dim=-1, stable=True).indices
    sorted_vals = block.gather(-1, order)  # (c, N)
    # NaN and +-inf sort to the ends of a row (the radix keys put -NaN first, +NaN last): check only those.
    if not bool(torch.isfinite(sorted_vals[:, [0, -1]]).all()):
        raise ValueError("samples contain NaN or inf; drop or impute them first")
    starts = torch.ones(cols, n, dtype=torch.bool, device=block.device)  # first entry of each run of equals
    torch.ne(sorted_vals[:, 1:], sorted_vals[:, :-1], out=starts[:, 1:])
    # int32 and in-place ops where possible: these arrays are as large as the block
    idx = torch.int32 if 2 * cols * n + 2 < 2**31 else torch.int64
    if bool(starts.all()):  # no ties
        return (2 * torch.arange(1, n + 1, dtype=idx, device=block.device)).expand(cols, n), order
    # Runs of equal values, numbered over the flattened block (every row starts a new run).
    run = starts.reshape(-1).cumsum(0, dtype=idx).sub_(1)  # (c*N,) run of every entry
    length = torch.bincount(run).to(idx)  # (R,)
    first = length.cumsum(0, dtype=idx).sub_(length)  # (R,) flat position of each run's first entry
    # twice the average 1-based rank, (first + 1) + (first + length), then made relative to the row start
    twice = first.mul_(2).add_(length).add_(1).index_select(0, run).reshape(cols, n)
    row_start = torch.arange(cols, dtype=idx, device=block.device).unsqueeze(1) * (2 * n)  # (c, 1)
    return twice.sub_(row_start), order


def _map_columns(
    x: Tensor, dim: int, chunk: int | None, fn: Callable[[Tensor, Tensor], None], out_dtype: torch.dtype
) -> Tensor:
    """Run ``fn(block, out_block)`` on every (c, N) block of columns along ``dim``; returns (cols, N)."""
    if x.ndim == 0 or x.shape[dim] < 1:
        raise ValueError(f"need samples along dim {dim}, got shape {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"need real-valued samples, got dtype {x.dtype}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1 column, got {chunk}")
    if not x.is_floating_point():
        x = x.to(torch.float32)
    moved = x.detach().movedim(dim, -1)  # (..., N)
    n = moved.shape[-1]
    flat = moved.reshape(-1, n)  # (cols, N): one row per column of x
    step = chunk if chunk is not None else max(1, _CHUNK_ELEMENTS // n)
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    for start in range(0, flat.shape[0], step):
        block = flat[start : start + step].contiguous()  # (c, N)
        fn(block, out[start : start + step])
    return out


def _score_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _restore(flat: Tensor, x: Tensor, dim: int) -> Tensor:
    """(cols, N) back to ``x``'s shape with the samples along ``dim``."""
    return flat.reshape(x.movedim(dim, -1).shape).movedim(-1, dim)


def average_ranks(x: Tensor, dim: int = 0, chunk: int | None = None) -> Tensor:
    """Ranks 1..N along ``dim``; ties get their average rank (as ``scipy.stats.rankdata``).

    Args:
        x: samples along ``dim``; any real dtype.
        dim: sample dimension.
        chunk: columns processed at once (default: about 4M elements per block).

    Returns:
        Same shape as ``x``, float32 (float64 for float64 input).
    """
    dtype = _score_dtype(x)

    def fn(block: Tensor, out: Tensor) -> None:
        twice, order = _twice_ranks(block)
        out.scatter_(-1, order, twice.to(dtype) / 2)

    return _restore(_map_columns(x, dim, chunk, fn, dtype), x, dim)


def column_scores(x: Tensor, dim: int = 0, chunk: int | None = None) -> Tensor:
    """Gaussian-copula normal scores of every column, laid out (cols, N): one row per column of ``x``."""
    dtype = _score_dtype(x)
    n = x.shape[dim] if x.ndim else 0
    # Average ranks are half-integers r = k/2: tabulate Phi^-1(k / (2(N+1))) once, then gather.
    table = torch.special.ndtri(torch.arange(2 * n + 2, dtype=torch.float64) / (2 * (n + 1))).to(dtype).to(x.device)

    def fn(block: Tensor, out: Tensor) -> None:
        twice, order = _twice_ranks(block)
        out.scatter_(-1, order, table.index_select(0, twice.reshape(-1)).reshape(twice.shape))

    return _map_columns(x, dim, chunk, fn, dtype)


def copula_normalize(x: Tensor, dim: int = 0, chunk: int | None = None) -> Tensor:
    """Gaussian-copula transform z = Phi^-1(rank / (N + 1)) per column (average ranks for ties).

    Memory stays bounded: columns are processed in blocks of ``chunk``. fp16 input is ranked exactly as
    stored and scored in fp32.

    Args:
        x: samples along ``dim``; any real dtype.
        dim: sample dimension.
        chunk: columns per block (default: about 4M elements per block).

    Returns:
        Normal scores, same shape as ``x``, float32 (float64 for float64 input).
    """
    return _restore(column_scores(x, dim, chunk), x, dim)


def equal_frequency_bins(x: Tensor, bins: int, dim: int = 0, chunk: int | None = None) -> Tensor:
    """Equal-frequency bin index floor((rank - 1) * bins / N) in 0..bins-1 along ``dim``.

    Tied values share their average rank, hence their bin. Integer arithmetic: exact at bin edges.

    Returns:
        int64, same shape as ``x``.
    """
    if bins < 2:
        raise ValueError(f"bins must be >= 2, got {bins}")
    n = x.shape[dim] if x.ndim else 0

    def fn(block: Tensor, out: Tensor) -> None:
        twice, order = _twice_ranks(block)
        idx = torch.div((twice.long() - 2) * bins, 2 * n, rounding_mode="floor")  # (c, N) in sorted order
        out.scatter_(-1, order, idx)

    return _restore(_map_columns(x, dim, chunk, fn, torch.int64), x, dim)
