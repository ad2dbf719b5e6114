"""Background threads that leave the training thread's cores alone, and a pool of them for dense linear algebra.

**One thread each.** torch keeps its intra-op thread count (OpenMP's and MKL's) per thread. Once any thread but
the process's first has run a multithreaded torch operation, the first thread's multithreaded LAPACK calls were
measured 4x slower for the rest of the process (a batch of twelve 768 x 768 symmetric eigenproblems: 0.31 s before,
1.35 s after one 4-million-element ``exp`` in another thread, on 2 cores; matrix products kept their speed), and
that thread's own were as slow. vitlab's background threads that run torch operations (the Q/K/V worker, the
checkpoint writer and the solver pool) therefore call :func:`one_thread` first: their work runs on one core each,
and no second team of threads exists.

**The solver pool.** The Q/K/V spectra of a ViT-B epoch are 12 dense 768 x 768 head-summed problems and 144 small
per-head ones (each two or three symmetric eigenproblems, float64). :class:`SolverPool` solves them one problem per
core, as many at once as torch has threads: in the Q/K/V worker beside a GPU that took 0.72 s instead of 4.25 s
on 2 cores, and 1.5x less than LAPACK's own threads on the training thread (``benchmarks/bench_spectra_threads.py``;
``docs/performance.md``). Each problem is solved the same way whatever the pool's size, so the numbers do not
depend on the thread count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


_DEFAULT_LOCK = threading.Lock()  # (one thread at a time between reading the default and putting it back)


def one_thread() -> None:
    """Make torch's CPU operations in the calling thread run on one thread, leaving every other thread as it is.

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL thread counts and the process default;
    the default is set back from a short-lived thread of its own (a thread's own setting is its own). Call it
    in a thread that has run no torch operation yet: until then its count is the process default."""
    with _DEFAULT_LOCK:
        default = torch.get_num_threads()
        torch.set_num_threads(1)
        if default != 1:
            restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="vitlab-threads-default")
            restore.start()
            restore.join()


class SolverPool(ThreadPoolExecutor):
    """A thread pool of ``threads`` single-threaded torch workers (default: torch's intra-op thread count in the
    creating thread), for :func:`vitlab.analysis.spectra.block_spectra`'s ``executor``. Its threads are started at
    once, so that the moment they change the process default (and put it back) is this constructor's."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, int(threads if threads is not None else torch.get_num_threads()))
        super().__init__(max_workers=self.threads, thread_name_prefix="vitlab-solver", initializer=one_thread)
        started = threading.Barrier(self.threads + 1)
        for _ in range(self.threads):
            self.submit(started.wait)
        started.wait()
