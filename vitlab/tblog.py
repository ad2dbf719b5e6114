"""The one place vitlab writes outputs: TensorBoard writer lookup, figures, atomic files and tables.

Callbacks and probes gather tensors through :mod:`vitlab.models`, compute through :mod:`vitlab.analysis`
and write through these helpers, so every output is written the same (atomic, rank-zero) way.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import io
import itertools
import json
import math
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


from vitlab.figures import (  # noqa: E402,F401  (re-exported: the figures live in the torch-free module)
    CONFUSION_TITLE,
    WIDEST_TICK,
    confusion_matrix_figure,
    heatmap_figure,
    heatmap_update,
    new_figure,
    redrawn,
    update_heatmap,
)


def tensorboard_writer(trainer: Any):
    """The ``SummaryWriter`` of the trainer's first TensorBoard logger, or ``None`` when it has none."""
    from pytorch_lightning.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []) or []:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def require_tensorboard(trainer: Any, owner: str) -> None:
    """Raise at ``setup`` when a callback that writes TensorBoard images has no TensorBoard logger."""
    from pytorch_lightning.loggers import TensorBoardLogger

    if not any(isinstance(lg, TensorBoardLogger) for lg in getattr(trainer, "loggers", []) or []):
        raise RuntimeError(
            f"{owner} needs a TensorBoardLogger: set trainer.logger to "
            "pytorch_lightning.loggers.TensorBoardLogger (the vitlab default) instead of "
            f"{[type(lg).__name__ for lg in trainer.loggers] or 'no logger'}"
        )


def logging_step(trainer: Any) -> int:
    """The step Lightning's own ``self.log`` writes at now (batches that stepped; as LearningRateMonitor uses)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step if step is not None else getattr(trainer, "global_step", 0))


def epoch_end_step(trainer: Any) -> int:
    """The step of an epoch's outputs written in ``on_train_epoch_end``: the step Lightning gives the epoch's
    ``val/*`` and ``train/*`` epoch metrics (its last batch), so drift, spectra and accuracy of one epoch
    share one x value, and every output of an epoch lies below the step its checkpoint resumes at."""
    return max(logging_step(trainer) - 1, 0)


def checkpoint_logging_step(ckpt_path: str | os.PathLike) -> int:
    """The logging step a run resumed from ``ckpt_path`` continues at (read without loading the tensors)."""
    ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=True, mmap=True)
    loop_state = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    return int(loop_state.get("_batches_that_stepped", ckpt.get("global_step", 0)))


def purge_after_checkpoint(trainer: Any, ckpt_path: str | os.PathLike) -> int | None:
    """Make a resumed run's TensorBoard writers discard what a killed run wrote after its last checkpoint.

    The writer opens with ``purge_step`` = the checkpoint's logging step: TensorBoard drops every event at
    that step or later written before the restart (everything the resumed run logs again), so each tag keeps
    one point per step. Call before the writer is first used (before ``trainer.fit``). Returns the step.
    """
    from pytorch_lightning.loggers import TensorBoardLogger

    loggers = [lg for lg in getattr(trainer, "loggers", []) or [] if isinstance(lg, TensorBoardLogger)]
    if not loggers:
        return None
    step = checkpoint_logging_step(ckpt_path)
    for logger in loggers:
        if logger._experiment is not None:  # opened early: reopen it with the purge step
            logger._experiment.close()
            logger._experiment = None
        logger._kwargs["purge_step"] = step
    return step


def resume_step(trainer: Any) -> int:
    """The step a resumed run continues from (its TensorBoard purge step), or 0 for a fresh run."""
    from pytorch_lightning.loggers import TensorBoardLogger

    steps = [lg._kwargs.get("purge_step") for lg in getattr(trainer, "loggers", []) or [] if isinstance(lg, TensorBoardLogger)]
    return int(next((s for s in steps if s is not None), 0))


def figures_due(trainer: Any, completed_epochs: int, every_n_epochs: int | None = None) -> bool:
    """Whether an epoch's figures are drawn: every N-th completed epoch, the first and the last.

    ``None``: N = ceil(max_epochs / 4), about 5 sets a run (30 epochs: after epochs 1, 8, 16, 24 and 30;
    TensorBoard keeps up to 10 images per tag). Each set costs the quickstart about 0.2 s of its 23 s fit (a
    figure costs as much as several training steps of a small model, drawn beside them); every epoch's values
    are in the scalars and tables.
    """
    max_epochs = getattr(trainer, "max_epochs", None) or 0
    if every_n_epochs is None:
        every_n_epochs = max(1, math.ceil(max_epochs / 4))
    return completed_epochs <= 1 or completed_epochs % every_n_epochs == 0 or (max_epochs > 0 and completed_epochs >= max_epochs)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path`` (atomic on POSIX).

    A crash or exception leaves no partial file under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the normal permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``tensors`` to a safetensors file atomically; metadata values are stored as strings."""
    from safetensors.torch import save_file

    clean = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path) as tmp:
        save_file(clean, str(tmp), metadata=meta)
    return Path(path)


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]], fieldnames: Sequence[str] | None = None) -> Path:
    """Write dict rows to a CSV file atomically (columns from ``fieldnames`` or the first row)."""
    rows = list(rows)
    fieldnames = list(rows[0].keys() if rows else []) if fieldnames is None else list(fieldnames)
    known = set(fieldnames)
    for row in rows:
        if row.keys() - known:
            raise ValueError(f"{path}: row has columns {sorted(row.keys() - known)} not among {fieldnames}")
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(fieldnames)  # (csv.writer, not DictWriter: a table of every Q/K/V row each epoch)
            writer.writerows([_plain(row.get(k, "")) for k in fieldnames] for row in rows)
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=_plain))
    return Path(path)


def _plain(value: Any) -> Any:
    if type(value) is float:
        return float(f"{value:.8g}")
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float):
        return float(f"{value:.8g}")
    return value


FIGURE_PATIENCE_S = 2.0  # how long a flush waits for an answer of the figure process before drawing the rest itself
_FIGURE_LOCK = threading.Lock()
_FIGURE_PROCESS: dict[str, Any] = {"pool": None, "users": 0}  # the shared figure process and its caches in use
_ACTIVE_CACHES: "weakref.WeakSet[FigureCache]" = weakref.WeakSet()
_CACHE_IDS = itertools.count()


def _figure_process_started():
    """The one figure process of this process (started for its first user): see :mod:`vitlab.figures`."""
    with _FIGURE_LOCK:
        if _FIGURE_PROCESS["users"] == 0:
            from vitlab.figures import FigureProcess

            _FIGURE_PROCESS["pool"] = FigureProcess()
        _FIGURE_PROCESS["users"] += 1
        return _FIGURE_PROCESS["pool"]


def _figure_process_stopped() -> None:
    """One user less; the last one stops the process."""
    with _FIGURE_LOCK:
        _FIGURE_PROCESS["users"] -= 1
        if _FIGURE_PROCESS["users"] == 0:
            _FIGURE_PROCESS["pool"].shutdown()
            _FIGURE_PROCESS["pool"] = None


@contextlib.contextmanager
def figure_process_ready() -> Iterator[None]:
    """Start the figure process now and keep it for the block (a training run: ``vitlab.cli.fit``), warmed up.

    Started at the first figure, the process imported matplotlib, loaded its fonts and built its first figures
    while the first epochs trained (about 0.5 CPU-s beside them on a small machine). Started before the model and
    data are set up, it does that on a core the single-threaded set-up leaves idle. The callbacks' caches use it
    as they would a process they started; it ends when the block and they are done."""
    pool = _figure_process_started()
    pool.submit("warm_up")
    try:
        yield
    finally:
        _figure_process_stopped()


def pause_figures() -> None:
    """Stop the figure process, if one runs, until :func:`resume_figures` (see ``FigureProcess.pause``); every
    wait for figures resumes it first."""
    pool = _FIGURE_PROCESS["pool"]
    if pool is not None:
        pool.pause()


def resume_figures() -> None:
    pool = _FIGURE_PROCESS["pool"]
    if pool is not None:
        pool.resume()


def flush_figures() -> None:
    """Write every image of every cache that was handed to the figure process so far (as ``writer.flush()``
    waits for the events queued so far). Images still being drawn when a process is killed are lost, like
    unflushed events."""
    for cache in list(_ACTIVE_CACHES):
        cache.flush()


class FigureCache:
    """Figures kept between the epochs that draw them, one per TensorBoard tag, updated instead of rebuilt.

    Building a matplotlib figure (axes, ticks, colour bars, layout) costs about as much as drawing it; a callback
    that logs the same figure every few epochs keeps it and only changes its data, titles and colour scales, and
    only the artists that change are drawn again (see :class:`vitlab.figures.FigureStore`). ``layout`` describes
    what fixes the figure's structure (blocks, heads, shapes): a different one builds a new figure. The image
    written is the one a new figure would give (tests compare the pixels). ``builds`` counts builds per tag.

    ``background=True`` (the callbacks' caches) hands ``build`` / ``update`` to the figure process (a separate,
    lowest-priority process, shared by all caches) and returns at once; ``build`` and ``update`` must then be
    picklable and light: ``functools.partial`` of :mod:`vitlab.figures` functions with numpy arrays. The images
    are written in order, each with the wall time of its ``add``, by the next ``add`` after they are drawn and
    by :meth:`flush` (called by :meth:`clear`), which waits for all of them and raises the first error a figure
    met. An image finished after its writer was closed (a run that stopped on an error) is dropped, not written
    to a reopened event file.
    """

    def __init__(self, background: bool = False) -> None:
        from vitlab.figures import FigureStore

        self._store = FigureStore()  # in this process (background=False)
        self._background = background
        self._pool = None  # the figure process while this cache uses it
        self._key: Any = None
        self._pending: collections.deque = collections.deque()  # (future, writer, tag, step, walltime, asked, build, update, layout)
        self.builds: collections.Counter = collections.Counter()
        self.drawn_by: set[int] = set()  # process ids that drew this cache's figures

    def add(self, writer, tag: str, step: int, build, update, layout: Any = None) -> None:
        """Write what ``writer.add_figure(tag, fig, step)`` writes, ``fig = build()`` the first time, then ``update(fig)``."""
        if not self._background:
            png, built = self._store.render(tag, build, update, layout)
            self._wrote(writer, tag, step, png, built, os.getpid(), None)
            return
        if self._pool is None:
            self._pool = _figure_process_started()
            self._key = (os.getpid(), next(_CACHE_IDS))
            _ACTIVE_CACHES.add(self)
        future = self._pool.submit("render", self._key, tag, build, update, layout)
        self._pending.append((future, writer, tag, step, time.time(), time.monotonic(), build, update, layout))
        self._write_done(wait=False)

    def _write_done(self, wait: bool) -> None:
        """Write the drawn images at the head of the queue; when ``wait``, all of them: a figure the figure process
        has not drawn when it has answered nothing for :data:`FIGURE_PATIENCE_S` since the figure was asked for
        and since it was last resumed (on a busy machine it gets almost no CPU) is drawn here, and so are the
        ones after it."""
        error = None
        stalled = False
        while self._pending and (wait or self._pending[0][0].done()):
            future, writer, tag, step, walltime, asked, build, update, layout = self._pending.popleft()
            try:
                while not future.done() and not stalled:  # wait while the figure process answers
                    since = max(asked, self._pool.last_answer, self._pool.resumed) if self._pool is not None else asked
                    try:
                        future.result(timeout=max(since + FIGURE_PATIENCE_S - time.monotonic(), 0.0))
                    except TimeoutError:
                        stalled = self._pool is None or self._pool.last_answer <= since
                if not future.done():
                    raise TimeoutError
                png, built, pid = future.result()
            except TimeoutError:  # (its late answer is ignored; its own copy of the figure stays up to date)
                try:
                    png, built = self._store.render(tag, build, update, layout)
                except Exception as exc:  # noqa: BLE001
                    error = error or exc
                    continue
                pid = os.getpid()
            except Exception as exc:  # noqa: BLE001  (raised by flush, after the other images are written)
                error = error or exc
                continue
            self._wrote(writer, tag, step, png, built, pid, walltime)
        if error is not None:
            raise error

    def _wrote(self, writer, tag: str, step: int, png: bytes, built: bool, pid: int, walltime: float | None) -> None:
        self.builds[tag] += built
        self.drawn_by.add(pid)
        if getattr(writer, "all_writers", True) is None:
            return  # the writer was closed (the run stopped): nothing is written after it
        write_png(writer, tag, png, step, walltime)

    def flush(self) -> None:
        """Wait until every image added is written; raise the first error a figure met."""
        if self._pool is not None:
            self._pool.resume()  # (paused during training steps)
        self._write_done(wait=True)

    def clear(self) -> None:
        try:
            self.flush()
        finally:
            self._store = type(self._store)()
            if self._pool is not None:
                self._pool.submit("forget", self._key)
                self._pool = None
                _ACTIVE_CACHES.discard(self)
                _figure_process_stopped()


def add_scalars(writer, values: Mapping[str, float], step: int) -> None:
    """``writer.add_scalar(tag, value, step)`` for every item, written as one event: a Summary holding one value per
    tag, as each ``add_scalar`` event holds one (TensorBoard reads them the same). The Q/K/V callbacks log
    about 200 scalars an epoch: 7 ms as separate events, 0.6 ms as one. A writer without TensorBoard's file
    writer gets the ``add_scalar`` calls."""
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()]), step)


def write_png(writer, tag: str, png: bytes, step: int, walltime: float | None = None) -> None:
    """An encoded RGB PNG as the image event ``writer.add_image`` would write for it."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step, walltime)


def writer_figures(writer) -> FigureCache:
    """The :class:`FigureCache` of a TensorBoard writer (one per run, for modules that keep no state of their own)."""
    cache = getattr(writer, "_vitlab_figures", None)
    if cache is None:
        cache = writer._vitlab_figures = FigureCache(background=True)
    return cache


def close_writer_figures(writer) -> None:
    """Write the images still pending in :func:`writer_figures` and free its figures (before the writer closes)."""
    cache = getattr(writer, "_vitlab_figures", None)
    if cache is not None:
        cache.clear()


def log_figure(writer, tag: str, step: int, build, update=None, cache: FigureCache | None = None, layout: Any = None) -> None:
    """``writer.add_figure(tag, build(), step)``, through ``cache`` (reusing the figure) when one is given."""
    if cache is None or update is None:
        writer.add_figure(tag, build(), step)
    else:
        cache.add(writer, tag, step, build, update, layout)


def figure_to_array(fig) -> np.ndarray:
    """Render a matplotlib figure to an (H, W, 3) uint8 array and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    buf.seek(0)
    from PIL import Image

    return np.asarray(Image.open(buf).convert("RGB"))


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a figure as PNG atomically and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)


def write_layout_once(trainer: Any) -> None:
    """Write one merged custom-scalars layout for every callback that offers ``tensorboard_layout()``.

    TensorBoard's custom-scalars plugin reads only the first layout of a run, so callbacks must not each
    write their own: the first one to log calls this and the layouts of all of them are merged.
    """
    writer = tensorboard_writer(trainer)
    if writer is None or getattr(writer, "_vitlab_layout_written", False):
        return
    layout: dict[str, Any] = {}
    for callback in getattr(trainer, "callbacks", []):
        make = getattr(callback, "tensorboard_layout", None)
        if callable(make):
            layout.update(make())
    if layout:  # at the current step, so a resumed run's copy is not a second point at step 0
        from torch.utils.tensorboard.summary import custom_scalars

        writer._get_file_writer().add_summary(custom_scalars(layout), logging_step(trainer))
    writer._vitlab_layout_written = True
