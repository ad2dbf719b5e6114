"""Large CSV tables written by a child process (:class:`TableWorker`), beside training on a GPU.

Formatting a table of tens of thousands of rows is plain Python: it holds the interpreter's lock, and a training
thread on a GPU needs that lock at every operation it launches, so a thread writing such a table stalls the
launches for as long as it runs (the Q/K/V drift's table of a ViT-B epoch: 27,648 rows). The Q/K/V callbacks'
background worker therefore hands its tables, as numpy columns, to a child Python process that formats and writes
them (:func:`vitlab.outputs.files.write_csv_arrays`: the file the training process would write), and waits for
it without the lock. A plain subprocess speaking the figure worker's pickled protocol, for the same reasons
(:mod:`vitlab.figure_worker`); it imports numpy only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitlab.figure_worker import _receive, _send, child_environment, child_setup


def serve() -> None:
    """The table worker's loop (``python -c "from vitlab.table_worker import serve; serve()"``): read ``(path,
    columns)`` messages from stdin, write each table, answer ``(ok, None or exception)`` on stdout."""
    out = child_setup()
    from vitlab.outputs.files import write_csv_arrays

    while True:
        try:
            path, columns = _receive(sys.stdin.buffer)
        except EOFError:
            return
        try:
            write_csv_arrays(path, columns)
            answer: tuple[bool, Any] = (True, None)
        except Exception as exc:  # noqa: BLE001  (sent back: raised where the table was asked for)
            answer = (False, exc)
        try:
            _send(out, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
            _send(out, (False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))


class TableWorker:
    """Writes CSV tables in a child process, one at a time: :meth:`write` returns when the file is written (the
    caller waits without holding the interpreter's lock). Safe to call from any thread. The child starts at the
    first table and ends at :meth:`close` (or with the training process); one that ended is replaced at the next
    table. A table whose child ends while writing it is written here (said in one line); after :data:`MAX_LOSSES`
    such ends, every table is."""

    MAX_LOSSES = 2

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.losses = 0

    def write(self, path: str | os.PathLike, columns: Mapping[str, Any]) -> Path:
        """Write ``columns`` (name -> numpy array or list) to ``path`` as :func:`vitlab.outputs.files.write_csv_arrays`
        does; an error of the child's writing is raised here."""
        from vitlab.outputs.files import write_csv_arrays

        if self.losses >= self.MAX_LOSSES:
            return write_csv_arrays(path, columns)
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen([sys.executable, "-c", "from vitlab.table_worker import serve; serve()"],
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_environment())
                _send(self._proc.stdin, (str(path), dict(columns)))
                ok, error = _receive(self._proc.stdout)
            except (EOFError, OSError):
                code = self._end()
                self.losses += 1
                print(f"vitlab: the table writer process ended (exit code {code}) before writing {path}: written by the "
                      f"training process{' from now on' if self.losses >= self.MAX_LOSSES else ''}", file=sys.stderr)
                return write_csv_arrays(path, columns)
        if not ok:
            raise error
        return Path(path)

    def close(self) -> None:
        """End the child once it has written what it was given (a table being written is finished first)."""
        with self._lock:
            self._end()

    def _end(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the child ends when its input does
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
