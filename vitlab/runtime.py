"""The run-time machinery of a training run: torch threads, loader workers, the allocator and the figure worker.

**Configuration.** A train config's ``runtime:`` section (:class:`Runtime`) holds ``threads``, ``workers``
(``auto`` or a number) and ``figures`` (``auto``: drawn by a separate worker process; ``inline``: in the training
process; ``off``: none, scalars and tables only). ``auto`` is decided from the cores this process may use (its
affinity mask, capped by a cgroup CPU quota) and whether it trains on a GPU, never from what other processes
are doing at the moment: a run's numbers are a function of its config and seed on a given machine type. The
values used are printed once and written into the run's ``config.yaml``, so passing it back repeats the run.
The thread count changes the numbers (the order of torch's parallel sums); the loader workers never do: each
sample's augmentation is drawn from a generator keyed on seed, epoch and sample index (:mod:`vitlab.data.sampling`),
and ``threads: auto`` does not depend on the workers. OpenMP's spin policy must be set before torch is imported:
the entry points call :func:`prepare_process` first; ``train.py`` also lets ``malloc`` keep freed memory for
reuse (:func:`keep_freed_memory`) when it trains on 3-D volumes, where that was measured to help.

The figure worker lives in :mod:`vitlab.figure_worker` (its names are importable from here too).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vitlab.figure_worker import FIGURE_MODES, PENDING_BYTES, FigureWorker, figure_worker, serve

__all__ = ["FIGURE_MODES", "PENDING_BYTES", "FigureWorker", "Runtime", "available_cores", "figure_worker", "frozen_heap",
           "keep_freed_memory", "nvml_cuda_check", "prepare_process", "prepare_training", "serve"]

MMAP_THRESHOLD = 256 << 20  # bytes: blocks up to this size are served from (and freed back to) the heap
TRIM_THRESHOLD = 512 << 20  # bytes of free heap top kept for reuse instead of being returned to the kernel


def prepare_process() -> None:
    """Process-wide settings that must precede torch: the entry points (``train.py``, ``probe.py``) call this first.

    Idle OpenMP threads spin about 0.1 ms before they sleep (``GOMP_SPINCOUNT``): long enough for the next small
    operation of a training step, short enough that threads waiting for a core do not burn it. Effective only
    before torch is imported; a policy the user set is kept. (glibc's allocator is left as it is here:
    ``train.py`` calls :func:`keep_freed_memory` for runs on 3-D volumes only.)
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def keep_freed_memory() -> bool:
    """Let glibc's ``malloc`` reuse freed tensors' memory instead of returning it to the kernel at every ``free``.

    glibc serves a block larger than its mmap threshold (adjusted up to 32 MB at most) with a fresh ``mmap`` and
    unmaps it when freed, so the kernel page-faults and zeroes that memory again at its next use. A training step
    of a SwinUNETR with MONAI's 7^3 windows allocates attention tensors of tens of MB: 37 % of its CPU time went to
    the kernel, and it takes about half the time with this setting (``benchmarks/bench_allocator.py``). Blocks up
    to 256 MB then come from the heap and up to 512 MB of freed heap stay mapped for reuse, so the resident size
    grows by what is kept: ``probe.py mi`` on ViT-B/16 peaked 1.4 GB higher with it. ``train.py`` therefore sets it
    only when it trains on 3-D volumes (``data.sample: volume``), where it was measured to help; the probes and
    2-D runs keep glibc's defaults. Effective for the blocks allocated after the call (torch may be imported).
    Linux with glibc only; a ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` the user set, or
    ``VITLAB_MALLOC=system``, leaves glibc as it is. Returns whether the thresholds were set. Measurements:
    ``docs/performance.md``."""
    if not sys.platform.startswith("linux") or os.environ.get("VITLAB_MALLOC", "") == "system":
        return False
    if any(key in os.environ for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's (musl has none)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))


def prepare_training(sample: str | None) -> bool:
    """``train.py``'s allocator: :func:`keep_freed_memory` for a run on 3-D volumes (``data.sample: volume``), where
    it was measured to help; glibc's defaults otherwise. Returns whether freed memory is kept."""
    return keep_freed_memory() if sample == "volume" else False


def nvml_cuda_check() -> bool:
    """Drop Lightning's NVML-based CUDA check (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) where NVML cannot be loaded.

    Lightning sets that variable at import so that ``torch.cuda.is_available()`` asks NVML instead of initialising
    CUDA before worker processes fork. On a machine without NVIDIA's driver (a CUDA build of torch on a CPU-only
    machine, the usual pip install) torch then tries to load ``libnvidia-ml.so.1`` at every call, fails and falls
    back to the CUDA runtime's count, which is what it asks without the variable: the same answer after a failed
    library search. torch's optimisers ask at every ``step()`` (their graph-capture check), and in a fit's process
    that search cost 0.27 ms an AdamW step (2 cores, steps with and without the variable alternating;
    ``docs/performance.md``). Where NVML loads (a machine with a GPU driver) the variable is kept. Returns whether it
    was dropped."""
    if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
        return False
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")  # the library torch's check loads (torch.cuda._raw_device_count_nvml)
    except OSError:
        del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        return True
    return False


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


def _count(value: Any, key: str, minimum: int) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"runtime.{key} must be 'auto' or an int >= {minimum}, got {value!r}")
    return value


@dataclass
class Runtime:
    """How a training run uses the machine (a train config's ``runtime:`` section).

    ``auto`` depends on the cores this process may use and the accelerator only. ``threads`` changes the numbers
    (the order of torch's parallel sums), so it never follows ``workers``: any number of loader workers gives the
    same snapshots and metrics, bit for bit (tested).

    Args:
        threads: torch's intra-op threads; ``auto``: on the CPU every core on a machine of two cores or fewer, else
            the cores less those ``workers: auto`` takes (``cores - 2``); beside a GPU ``cores // 4``, between 1 and
            4 (the GPU does the arithmetic; the cores feed it). ``OMP_NUM_THREADS``, when set, instead.
        workers: Loader worker processes; ``auto``: on the CPU none on two cores or fewer (torch's threads take
            every core, and batches load in the training process between the steps), else 2; beside a GPU the
            cores the threads leave less one, between 1 and 12 (decoding and augmenting keep the GPU fed).
        figures: ``auto``: figures drawn by a separate worker process beside training; ``inline``: in the
            training process (slower, simplest); ``off``: no figures (scalars, histograms and tables only).
        tf32: The GPU's float32 matrix products in TensorFloat-32 (its tensor cores: several times the float32
            rate on Ampere and later, products rounded to 10 bits of mantissa on input, sums in float32).
            ``auto``: on when the run trains on a GPU, as timm's ``train.py`` does, unless this process already
            chose a float32 matmul precision (``torch.set_float32_matmul_precision``); ``true`` / ``false``: on /
            off (``false``: full float32 products). CUDA's matrix products only
            (``torch.backends.cuda.matmul.allow_tf32``): the CPU's numbers never change, cuDNN's convolutions use
            TF32 by default in PyTorch either way, and a ``bf16-mixed`` run makes most products in bf16 anyway.
            Set for the process, as ``threads`` is.
        fill_uninitialized: Under deterministic algorithms (``trainer.deterministic: true`` or ``warn``) torch fills
            every newly allocated tensor with NaN (integers with their largest value), so that an operation that read
            memory nothing wrote would give the same wrong value every time: a debugging aid that costs a kernel
            and a write of every fresh tensor (a SwinUNETR training step: 1,935 fills instead of 173,
            ``benchmarks/bench_step_ops.py``, each a launch for a GPU's host; the 3-D quickstart's step 0.187
            against 0.181 s on 2 CPU cores). ``false`` (default): fresh tensors
            are not filled; no operation of a training step reads what it did not write, so the numbers are the
            same, bit for bit (tested); ``true``: torch's default. Set for the process
            (``torch.utils.deterministic.fill_uninitialized_memory``).
    """

    threads: int | Literal["auto"] = "auto"
    workers: int | Literal["auto"] = "auto"
    figures: Literal["auto", "inline", "off"] = "auto"
    tf32: bool | Literal["auto"] = "auto"
    fill_uninitialized: bool = False

    def __post_init__(self) -> None:
        self.threads = _count(self.threads, "threads", 1)
        self.workers = _count(self.workers, "workers", 0)
        if self.figures not in FIGURE_MODES:
            raise ValueError(f"runtime.figures must be one of {', '.join(FIGURE_MODES)}, got {self.figures!r}")
        if self.tf32 != "auto" and not isinstance(self.tf32, bool):
            raise ValueError(f"runtime.tf32 must be 'auto', true or false, got {self.tf32!r}")
        if not isinstance(self.fill_uninitialized, bool):
            raise ValueError(f"runtime.fill_uninitialized must be true or false, got {self.fill_uninitialized!r}")

    def resolved(self, gpu: bool, cores: int | None = None) -> Runtime:
        """The same choices with ``auto`` replaced by numbers for a machine of ``cores`` (default: this one's)."""
        cores = available_cores() if cores is None else cores
        threads = self.threads
        if threads == "auto":
            chosen = os.environ.get("OMP_NUM_THREADS", "")
            if chosen.isdigit() and int(chosen) > 0:
                threads = int(chosen)
            elif gpu:
                threads = max(1, min(4, cores // 4))
            else:
                threads = cores if cores <= 2 else cores - min(2, cores - 1)
        workers = self.workers
        if workers == "auto":
            if gpu:
                workers = max(1, min(12, cores - threads - 1))
            else:
                workers = 0 if cores <= 2 else min(2, cores - 1)
        tf32 = self.tf32
        if tf32 == "auto" and gpu and _default_matmul_precision():
            tf32 = True
        return Runtime(threads, workers, self.figures, tf32, self.fill_uninitialized)

    def apply(self) -> None:
        """torch on ``threads`` threads, CUDA's float32 products in TF32 or not (resolved: ``auto`` left as
        it is), fresh tensors NaN-filled under deterministic algorithms or not. (OpenCV runs on one thread in every
        process that loads data: :func:`vitlab.data.transforms.single_opencv_thread`, made by the loaders.)"""
        import torch

        if isinstance(self.threads, int) and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if isinstance(self.tf32, bool):
            # (the switch torch.get_float32_matmul_precision reads, which Lightning asks on a GPU: torch refuses to
            # answer once its per-backend precision settings are mixed with this one, so this one alone is used)
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
        import torch.utils.deterministic

        torch.utils.deterministic.fill_uninitialized_memory = self.fill_uninitialized

    def describe(self, cores: int, gpu: bool) -> str:
        where = {"auto": "by a figure worker process", "inline": "in the training process", "off": "off"}[self.figures]
        products = ""
        if gpu and isinstance(self.tf32, bool):
            products = ", the GPU's float32 products in " + ("TF32" if self.tf32 else "full float32")
        return (f"vitlab: runtime: {self.threads} torch thread(s), {self.workers} loader worker(s), figures {where}"
                f"{products} ({cores} core(s){', GPU' if gpu else ', no GPU'}; threads change the numbers, workers do "
                f"not; set runtime.threads / workers / figures{' / tf32' if products else ''} to change)")


def _default_matmul_precision() -> bool:
    """Whether this process left torch's float32 matmul precision at its default (full float32)."""
    import torch

    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # (torch refuses to answer when its legacy and per-backend settings were mixed: a choice)
        return False


@contextlib.contextmanager
def frozen_heap():
    """Keep the objects alive before a fit out of Python's full garbage collections during it: ``train.py``
    imports torch, Lightning, timm and matplotlib (hundreds of thousands of objects), which a full collection
    would walk again and again. Unfrozen on exit, so a process that fits several times frees what an earlier
    fit left behind."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
