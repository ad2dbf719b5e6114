"""Timing helper shared by the benchmark scripts (run them as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int, warmup: bool = True, clock: str = "wall") -> tuple[float, Any]:
    """Smallest wall time of ``repeats`` runs and the last result (the machine is shared: the minimum
    is the least noisy estimate); ``clock="cpu"``: this process's CPU time (all its threads, user + system)
    instead, less sensitive to other processes on a shared machine."""
    timer = time.process_time if clock == "cpu" else time.perf_counter
    out = fn() if warmup else None
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        out = fn()
        best = min(best, timer() - start)
    return best, out
