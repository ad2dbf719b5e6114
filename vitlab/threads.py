"""Threads and data-loader workers sized to the CPU cores this process may use.

torch's intra-op threads use the cores the process may run on (affinity mask and cgroup quota) beside its loader
workers, less those other processes keep busy when the run starts; loader workers are at most one fewer than the
cores (none on a CPU-only machine of two cores, where torch's two threads train faster with batches loaded
in-process) and run on one thread each (torch's and OpenCV's). Idle OpenMP threads spin about 0.1 ms before they
sleep (``GOMP_SPINCOUNT``, set when vitlab is imported before torch; see ``vitlab/__init__.py``): long enough
for the next small operation of a training step, short enough that threads waiting for a core on a busy machine
do not burn it (a quickstart that took 153 CPU-seconds when quiet took 933 under load with OpenMP's default
spinning). ``VITLAB_THREADS`` or
``OMP_NUM_THREADS`` pick the thread count instead (``VITLAB_THREADS=1`` on a machine other jobs keep busy).
"""

from __future__ import annotations

import math
import os
import sys
import time
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


def loader_workers(requested: int, cores: int | None = None, gpu: bool | None = None) -> int:
    """Loader worker processes for ``requested``: at most one fewer than the cores (the main process trains).

    None when training on the CPU with two cores or fewer: torch's threads then keep every core busy, and a
    worker can only take one from them; each parallel operation waits for the thread it displaced. The
    quickstart's fit took 29 s loading in the training process against 32-35 s with one worker (steps 42 ms
    against 51-56 ms, for batches that cost 3-5 ms to load). With a GPU the training process mostly waits and
    workers overlap with it. ``gpu=None`` asks torch.
    """
    cores = available_cores() if cores is None else cores
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    if cores <= 2 and not gpu:
        return 0
    return max(0, min(requested, cores - 1))


def _cpu_times(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies summed over ``cpus`` from ``/proc/stat`` (busy: all but idle and iowait)."""
    busy = total = 0.0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return busy, total


_BUSY: list[float] = []  # [monotonic time, busy cores] of the last sample


def busy_cores(window_s: float = 0.2, max_age_s: float = 60.0) -> float:
    """How many of this process's cores other processes keep busy, sampled over ``window_s`` (0.0 if unknown).

    Called before training starts, while this process waits: what is busy is somebody else's work, apart from
    idle-priority processes (vitlab's figure process warming up beside it). A sample
    younger than ``max_age_s`` is reused (a process that fits several times, as the tests do, waits once).
    """
    if _BUSY and time.monotonic() - _BUSY[0] < max_age_s:
        return _BUSY[1]
    _BUSY[:] = [time.monotonic(), _sample_busy(window_s)]
    return _BUSY[1]


def _idle_policy_ticks() -> float:
    """CPU time (jiffies, as ``/proc/stat``) of the processes running under Linux's ``SCHED_IDLE`` policy, such as
    vitlab's figure process: they run only on cycles no other process wants, so they take no core from torch."""
    ticks = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rfind(")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
        if len(fields) > 38 and fields[38] == str(getattr(os, "SCHED_IDLE", 5)):  # field 41: policy
            ticks += float(fields[11]) + float(fields[12])  # fields 14, 15: utime, stime
    return ticks


def _sample_busy(window_s: float) -> float:
    try:
        cpus = set(os.sched_getaffinity(0))
        busy0, total0 = _cpu_times(cpus)
        idle0 = _idle_policy_ticks()
        time.sleep(window_s)
        busy1, total1 = _cpu_times(cpus)
        idle1 = _idle_policy_ticks()
    except (AttributeError, OSError, ValueError):  # not Linux, or no /proc
        return 0.0
    if total1 <= total0:
        return 0.0
    return max(0.0, len(cpus) * (busy1 - busy0 - (idle1 - idle0)) / (total1 - total0))


def configure_threads(workers: int = 0) -> int:
    """Set torch's intra-op threads to the cores beside ``workers`` loader processes and OpenCV's to one.

    Returns torch's thread count (at least 1).

    Cores that other processes keep busy when the run starts (:func:`busy_cores`) are left to them: on a busy
    machine a parallel operation waits for its slowest thread, and a thread that has to wait for a core makes
    every step wait (the quickstart beside two busy processes: 91 s on two threads, 67-81 s on one).

    Loader workers (:func:`loader_workers`; none on a CPU-only machine of two cores) run on one thread each.
    OpenCV (albumentations' backend) would start one thread per core; where torch already uses every core they only
    compete with it, in the training process as in the workers (:func:`vitlab.data.transforms.seed_worker`).
    A thread count the user chose (``VITLAB_THREADS`` / ``OMP_NUM_THREADS``) is kept.
    """
    import torch

    chosen = os.environ.get("VITLAB_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if chosen:
        threads = max(1, int(chosen))
    else:
        cores = available_cores()
        free = max(1, cores - min(workers, cores - 1))  # a worker process per core at most, one core trains
        busy = min(cores, busy_cores()) if free > 1 else 0.0
        threads = max(1, free - math.floor(busy + 0.5))
        if threads < free:
            plural = "s" if threads > 1 else ""
            print(
                f"vitlab: other processes keep {busy:.1f} of this run's {cores} cores busy: torch trains on "
                f"{threads} thread{plural} (a thread waiting for a busy core slows every step; VITLAB_THREADS=N sets it)",
                file=sys.stderr,
            )
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:  # pragma: no cover - albumentations brings OpenCV
        pass
    return threads
