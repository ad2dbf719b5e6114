"""The run-time machinery of a training run: torch threads, loader workers and the figure worker.

**Configuration.** A train config's ``runtime:`` section (:class:`Runtime`) holds ``threads``, ``workers``
(``auto`` or a number) and ``figures`` (``auto``: drawn by a separate worker process; ``inline``: in the training
process; ``off``: none, scalars and tables only). ``auto`` is decided from the cores this process may use (its
affinity mask, capped by a cgroup CPU quota) and whether it trains on a GPU, never from what other processes
are doing at the moment: a run's numbers are a function of its config and seed on a given machine type. The
values used are printed once and written into the run's ``config.yaml``, so passing it back repeats the run.
(Loader workers do not change the numbers at all: each sample's augmentation is drawn from a generator keyed
on seed, epoch and sample index, see :mod:`vitlab.data.sampling`.) OpenMP's spin policy must be set before
torch is imported: the entry points call :func:`prepare_process` first, which also lets ``malloc`` reuse freed
tensors' memory.

**The figure worker** (:class:`FigureWorker`), owned from start to end by the
:class:`vitlab.callbacks.RuntimeCallback` of the run:

1. *start* (rank 0, at the fit's set-up): a ``python`` child process running :func:`serve` warms up (fonts, the
   first figure of each kind) while the run sets up;
2. *submit*: the callbacks hand it figures (:mod:`vitlab.outputs.figures` objects) with their tag and step; the
   child draws them in order and a thread of the training process writes each image as it arrives, stamped
   with the wall time of its submit;
3. *pause / resume*: when the run trains on the CPU and its torch threads and loader workers take every core,
   the child is stopped (``SIGSTOP``) during every training and validation step and continued after it: it
   draws between the steps, never taking a core from one;
4. *flush* (end of the fit, an exception): continue the child and wait for every image. A checkpoint is written
   only once every image submitted before it is in the event file (``RuntimeCallback``), so a killed run
   resumed from it lacks none;
5. *close*: end the child. On Linux the kernel also ends it with the training process (``PR_SET_PDEATHSIG``),
   so a killed run leaves no stopped child behind; elsewhere the child is never paused.

It is a plain subprocess speaking a pickled protocol on stdin / stdout, not ``multiprocessing``: spawn would run
a user's unguarded training script again in the child, and fork copies the training process's OpenMP state.
Why a separate process and figure reuse both: ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

FIGURE_MODES = ("auto", "inline", "off")
_PAUSABLE = sys.platform.startswith("linux")  # the kernel ends a stopped child with its parent (PR_SET_PDEATHSIG)


MMAP_THRESHOLD = 256 << 20  # bytes: blocks up to this size are served from (and freed back to) the heap
TRIM_THRESHOLD = 512 << 20  # bytes of free heap top kept for reuse instead of being returned to the kernel


def prepare_process() -> None:
    """Process-wide settings that must precede torch: the entry points call this first.

    - **OpenMP spinning**: idle OpenMP threads spin about 0.1 ms before they sleep (``GOMP_SPINCOUNT``): long
      enough for the next small operation of a training step, short enough that threads waiting for a core do not
      burn it. Effective only before torch is imported; a policy the user set is kept.
    - **Freed memory is reused** (:func:`keep_freed_memory`).
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """Let glibc's ``malloc`` reuse freed tensors' memory instead of returning it to the kernel at every ``free``.

    glibc serves a block larger than its mmap threshold (adjusted up to 32 MB at most) with a fresh ``mmap`` and
    unmaps it when freed, so the kernel page-faults and zeroes that memory again at its next use. A training step
    of a SwinUNETR with MONAI's 7^3 windows allocates attention tensors of tens of MB: 37 % of its CPU time went to
    the kernel, and it takes 0.56x the time with this setting (``benchmarks/bench_allocator.py``). Blocks up to
    256 MB now come from the heap and up to 512 MB of freed heap stay mapped for reuse; the resident size grows by
    what is kept (1.24x there). Linux with glibc only; a ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` the user set,
    or ``VITLAB_MALLOC=system``, leaves glibc as it is. Returns whether the thresholds were set."""
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

    Args:
        threads: torch's intra-op threads; ``auto``: the cores beside the loader workers (``OMP_NUM_THREADS``,
            when set, instead).
        workers: Loader worker processes; ``auto``: none on a CPU-only machine of two cores or fewer (torch's
            threads then take every core, and batches load in the training process between the steps), else
            at most one fewer than the cores (2 on the CPU, 4 beside a GPU).
        figures: ``auto``: figures drawn by a separate worker process beside training; ``inline``: in the
            training process (slower, simplest); ``off``: no figures (scalars, histograms and tables only).
    """

    threads: int | Literal["auto"] = "auto"
    workers: int | Literal["auto"] = "auto"
    figures: Literal["auto", "inline", "off"] = "auto"

    def __post_init__(self) -> None:
        self.threads = _count(self.threads, "threads", 1)
        self.workers = _count(self.workers, "workers", 0)
        if self.figures not in FIGURE_MODES:
            raise ValueError(f"runtime.figures must be one of {', '.join(FIGURE_MODES)}, got {self.figures!r}")

    def resolved(self, gpu: bool, cores: int | None = None) -> Runtime:
        """The same choices with ``auto`` replaced by numbers for a machine of ``cores`` (default: this one's)."""
        cores = available_cores() if cores is None else cores
        workers = self.workers
        if workers == "auto":
            workers = 0 if cores <= 2 and not gpu else min(4 if gpu else 2, cores - 1)
        threads = self.threads
        if threads == "auto":
            chosen = os.environ.get("OMP_NUM_THREADS", "")
            threads = int(chosen) if chosen.isdigit() and int(chosen) > 0 else max(1, cores - min(workers, cores - 1))
        return Runtime(threads, workers, self.figures)

    def apply(self) -> None:
        """torch on ``threads`` threads (resolved). (OpenCV runs on one thread in every process that loads data:
        :func:`vitlab.data.transforms.single_opencv_thread`, made by the loaders.)"""
        import torch

        if isinstance(self.threads, int) and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def describe(self, cores: int, gpu: bool) -> str:
        where = {"auto": "by a figure worker process", "inline": "in the training process", "off": "off"}[self.figures]
        return (f"vitlab: runtime: {self.threads} torch thread(s), {self.workers} loader worker(s), figures {where} "
                f"({cores} core(s){', GPU' if gpu else ', no GPU'}; set runtime.threads / workers / figures to change)")


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


# ---------------------------------------------------------------------------------------------- figure worker
def _send(stream, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    return pickle.loads(stream.read(int.from_bytes(header, "little")))


def serve() -> None:
    """The figure worker's loop (``python -c "from vitlab.runtime import serve; serve()"``): read ``(job, tag,
    figure)`` messages from stdin, answer ``(job, ok, PNG bytes or exception)`` on stdout."""
    import signal

    out = os.fdopen(os.dup(1), "wb")  # the answers; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the training process handles it
    if _PAUSABLE:  # end with the training process, even while stopped
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != int(os.environ.get("VITLAB_FIGURE_PARENT", os.getppid())):  # it ended before the line above
            os._exit(0)
    from vitlab.outputs.figures import FigureStore, warm_up

    warm_up()
    store = FigureStore()
    while True:
        try:
            job, tag, figure = _receive(sys.stdin.buffer)
        except EOFError:
            return
        try:
            answer = (job, True, store.render(tag, figure)[0])
        except Exception as exc:  # noqa: BLE001  (sent back: raised where the figure was asked for)
            answer = (job, False, exc)
        try:
            _send(out, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
            _send(out, (job, False, RuntimeError(f"{type(answer[2]).__name__}: {answer[2]}")))


class FigureWorker:
    """Draws figures and writes them to TensorBoard in submission order: in a child process (``process=True``,
    see the module docstring) or at once in this process. ``builds`` counts figures built (not updated) by tag
    in inline mode. ``submitted`` / ``written`` count figures handed in and finished (written, or failed):
    :meth:`wait_written` lets another thread wait for the first N (a checkpoint writer does)."""

    def __init__(self, process: bool = True) -> None:
        self.process = process
        self.paused = False
        self.submitted = self.written = 0
        self._error: Exception | None = None  # the first error a figure met, raised at the next submit or flush
        if not process:
            from vitlab.outputs.figures import FigureStore

            self._store = FigureStore()
            return
        import queue
        import subprocess

        package_root = str(Path(__file__).resolve().parents[1])  # vitlab importable in the child, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # figures need no parallel BLAS
               "VITLAB_FIGURE_PARENT": str(os.getpid())}
        self._proc = subprocess.Popen([sys.executable, "-c", "from vitlab.runtime import serve; serve()"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._targets: dict[int, tuple] = {}  # job -> (writer, tag, step, walltime)
        self._done = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()  # written by a thread: a submit never waits for the child to read
        threading.Thread(target=self._write_jobs, name="vitlab-figure-jobs", daemon=True).start()
        threading.Thread(target=self._read_images, name="vitlab-figure-images", daemon=True).start()

    def submit(self, writer, tag: str, step: int, figure) -> None:
        """Draw ``figure`` as image ``tag`` at ``step`` of ``writer`` (now inline, else when the child has drawn it)."""
        self._raise_error()
        if not self.process:
            from vitlab.outputs.tensorboard import write_png

            write_png(writer, tag, self._store.render(tag, figure)[0], step)
            self.submitted += 1
            self.written += 1
            return
        with self._done:
            job = self.submitted
            self._targets[job] = (writer, tag, step, time.time())
            self.submitted += 1
        self._jobs.put((job, tag, figure))

    @property
    def builds(self) -> dict[str, int]:
        return dict(self._store.builds) if not self.process else {}

    def wait_written(self, count: int) -> None:
        """Block until the first ``count`` figures submitted are written (or failed; any thread may wait)."""
        if self.process:
            with self._done:
                self._done.wait_for(lambda: self.written >= count)

    def pause(self) -> None:
        """Stop the child until :meth:`resume` (Linux only: elsewhere a stopped child could outlive a killed run)."""
        if self.process and not self.paused and _PAUSABLE and self._proc.poll() is None:
            import signal

            self.paused = True
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.paused:
            import signal

            self.paused = False
            with contextlib.suppress(OSError):  # it has ended
                os.kill(self._proc.pid, signal.SIGCONT)

    def flush(self) -> None:
        """Wait until every figure submitted is drawn and written; raise the first error a figure met."""
        if self.process:
            self.resume()
            self.wait_written(self.submitted)
        self._raise_error()

    def close(self) -> None:
        """End the child (after :meth:`flush`, nothing it holds is waited for)."""
        if self.process:
            self.resume()
            with contextlib.suppress(OSError):
                self._proc.kill()
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=10)  # reaped: no zombie, and its CPU time counts in the parent's rusage
            self._jobs.put(None)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write_jobs(self) -> None:
        while (message := self._jobs.get()) is not None:
            try:
                _send(self._proc.stdin, message)
            except (BrokenPipeError, OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
                self._finish(message[0], RuntimeError(f"could not send a figure to vitlab's figure worker: {type(exc).__name__}: {exc}"))
        with contextlib.suppress(OSError):
            self._proc.stdin.close()  # the child ends when its input does

    def _read_images(self) -> None:
        """Write each image as the child sends it (it draws in submission order), on this thread."""
        while True:
            try:
                job, ok, value = _receive(self._proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            self._finish(job, value if not ok else None, png=value if ok else None)
        code = self._proc.wait()
        with self._done:
            left = sorted(self._targets)
        for job in left:
            self._finish(job, RuntimeError(f"vitlab's figure worker ended (exit code {code}) before drawing this figure"))

    def _finish(self, job: int, error: Exception | None, png: bytes | None = None) -> None:
        with self._done:
            target = self._targets.pop(job, None)
        if target is None:
            return
        writer, tag, step, walltime = target
        try:
            if error is not None:
                raise error
            if getattr(writer, "all_writers", True) is not None:  # a closed writer (the run stopped) gets nothing
                from vitlab.outputs.tensorboard import write_png

                write_png(writer, tag, png, step, walltime)
        except Exception as exc:  # noqa: BLE001  (raised in the training process at its next submit or flush)
            self._error = self._error or exc
        finally:
            with self._done:
                self.written += 1
                self._done.notify_all()


def figure_worker(trainer: Any) -> FigureWorker | None:
    """The figure worker of a run: its :class:`vitlab.callbacks.RuntimeCallback`'s (None when figures are off), or
    for a trainer without one, an inline worker of its own (figures drawn at once)."""
    for callback in getattr(trainer, "callbacks", None) or []:
        if hasattr(callback, "figure_worker") and getattr(callback, "owns_figures", False):
            return callback.figure_worker
    worker = getattr(trainer, "_vitlab_figure_worker", None)
    if worker is None:
        worker = FigureWorker(process=False)
        trainer._vitlab_figure_worker = worker
    return worker
