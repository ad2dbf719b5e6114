"""The figures vitlab logs during training, and the process that draws them beside it.

numpy and matplotlib only (no torch, no Lightning): the training run's figures are built, updated and drawn in
a separate low-priority process (:class:`FigureProcess`) that imports this module and nothing heavier. Drawing
them on a thread of the training process cost 4-5 s of a 27 s quickstart fit: matplotlib is Python code and held
the interpreter's lock between the training thread's operations.

A figure is described by two picklable callables: ``build()`` makes it, ``update(fig)`` puts new values in it
(``functools.partial`` of this module's functions with numpy arrays). :class:`FigureStore` keeps each tag's
figure, updates it instead of building it again, and rasterises only the artists marked :func:`redrawn` over a
background drawn once (blitting: matplotlib's ``copy_from_bbox`` / ``restore_region``). The images are the
ones new figures would give, pixel for pixel (tests compare them).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

MATRICES = ("q", "k", "v")
CONFUSION_TITLE = "validation confusion matrix"
WIDEST_TICK = "-0.000888"  # the widest colour-bar tick label "{:.3g}" writes (DejaVu Sans: all digits equally wide)


def as_array(values: Any) -> np.ndarray:
    """float64 numpy array of an array or a torch tensor (without importing torch)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=float)


def new_figure(figsize: tuple[float, float], dpi: int = 90):
    """A matplotlib ``Figure`` on its own Agg canvas, outside pyplot's figure list (not needed to render an image,
    and its registry is not thread-safe)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def redrawn(fig, *artists):
    """Mark artists of ``fig`` that change between a kept figure's images (see :class:`FigureStore`), in the
    order they are drawn; returns the first. Only the store reads the mark: the figure draws as any other."""
    fig.__dict__.setdefault("_vitlab_redrawn", []).extend(artists)
    return artists[0] if artists else None


def static_parts_depend_on(fig, key: Any) -> None:
    """The parts of ``fig`` not marked :func:`redrawn` (axes, ticks, labels) depend on ``key`` (e.g. axis limits):
    a :class:`FigureStore` draws them again when it changes, else only the redrawn artists."""
    fig.__dict__["_vitlab_static_key"] = key


# ---------------------------------------------------------------------------------------------------- heatmaps
def heatmap_figure(
    matrix: Any,
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
    data = as_array(matrix)
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
                ax.text(c, r, f"{data[r, c]:.3g}", ha="center", va="center", fontsize=7, color=_text_color(im, data[r, c]))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _layout_for_any_values(fig, cbar)
    redrawn(fig, im, *ax.spines.values(), *ax.texts, ax.title, cbar.ax)  # the rest stays: see FigureStore
    return fig


def _text_color(im, value: float) -> str:
    """White on the dark half of the colour map, black on the light half (a cell's count stays readable)."""
    if not np.isfinite(value):
        return "k"
    red, green, blue, _ = im.cmap(im.norm(value))
    return "w" if 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 else "k"


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


def update_heatmap(fig, matrix: Any, *, title: str = "", vmin: float | None = None, vmax: float | None = None) -> None:
    """Show new values (same shape) in a :func:`heatmap_figure`: the pixels a new one would have (tested)."""
    data = as_array(matrix)
    ax = fig.axes[0]
    im = ax.get_images()[0]
    masked = np.ma.masked_invalid(data)
    im.set_data(masked)
    # None: from the data, as imshow does (one set_clim: a colour bar resets a half-unset norm to [0, 1])
    im.set_clim(masked.min() if vmin is None else vmin, masked.max() if vmax is None else vmax)
    for text, value in zip(ax.texts, data.ravel()):  # annotate=True: one text per cell, row by row
        text.set_text(f"{value:.3g}")
        text.set_color(_text_color(im, value))
    ax.set_title(title, fontsize=9)  # (the layout holds for any values: see _layout_for_any_values)


def heatmap_update(matrix: Any, title: str, vmin: float | None, vmax: float | None, fig) -> None:
    """:func:`update_heatmap` with the figure last (``partial(heatmap_update, matrix, title, vmin, vmax)``)."""
    update_heatmap(fig, matrix, title=title, vmin=vmin, vmax=vmax)


def confusion_matrix_figure(confusion: Any, class_names: Sequence[str]):
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


# ---------------------------------------------------------------------------------------- Q/K/V drift, spectra
def local_drift_figure(block: str, grids: dict[str, list[Any]], step: int):
    """Seed 000's within-matrix map of one block: per metric (figure row) a heads x rows-in-head heatmap of
    Q | K | V (columns) on one colour scale from 0 to the metric's largest value, with its colour bar."""
    grids = {name: [as_array(g) for g in per_matrix] for name, per_matrix in grids.items()}
    fig = new_figure((7.2, 1.2 + 1.7 * len(grids)))
    axes = fig.subplots(len(grids), len(MATRICES), squeeze=False, sharex=True, sharey=True)
    fig.subplots_adjust(left=0.12, right=0.86, bottom=0.13, top=0.85, wspace=0.08, hspace=0.3)
    heads, head_dim = next(iter(grids.values()))[0].shape
    axes[0, 0].set_yticks(range(heads), labels=[f"h{h}" for h in range(heads)], fontsize=7)
    axes[0, 0].set_xticks(sorted({0, head_dim // 2, head_dim - 1}))  # explicit ticks: the locators cost ~0.1 s
    for r, (name, per_matrix) in enumerate(grids.items()):  # per_matrix: [(H, hd)] for Q, K, V
        vmax = max(float(g.max()) for g in per_matrix) or 1.0
        for c, (m, grid) in enumerate(zip(MATRICES, per_matrix)):
            ax = axes[r, c]
            im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0, vmax=vmax)
            redrawn(fig, im, *ax.spines.values())  # over the kept background; spines above the image
            ax.tick_params(labelsize=7, labelleft=c == 0, labelbottom=r == len(grids) - 1)
            if r == 0:
                ax.set_title(m.upper(), fontsize=10)
            if r == len(grids) - 1:
                ax.set_xlabel(f"row in head (0..{head_dim - 1})", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"{name.replace('_', ' ')}\nhead", fontsize=8)
        box = axes[r, -1].get_position()
        cax = fig.add_axes((box.x1 + 0.015, box.y0, 0.015, box.height), label="<colorbar>")
        cbar = fig.colorbar(im, cax=cax, ticks=[0.0, vmax / 2, vmax])
        cbar.set_label(f"{name.replace('_', ' ')} [0, {vmax:.3g}]", fontsize=7)
        cbar.ax.tick_params(labelsize=7)
        redrawn(fig, cax)
    redrawn(fig, fig.suptitle(f"{block}: per-row drift vs reference, step {step}", fontsize=10))
    return fig


def update_local_drift_figure(fig, block: str, grids: dict[str, list[Any]], step: int) -> None:
    """New grids (same shapes and metrics) in a :func:`local_drift_figure`: the pixels a new one would have."""
    panels = [ax for ax in fig.axes if ax.get_images() and ax.get_label() != "<colorbar>"]
    for r, (name, per_matrix) in enumerate(grids.items()):
        per_matrix = [as_array(g) for g in per_matrix]
        vmax = max(float(g.max()) for g in per_matrix) or 1.0
        for c, grid in enumerate(per_matrix):
            im = panels[r * len(MATRICES) + c].get_images()[0]
            im.set_data(grid)
            im.set_clim(0.0, vmax)
        cbar = im.colorbar
        cbar.set_ticks([0.0, vmax / 2, vmax])
        cbar.set_label(f"{name.replace('_', ' ')} [0, {vmax:.3g}]", fontsize=7)
    fig.suptitle(f"{block}: per-row drift vs reference, step {step}", fontsize=10)


def local_drift_update(block: str, grids: dict[str, list[Any]], step: int, fig) -> None:
    """:func:`update_local_drift_figure` with the figure last (for ``functools.partial``)."""
    update_local_drift_figure(fig, block, grids, step)


def stage_curves_figure(stage: str, curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Seed 002's Fig. 5 for one stage: symmetric-part eigenvalues, antisymmetric |lambda|, singular values.

    ``curves``: block -> (eigenvalues of the symmetric part, lambda of the antisymmetric part's +-i lambda pairs,
    singular values), of the head-summed W_Q W_K^T, each descending. The y ranges end on round values (ticks;
    decades on the log axis), so an update whose values stay within them redraws the curves only."""
    fig = new_figure((12, 3.4))
    axes = fig.subplots(1, 3)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(len(curves), 1)))
    for color, (block, (sym, asym, sv)) in zip(colors, curves.items()):
        label = block.split(".", 1)[1]
        sym, asym, sv = as_array(sym), as_array(asym), as_array(sv)
        axes[0].plot(np.arange(1, len(sym) + 1), sym, color=color, label=label, lw=1.2)
        axes[1].plot(np.arange(1, len(asym) + 1), asym, color=color, lw=1.2)[0].sticky_edges.y.append(0.0)  # lambda >= 0
        axes[2].semilogy(np.arange(1, len(sv) + 1), sv / max(sv[0], 1e-30), color=color, lw=1.2)[0].sticky_edges.y.append(1.0)
    axes[0].axhline(0.0, color="k", lw=0.6)
    axes[0].set_title("eigenvalues of sym. part (W_Q W_K^T)", fontsize=9)
    axes[1].set_title("antisym. part: lambda of +-i lambda pairs", fontsize=9)
    axes[2].set_title("singular values / largest", fontsize=9)
    for ax in axes:
        ax.set_xlabel("index")
    legend = axes[0].legend(fontsize=7, ncol=2, loc="upper right")  # fixed: "best" follows the curves
    fig.suptitle(f"{stage}: QK bilinear form, heads summed", fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.82, wspace=0.22)  # tight_layout costs ~0.4 s
    _round_y_limits(fig)
    for ax in axes:  # in drawing order: curves (and the zero line) under the spines, the legend on top
        redrawn(fig, *ax.lines, *ax.spines.values())
    redrawn(fig, legend)
    return fig


def _round_y_limits(fig) -> None:
    """y limits of a stage figure's three axes: the data's range with a 5 % margin, widened to the next ticks
    (matplotlib's ``round_numbers`` mode; whole decades on the log axis), not past 0 for the antisymmetric part's
    lambda nor past 1 for the singular values / largest (the curves' sticky edges). Its static parts depend on
    them."""
    axes = fig.axes[:3]
    for ax in axes:
        ax.viewLim  # noqa: B018  (the autoscaling plot() asked for, done now in the default mode: x limits)
    with matplotlib.rc_context({"axes.autolimit_mode": "round_numbers"}):
        for ax in axes:
            ax.relim()
            ax.autoscale_view(scalex=False)  # done at once (not when drawn, outside this mode)
    static_parts_depend_on(fig, tuple(ax.get_ylim() for ax in axes))


def update_stage_curves_figure(fig, curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """New curves (same blocks and sizes) in a :func:`stage_curves_figure`: the pixels a new one would have."""
    axes = fig.axes[:3]
    for i, values in enumerate(curves.values()):
        for ax, y in zip(axes, values):
            y = as_array(y)
            if ax is axes[2]:
                y = y / max(y[0], 1e-30)
            ax.lines[i].set_ydata(y)
    _round_y_limits(fig)


def stage_curves_update(curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], fig) -> None:
    """:func:`update_stage_curves_figure` with the figure last (for ``functools.partial``)."""
    update_stage_curves_figure(fig, curves)


# ------------------------------------------------------------------------------------------- keeping, drawing
class _Kept:
    """A kept figure: its canvas, the layout it was built for, its redrawn artists and static background."""

    __slots__ = ("canvas", "layout", "animated", "background", "static_key", "backgrounds")

    def __init__(self, canvas, layout: Any) -> None:
        self.canvas, self.layout = canvas, layout
        self.animated = list(canvas.figure.__dict__.get("_vitlab_redrawn", ()))  # see redrawn()
        self.background = None
        self.static_key = None  # see static_parts_depend_on()
        self.backgrounds = 0  # how many times the static background was drawn


class FigureStore:
    """Figures kept by tag: ``render`` builds a tag's figure the first time (or for a new ``layout``), else
    updates it, and returns its image as PNG bytes; ``builds`` counts the builds per tag."""

    def __init__(self) -> None:
        self.figures: dict[str, _Kept] = {}
        self.builds: dict[str, int] = {}

    def render(self, tag: str, build: Callable[[], Any], update: Callable[[Any], None], layout: Any = None) -> tuple[bytes, bool]:
        """PNG of the tag's figure with the new values, and whether it was built."""
        kept = self.figures.get(tag)
        built = kept is None or kept.layout != layout
        if built:
            fig = build()
            if fig.canvas.manager is not None:  # a pyplot figure: kept here, not among pyplot's open figures
                import matplotlib.pyplot as plt

                plt.close(fig)
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)  # keeps text metrics
            self.figures[tag] = kept = _Kept(canvas, layout)
            self.builds[tag] = self.builds.get(tag, 0) + 1
        else:
            update(kept.canvas.figure)
        _draw(kept)
        return png(np.asarray(kept.canvas.buffer_rgba())[:, :, :3]), built


def _draw(kept: _Kept) -> None:
    """Rasterise a kept figure: whole, or its redrawn artists over the kept static background."""
    canvas, fig = kept.canvas, kept.canvas.figure
    if not kept.animated:
        canvas.draw()  # what add_figure does, on a new canvas each time
        return
    static_key = fig.__dict__.get("_vitlab_static_key")
    if kept.background is None or static_key != kept.static_key:
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
        kept.static_key = static_key
        kept.backgrounds += 1
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


def png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image, encoded as TensorBoard's ``add_image`` encodes it (PIL)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------- the figure process
_STORES: dict[Any, FigureStore] = {}  # in the figure process: one store per cache of the training process


def _process_init() -> None:
    """The figure process draws with the cycles training leaves: Linux's ``SCHED_IDLE`` policy (it runs only when
    no other task wants a core), else the largest nice value. On a busy machine it may barely run: a flush that
    waits too long draws the rest in the training process (see ``vitlab.tblog.FigureCache``). Ctrl-C in a
    terminal reaches the whole process group: the training process handles it (and ends this one when done)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19)
    except (AttributeError, OSError):
        pass


_PAUSABLE = sys.platform.startswith("linux")  # FigureProcess.pause: SIGSTOP, and the parent-death signal


def _end_with_parent() -> None:
    """Linux: the kernel kills this process when the training process ends, even a stopped one (see
    :meth:`FigureProcess.pause`), which would never read the end of its input: a training run killed with
    SIGKILL while its figure process was paused left it behind."""
    if not _PAUSABLE:
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get("VITLAB_FIGURE_PARENT")
    if parent and os.getppid() != int(parent):  # it ended before the line above
        os._exit(0)


def _process_render(cache: Any, tag: str, build, update, layout: Any) -> tuple[bytes, bool, int]:
    png_bytes, built = _STORES.setdefault(cache, FigureStore()).render(tag, build, update, layout)
    return png_bytes, built, os.getpid()


def _process_forget(cache: Any) -> None:
    _STORES.pop(cache, None)


def _process_warm_up() -> None:
    """Draw one figure of each kind once (fonts, text layout, colour bars, legends, log-axis labels, PNG
    encoding: costs a process pays on its first figures), before any figure is asked for."""
    values = np.linspace(0.0, 1.0, 16).reshape(2, 8)
    store = FigureStore()
    curves = {"stage0.block0": (values[0] - 0.5, values[1][:4], values[1] + 0.1)}
    local = {"cosine_distance": [values, values, values]}
    store.render("local", lambda: local_drift_figure("stage0.block0", local, 0), None)
    store.render("stage", lambda: stage_curves_figure("stage0", curves), None)
    store.render("heatmap", lambda: heatmap_figure(values, title="t", xlabel="x", ylabel="y", annotate=True,
                                                   xticklabels=list("abcdefgh"), yticklabels=["a", "b"], colorbar_label="c"), None)


_CALLS = {"render": _process_render, "forget": _process_forget, "warm_up": _process_warm_up}


def _send(stream, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    size = int.from_bytes(header, "little")
    return pickle.loads(stream.read(size))


def serve() -> None:
    """The figure process's loop (``python -c "from vitlab.figures import serve; serve()"``): read
    ``(job id, call, args)`` messages from stdin, answer ``(job id, ok, result or exception)`` on stdout."""
    out = os.fdopen(os.dup(1), "wb")  # the answers; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _process_init()
    source = sys.stdin.buffer
    while True:
        try:
            job, call, args = _receive(source)
        except EOFError:
            return
        try:
            answer = (job, True, _CALLS[call](*args))
        except Exception as exc:  # noqa: BLE001  (sent back: raised where the figure was asked for)
            answer = (job, False, exc)
        try:
            _send(out, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
            _send(out, (job, False, RuntimeError(f"{type(answer[2]).__name__}: {answer[2]}")))


class FigureProcess:
    """A ``python`` child process running :func:`serve`: :meth:`submit` returns a ``concurrent.futures.Future``.

    A plain subprocess, not ``multiprocessing``: its spawn method runs the user's ``__main__`` script again in the
    child (a training script without an ``if __name__ == "__main__"`` guard would train twice), and a fork of a
    training process copies its threads' locks (GNU OpenMP is not fork-safe). Jobs are written by a thread, so
    :meth:`submit` never waits for the child to read them."""

    def __init__(self) -> None:
        import itertools
        import queue
        import subprocess
        import threading
        from pathlib import Path

        package_root = str(Path(__file__).resolve().parents[1])  # vitlab importable in the child, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
               # one thread: numpy's BLAS threads would be made before this process lowers its priority (threads
               # inherit it), at normal priority beside training, and figures need no parallel BLAS
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "VITLAB_FIGURE_PARENT": str(os.getpid())}
        self._proc = subprocess.Popen([sys.executable, "-c", "from vitlab.figures import serve; serve()"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._ids = itertools.count()
        self.paused = False
        self.resumed = 0.0  # time.monotonic() of the last resume()
        self.last_answer = 0.0  # time.monotonic() of the child's last answer
        self._futures: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write, name="vitlab-figure-jobs", daemon=True)
        self._reader = threading.Thread(target=self._read, name="vitlab-figure-images", daemon=True)
        self._writer.start()
        self._reader.start()

    def submit(self, call: str, *args: Any):
        from concurrent.futures import Future

        future: Future = Future()
        with self._lock:
            job = next(self._ids)
            self._futures[job] = future
        self._jobs.put((job, call, args))
        return future

    def _write(self) -> None:
        while (message := self._jobs.get()) is not None:
            try:
                _send(self._proc.stdin, message)
            except (BrokenPipeError, OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
                self._fail(message[0], exc)
        try:
            self._proc.stdin.close()  # the child ends when its input does
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                job, ok, value = _receive(self._proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            self.last_answer = time.monotonic()
            with self._lock:
                future = self._futures.pop(job, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(value)
        code = self._proc.wait()
        with self._lock:
            pending, self._futures = list(self._futures.values()), {}
        for future in pending:
            future.set_exception(RuntimeError(f"vitlab's figure process ended (exit code {code}) before drawing this figure"))

    def _fail(self, job: int, exc: BaseException) -> None:
        with self._lock:
            future = self._futures.pop(job, None)
        if future is not None:
            future.set_exception(RuntimeError(f"could not send a figure to vitlab's figure process: {type(exc).__name__}: {exc}"))

    def pause(self) -> None:
        """Stop the child (``SIGSTOP``) until :meth:`resume`: the training process pauses it during its steps.

        At idle priority it still cost the steps about 1.5 s of the quickstart's 24 s fit (each time a torch
        thread waited for its core back, and in the caches it left cold); stopped during the steps, it draws
        between them (loading the next batch, logging, epoch ends, checkpoints).
        Linux only, where the child dies with its parent (see :func:`_end_with_parent`): elsewhere a stopped child
        of a killed training process would be left behind."""
        import signal

        if not self.paused and _PAUSABLE and self._proc.poll() is None:
            self.paused = True
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused child run again (``SIGCONT``)."""
        import signal

        if self.paused:
            self.paused = False
            self.resumed = time.monotonic()
            try:
                os.kill(self._proc.pid, signal.SIGCONT)
            except OSError:  # it has ended
                pass

    def shutdown(self) -> None:
        """End the child now. Its caller has every image it waits for (written, or drawn in the training process
        when the child was too slow): jobs the child still holds are stale, and waiting until it has read them
        all took minutes on a busy machine."""
        try:
            self._proc.kill()
        except OSError:
            pass
        self._jobs.put(None)  # the job thread ends (its blocked write fails once the child is gone)
