"""The figure worker of a training run (:class:`FigureWorker`): figures drawn in a separate process beside
training, owned from start to end by the :class:`vitlab.callbacks.RuntimeCallback` of the run:

1. *start* (rank 0, at the fit's set-up): a ``python`` child process running :func:`serve` imports matplotlib
   while the run sets up. It draws no warm-up figures: a first figure set took as long after them as without
   them, and they took the child 0.6-1.0 s that a short fit's end waited for (``docs/performance.md``);
2. *submit*: the callbacks hand it figures (:mod:`vitlab.outputs.figures` objects) with their tag and step; the
   child draws them in order and a thread of the training process writes each image as it arrives, stamped
   with the wall time of its submit;
3. *pause / resume*: when the run trains on the CPU and its torch threads and loader workers take every core,
   the child is stopped (``SIGSTOP``) during every training and validation step and continued after it: it
   draws between the steps, never taking a core from one;
4. *flush* (end of the fit, an exception): continue the child and wait for every image. Checkpoints never wait
   for figures: a checkpoint lists the figures not yet written when it was taken (:meth:`FigureWorker.pending`),
   and a run resumed from it draws those its killed predecessor had not written (``RuntimeCallback``). Figures
   waiting to be drawn are bounded (:data:`PENDING_BYTES`): past it a new figure is skipped, said in one line;
5. *close*: end the child. On Linux the kernel also ends it with the training process (``PR_SET_PDEATHSIG``),
   so a killed run leaves no stopped child behind; elsewhere the child is never paused.

It is a plain subprocess speaking a pickled protocol on stdin / stdout, not ``multiprocessing``: spawn would run
a user's unguarded training script again in the child, and fork copies the training process's OpenMP state.
Why a separate process and figure reuse both: ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

FIGURE_MODES = ("auto", "inline", "off")
PENDING_BYTES = 64 << 20  # figure values waiting to be drawn, at most (a worker far slower than the epochs)
_PAUSABLE = sys.platform.startswith("linux")  # the kernel ends a stopped child with its parent (PR_SET_PDEATHSIG)


def _send(stream, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    return pickle.loads(stream.read(int.from_bytes(header, "little")))


def child_setup():
    """The start of a worker child of the training process (:func:`serve`, :func:`vitlab.table_worker.serve`):
    returns the stream its answers go to (stdout; anything else printed goes to stderr). Ctrl-C is left to the
    training process; on Linux the kernel ends the child with it (``PR_SET_PDEATHSIG``)."""
    import signal

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the training process handles it
    if _PAUSABLE:  # end with the training process, even while stopped
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != int(os.environ.get("VITLAB_FIGURE_PARENT", os.getppid())):  # it ended before the line above
            os._exit(0)
    return out


def child_environment() -> dict[str, str]:
    """The environment of a worker child: vitlab importable (installed or not), one thread for numeric libraries,
    the training process's id (for :func:`child_setup`)."""
    package_root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # no parallel BLAS needed
            "VITLAB_FIGURE_PARENT": str(os.getpid())}


def serve() -> None:
    """The figure worker's loop (``python -c "from vitlab.figure_worker import serve; serve()"``): read ``(job, tag,
    figure)`` messages from stdin, answer ``(job, ok, PNG bytes or exception)`` on stdout."""
    out = child_setup()
    from vitlab.outputs.figures import FigureStore

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
    in inline mode. ``submitted`` / ``written`` count figures handed in and finished (written, or failed);
    :meth:`pending` lists those handed in and not finished (a checkpoint keeps them, see ``RuntimeCallback``).
    ``skipped`` counts figures not drawn because :data:`PENDING_BYTES` of values were already waiting."""

    def __init__(self, process: bool = True) -> None:
        self.process = process
        self.paused = False
        self.submitted = self.written = self.skipped = 0
        self._error: Exception | None = None  # the first error a figure met, raised at the next submit or flush
        if not process:
            from vitlab.outputs.figures import FigureStore

            self._store = FigureStore()
            return
        import queue
        import subprocess

        self._proc = subprocess.Popen([sys.executable, "-c", "from vitlab.figure_worker import serve; serve()"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_environment())
        self._targets: dict[int, tuple] = {}  # job -> (writer, tag, step, walltime, figure, bytes of its values, ordinal)
        self._ordinals: dict[tuple[str, int], int] = {}  # (tag, step) -> images handed in
        self._pending_bytes = 0
        self._skipped_steps: set[int] = set()  # steps whose skipped figures were reported
        self._done = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()  # written by a thread: a submit never waits for the child to read
        threading.Thread(target=self._write_jobs, name="vitlab-figure-jobs", daemon=True).start()
        threading.Thread(target=self._read_images, name="vitlab-figure-images", daemon=True).start()

    def submit(self, writer, tag: str, step: int, figure, ordinal: int | None = None) -> None:
        """Draw ``figure`` as image ``tag`` at ``step`` of ``writer`` (now inline, else when the child has drawn it).
        ``ordinal``: how many images of this tag and step were handed in before it (default: counted here; a
        figure drawn again for a resumed run keeps the one its checkpoint lists).

        A figure that would take the values waiting in the child's queue past :data:`PENDING_BYTES` is skipped
        (the worker is far behind the epochs; one line per step says so): training and checkpoints never wait
        for figures, and memory does not grow without bound."""
        self._raise_error()
        if not self.process:
            from vitlab.outputs.tensorboard import write_png

            write_png(writer, tag, self._store.render(tag, figure)[0], step)
            self.submitted += 1
            self.written += 1
            return
        size = values_nbytes(figure)
        with self._done:
            if self._targets and self._pending_bytes + size > PENDING_BYTES:
                self.skipped += 1
                if step not in self._skipped_steps:
                    self._skipped_steps.add(step)
                    print(f"vitlab: figures: skipped {tag} (step {step}) and any other of this step: "
                          f"{len(self._targets)} figure(s) ({self._pending_bytes / 2**20:.0f} MB of values) are still "
                          "waiting to be drawn (draw fewer with the callbacks' figures_every_n_epochs)", file=sys.stderr)
                return
            job = self.submitted
            ordinal = self._ordinals.get((tag, step), 0) if ordinal is None else ordinal
            self._ordinals[(tag, step)] = ordinal + 1
            self._targets[job] = (writer, tag, step, time.time(), figure, size, ordinal)
            self._pending_bytes += size
            self.submitted += 1
        self._jobs.put((job, tag, figure))

    def pending(self) -> list[tuple[str, int, int, Any]]:
        """``(tag, step, ordinal, figure)`` of every figure handed in and not yet written, in submission order."""
        if not self.process:
            return []
        with self._done:
            return [(tag, step, ordinal, figure) for _, (_, tag, step, _, figure, _, ordinal) in sorted(self._targets.items())]

    @property
    def builds(self) -> dict[str, int]:
        return dict(self._store.builds) if not self.process else {}

    def wait_written(self, count: int) -> None:
        """Block until the first ``count`` figures submitted are written (or failed)."""
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
            if target is not None:
                self._pending_bytes -= target[5]
        if target is None:
            return
        writer, tag, step, walltime = target[:4]
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


def values_nbytes(value: Any) -> int:
    """Bytes of the numpy arrays in a figure object's values (dataclass fields, dicts, lists, tuples)."""
    import dataclasses

    import numpy as np

    if isinstance(value, np.ndarray):
        return value.nbytes
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return sum(values_nbytes(v) for v in value)
    return 0


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
