"""Timing helper shared by the benchmark scripts (run them as ``python benchmarks/bench_x.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int, warmup: bool = True) -> tuple[float, Any]:
    """Smallest wall time of ``repeats`` runs and the last result (the machine is shared: the minimum
    is the least noisy estimate)."""
    out = fn() if warmup else None
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out
