"""Threads and data-loader workers sized to the CPU cores this process may use.

On a busy machine torch's OpenMP threads spin while they wait for each other, and loader workers compete with
them for the same cores: a quickstart that takes 153 CPU-seconds when quiet took 933 under load. vitlab sets
``OMP_WAIT_POLICY=PASSIVE`` on import (waiting threads sleep; see ``vitlab/__init__.py``), and
:func:`configure_threads` keeps threads + workers within the cores available.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def loader_workers(requested: int, cores: int | None = None) -> int:
    """Loader worker processes for ``requested``: at most one fewer than the cores (the main process trains)."""
    cores = available_cores() if cores is None else cores
    return max(0, min(requested, cores - 1))


def configure_threads(num_workers: int = 0) -> int:
    """Set torch's intra-op threads to the cores left beside ``num_workers`` busy loader workers (at least 1).

    A thread count the user chose (``OMP_NUM_THREADS`` / ``VITLAB_THREADS``) is kept. Returns the count in use.
    """
    import torch

    chosen = os.environ.get("VITLAB_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if chosen:
        threads = max(1, int(chosen))
    else:
        cores = available_cores()
        threads = max(1, cores - loader_workers(num_workers, cores))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
