"""The Q/K/V callbacks' per-epoch work, kept off the training thread when the weights are on a GPU.

Each epoch the Q/K/V callbacks snapshot, compare and decompose every block's query / key / value weights, then write
files, TensorBoard events and figures. Run in the training thread beside a GPU, every device-to-host copy and every
host-side computation stops the launching of training kernels, and the GPU idles for seconds per epoch. Here the
training thread only takes a :class:`~vitlab.qkv.state.QKVCapture` (one kernel, no wait) and hands the rest to
:class:`QKVWorker`: one background thread that runs the jobs in submission order, copies the capture to pinned host
memory (waiting for that copy only), computes and writes. CPU runs do the same jobs at once, in the training thread,
as before: there the work needs the cores the training would use anyway.

A checkpoint must not exist before the work of the epochs it covers is on disk; :meth:`QKVWorker.wait_done` lets
the checkpoint writer wait for the first N jobs (see :class:`vitlab.checkpoint_writer.BackgroundCheckpointIO`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from vitlab.solver_pool import SolverPool, one_thread


class QKVWorker:
    """Runs jobs (callables without arguments) in submission order: at once (``background=False``) or on one daemon
    thread. A job's exception is raised in the submitting thread at the next :meth:`submit` or :meth:`flush`.

    ``submitted`` / ``done`` count the jobs handed in and finished (successfully or not). ``tables``: where the
    jobs write their large CSV tables: a :class:`vitlab.table_worker.TableWorker` (a child process, so that
    formatting them never holds the interpreter's lock beside the training thread) when in the background, else
    None (written by the job itself, in the training thread: on the CPU that is where the cores are). ``solvers``:
    a :class:`vitlab.solver_pool.SolverPool` of torch's intra-op thread count (taken here, in the creating thread)
    for the jobs' dense eigenproblems, started at the first job that asks for it.
    """

    def __init__(self, background: bool) -> None:
        from vitlab.table_worker import TableWorker

        self.background = background
        self.tables = TableWorker() if background else None
        self._solver_threads = torch.get_num_threads()
        self._solvers: SolverPool | None = None
        self._ending = False
        self.submitted = self.done = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def solvers(self) -> SolverPool:
        if self._solvers is None:
            self._solvers = SolverPool(self._solver_threads)
        return self._solvers

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` now (inline) or after every job submitted before it (background)."""
        self._raise_error()
        if not self.background:
            self.submitted += 1
            try:
                job()
            finally:
                self.done += 1
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vitlab-qkv", daemon=True)
            self._thread.start()
        with self._cond:
            self.submitted += 1
        self._jobs.put(job)

    def wait_done(self, count: int) -> None:
        """Block until the first ``count`` jobs have finished (any thread may wait)."""
        with self._cond:
            self._cond.wait_for(lambda: self.done >= count)

    def flush(self) -> None:
        """Wait for every job submitted so far; raise the first error one of them met."""
        self.wait_done(self.submitted)
        self._raise_error()

    def close(self) -> None:
        """Let the thread end once the jobs submitted so far are done, ending the table writer's child and the solver
        pool after them (it never blocks the process's exit); without a thread, end the pool now."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
            self._ending = True  # (the thread ends the solver pool after the jobs)
        elif not self._ending and self._solvers is not None:  # (no thread: the jobs are done)
            self._solvers.shutdown()
            self._solvers = None

    def _run(self) -> None:
        one_thread()  # (a second thread's multithreaded torch operations slow the training thread's; see solver_pool)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001  (raised in the training thread at its next call)
                self._error = self._error or exc
            finally:
                with self._cond:
                    self.done += 1
                    self._cond.notify_all()
        if self.tables is not None:
            self.tables.close()
        solvers = self._solvers
        if solvers is not None:
            solvers.shutdown()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
