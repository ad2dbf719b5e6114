"""The one place vitlab writes outputs: TensorBoard writer lookup, figures, atomic files and tables.

Callbacks and probes gather tensors through :mod:`vitlab.models`, compute through :mod:`vitlab.analysis`
and write through these helpers, so every output is written the same (atomic, rank-zero) way.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


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

    ``None`` picks N so a run draws about 6 sets (TensorBoard keeps up to 10 images per tag): a
    matplotlib figure costs about as much as several training steps of a small model.
    """
    max_epochs = getattr(trainer, "max_epochs", None) or 0
    if every_n_epochs is None:
        every_n_epochs = max(1, math.ceil(max_epochs / 6))
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


def new_figure(figsize: tuple[float, float], dpi: int = 90):
    """A matplotlib ``Figure`` on its own Agg canvas, outside pyplot's figure list.

    Not through pyplot: vitlab's figures are built and drawn on a worker thread beside training, and pyplot's
    global figure registry is not thread-safe (nor needed to render to an image).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def redrawn(fig, *artists):
    """Mark artists of ``fig`` that change between a cached figure's images (see :class:`FigureCache`), in the
    order they are drawn; returns the first. Only the cache reads the mark: the figure draws as any other."""
    fig.__dict__.setdefault("_vitlab_redrawn", []).extend(artists)
    return artists[0] if artists else None


def heatmap_figure(
    matrix: torch.Tensor | np.ndarray,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    cmap: str = "viridis",
    annotate: bool = False,
    colorbar_label: str = "",
    figsize: tuple[float, float] | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    nan_color: str = "0.75",
):
    """A matplotlib heatmap of a 2-D array (rows top to bottom; NaN cells in ``nan_color``), for ``add_figure``."""
    data = matrix.detach().cpu().double().numpy() if isinstance(matrix, torch.Tensor) else np.asarray(matrix, dtype=float)
    rows, cols = data.shape
    if figsize is None:
        figsize = (min(2.0 + 0.35 * cols, 14.0) if xticklabels is not None else 7.0, min(1.5 + 0.3 * rows, 12.0) if yticklabels is not None else 4.0)
    fig = new_figure(figsize)
    ax = fig.subplots()
    colormap = matplotlib.colormaps[cmap].with_extremes(bad=nan_color)
    im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap=colormap, interpolation="nearest", vmin=vmin, vmax=vmax)
    cbar = fig.colorbar(im, ax=ax)
    cbar.formatter = _colorbar_formatter()
    if colorbar_label:
        cbar.set_label(colorbar_label)
    if xticklabels is not None:
        long_labels = cols > 6 or max((len(str(t)) for t in xticklabels), default=0) > 6
        ax.set_xticks(range(cols), labels=list(xticklabels), rotation=90 if long_labels else 0, fontsize=7)
    if yticklabels is not None:
        ax.set_yticks(range(rows), labels=list(yticklabels), fontsize=7)
    if annotate:
        for r in range(rows):
            for c in range(cols):
                ax.text(c, r, f"{data[r, c]:.3g}", ha="center", va="center", fontsize=7, color="w")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _layout_for_any_values(fig, cbar)
    redrawn(fig, im, *ax.spines.values(), *ax.texts, ax.title, cbar.ax)  # the rest stays: see FigureCache
    return fig


WIDEST_TICK = "-0.000888"  # the widest colour-bar tick label "{:.3g}" writes (DejaVu Sans: all digits equally wide)


def _colorbar_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, pos: f"{value:.3g}")


def _layout_for_any_values(fig, cbar) -> None:
    """``tight_layout`` with room for the widest tick label the colour bar can show, so that the layout does
    not depend on the values: an updated figure keeps it (no new layout: 8 ms) and its axes stay where
    they were (its static parts need no redrawing). Titles do not count (their width is ignored by it)."""
    from matplotlib.ticker import FuncFormatter

    formatter = cbar.formatter
    cbar.formatter = FuncFormatter(lambda value, pos: WIDEST_TICK)
    fig.tight_layout()
    cbar.formatter = formatter


def update_heatmap(fig, matrix: torch.Tensor | np.ndarray, *, title: str = "", vmin: float | None = None, vmax: float | None = None) -> None:
    """Show new values (same shape) in a :func:`heatmap_figure`: the pixels a new one would have (tested)."""
    data = matrix.detach().cpu().double().numpy() if isinstance(matrix, torch.Tensor) else np.asarray(matrix, dtype=float)
    ax = fig.axes[0]
    im = ax.get_images()[0]
    masked = np.ma.masked_invalid(data)
    im.set_data(masked)
    # None: from the data, as imshow does (one set_clim: a colour bar resets a half-unset norm to [0, 1])
    im.set_clim(masked.min() if vmin is None else vmin, masked.max() if vmax is None else vmax)
    for text, value in zip(ax.texts, data.ravel()):  # annotate=True: one text per cell, row by row
        text.set_text(f"{value:.3g}")
    ax.set_title(title, fontsize=9)  # (the layout holds for any values: see _layout_for_any_values)


GIL_SWITCH_S = 0.0005  # GIL switch interval while figures are drawn beside training (CPython's default: 0.005)
_FIGURE_LOCK = threading.Lock()
_FIGURE_THREAD: dict[str, Any] = {"pool": None, "users": 0, "saved": 0.005}  # the shared thread, its caches, the interval


def _figure_thread_started():
    """The one figure thread of the process (started for its first user), with a lowered GIL switch interval."""
    with _FIGURE_LOCK:
        if _FIGURE_THREAD["users"] == 0:
            from concurrent.futures import ThreadPoolExecutor

            _FIGURE_THREAD["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_FIGURE_THREAD["saved"], GIL_SWITCH_S))
            _FIGURE_THREAD["pool"] = ThreadPoolExecutor(1, thread_name_prefix="vitlab-figures", initializer=_background_priority)
        _FIGURE_THREAD["users"] += 1
        return _FIGURE_THREAD["pool"]


def _background_priority() -> None:
    """Lowest CPU priority for the calling thread (Linux: a thread id is a ``PRIO_PROCESS`` target)."""
    import os

    if os.environ.get("VITLAB_FIGURE_NICE", "1") == "0":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass


def _figure_thread_stopped() -> None:
    """One user less; the last one stops the thread and restores the interval the process had."""
    with _FIGURE_LOCK:
        _FIGURE_THREAD["users"] -= 1
        if _FIGURE_THREAD["users"] == 0:
            _FIGURE_THREAD["pool"].shutdown(wait=True)
            _FIGURE_THREAD["pool"] = None
            sys.setswitchinterval(_FIGURE_THREAD["saved"])


def flush_figures() -> None:
    """Wait for every figure queued on the figure thread so far, of every cache (as ``writer.flush()`` waits for
    the events queued so far). Images still queued when a process is killed are lost, like unflushed events."""
    with _FIGURE_LOCK:
        pool = _FIGURE_THREAD["pool"]
    if pool is not None:
        pool.submit(int).result()  # the thread runs its queue in order


class _Kept:
    """A cached figure: its canvas, the layout it was built for, and its static background once blitted."""

    __slots__ = ("canvas", "layout", "animated", "background")

    def __init__(self, canvas, layout: Any) -> None:
        self.canvas, self.layout = canvas, layout
        self.animated = list(canvas.figure.__dict__.get("_vitlab_redrawn", ()))  # see redrawn()
        self.background = None


class FigureCache:
    """Figures kept between the epochs that draw them, one per TensorBoard tag, updated instead of rebuilt.

    Building a matplotlib figure (axes, ticks, colour bars, layout) costs about as much as drawing it; a callback
    that logs the same figure every few epochs keeps it here and only changes its data, titles and colour scales.
    ``layout`` describes what fixes the figure's structure (blocks, heads, shapes): a different one builds a new
    figure. The image written is the one a new figure would give (tests compare the pixels).

    Blitting (matplotlib's ``copy_from_bbox`` / ``restore_region``): when a figure marks the artists that change
    with :func:`redrawn` (its images, colour-bar axes, titles), everything else is rasterised once, and each
    image restores that background and draws only the marked artists, in the order marked. Such a figure must
    keep everything else unchanged in ``update`` (fixed layout, fixed ticks).

    ``background=True`` (the callbacks' caches) builds, updates, draws and writes each figure on the process's one
    figure thread while training goes on: ``build`` and ``update`` must carry their data (no late-bound loop
    variables), and run on that thread. Images of a cache are written in the order they were added; :meth:`flush`
    (called by :meth:`clear`) waits for them and raises the first error a figure met. While any such cache is in
    use the interpreter's GIL switch interval is at most :data:`GIL_SWITCH_S` (restored when the last is cleared):
    the training thread takes the GIL back after each of a step's thousands of torch operations, and with
    CPython's default of 5 ms a drawing thread in matplotlib's Python code held it long enough to stall them
    (quickstart fit 35.7-41.8 s against 33.7-34.4 s). An image finished after its writer was closed (a run that
    stopped on an error) is dropped, not written to a reopened event file.
    """

    def __init__(self, background: bool = False) -> None:
        self._figures: dict[str, _Kept] = {}
        self._background = background
        self._pool = None  # the shared figure thread while this cache uses it
        self._pending: list[Any] = []  # Futures of the images added and not yet known to be written

    def add(self, writer, tag: str, step: int, build, update, layout: Any = None) -> None:
        """Write what ``writer.add_figure(tag, fig, step)`` writes, ``fig = build()`` the first time, then ``update(fig)``."""
        if not self._background:
            self._add_now(writer, tag, step, build, update, layout)
            return
        if self._pool is None:
            self._pool = _figure_thread_started()
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._pool.submit(self._add_now, writer, tag, step, build, update, layout))

    def _add_now(self, writer, tag: str, step: int, build, update, layout: Any) -> None:
        kept = self._figures.get(tag)
        if kept is None or kept.layout != layout:
            fig = build()
            if fig.canvas.manager is not None:  # a pyplot figure: kept here, not among pyplot's open figures
                plt.close(fig)
            canvas = fig.canvas if isinstance(fig.canvas, _agg_canvas()) else _agg_canvas()(fig)  # its renderer keeps text metrics
            self._figures[tag] = kept = _Kept(canvas, layout)
        else:
            update(kept.canvas.figure)
        if self._background and getattr(writer, "all_writers", True) is None:
            return  # the writer was closed (the run stopped): nothing is written after it
        _draw(kept)
        _write(kept.canvas, writer, tag, step)

    def flush(self) -> None:
        """Wait until every image added is written; raise the first error a background figure met."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        for error in errors:
            if error is not None:
                raise error

    def clear(self) -> None:
        try:
            self.flush()
        finally:
            self._figures.clear()
            if self._pool is not None:
                self._pool = None
                _figure_thread_stopped()


def _agg_canvas():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return FigureCanvasAgg


def _draw(kept: _Kept) -> None:
    """Rasterise a cached figure: whole, or its animated artists over the kept static background."""
    canvas, fig = kept.canvas, kept.canvas.figure
    if not kept.animated:
        canvas.draw()  # what add_figure does, on a new canvas each time
        return
    if kept.background is None:
        from matplotlib.text import Text

        # left out of the background: texts drawn transparent (a hidden axes title has no extent, and the
        # title placement would move it), the rest hidden
        texts = [(a, a.get_alpha()) for a in kept.animated if isinstance(a, Text)]
        others = [(a, a.get_visible()) for a in kept.animated if not isinstance(a, Text)]
        for artist, _ in texts:
            artist.set_alpha(0.0)
        for artist, _ in others:
            artist.set_visible(False)
        canvas.draw()
        kept.background = canvas.copy_from_bbox(fig.bbox)
        for artist, alpha in texts:
            artist.set_alpha(alpha)
        for artist, shown in others:
            artist.set_visible(shown)
    else:
        canvas.restore_region(kept.background)
    renderer = canvas.get_renderer()
    for artist in kept.animated:
        if artist.get_visible():
            artist.draw(renderer)


def _write(canvas, writer, tag: str, step: int) -> None:
    image = np.moveaxis(np.asarray(canvas.buffer_rgba())[:, :, :3], 2, 0)  # (3, H, W)
    writer.add_image(tag, image, step, dataformats="CHW")


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


CONFUSION_TITLE = "validation confusion matrix"


def confusion_matrix_figure(confusion: torch.Tensor, class_names: Sequence[str]):
    """Confusion matrix (rows: true class, columns: predicted) with counts written in each cell."""
    return heatmap_figure(
        confusion,
        title=CONFUSION_TITLE,
        xlabel="predicted",
        ylabel="true",
        xticklabels=class_names,
        yticklabels=class_names,
        cmap="Blues",
        annotate=True,
        figsize=(2.5 + 0.6 * len(class_names), 2.0 + 0.5 * len(class_names)),
    )


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
