"""The figures vitlab logs, as picklable objects, and the store that keeps and redraws them.

numpy and matplotlib only (no torch, no Lightning), so that the figure worker process (:mod:`vitlab.runtime`)
imports nothing heavier. A figure kind is one object (:class:`Heatmap`, :class:`LocalDrift`,
:class:`StageCurves`, :class:`SegmentationOverlay`) holding its values as numpy arrays; ``build()`` makes the
matplotlib figure, ``update(fig)`` puts the object's values into a figure built for the same ``layout()``.
:class:`FigureStore` keeps each tag's figure between the epochs that draw it, updates it instead of building
it again, and rasterises only the artists marked :func:`redrawn` over a background drawn once (blitting:
matplotlib's ``copy_from_bbox`` / ``restore_region``). The images are those new figures would give, pixel for
pixel (tested). Why both reuse and a separate process: ``docs/performance.md``.
"""

from __future__ import annotations

import io
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

MATRICES = ("q", "k", "v")
CONFUSION_TITLE = "validation confusion matrix"
OVERLAY_ALPHA = 0.45  # opacity of a label map's colours over its image
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


# ---------------------------------------------------------------------------------------- Q/K/V drift, spectra
def local_drift_figure(block: str, grids: dict[str, list[Any]], step: int):
    """The Drotos poster's within-matrix map of one block: per metric (figure row) a heads x rows-in-head heatmap of
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


def stage_curves_figure(stage: str, curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Philip et al.'s Fig. 5 for one stage: symmetric-part eigenvalues, antisymmetric |lambda|, singular values.

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
    for ax, ylabel in zip(axes, ("eigenvalue", "lambda", "sigma_i / sigma_1")):
        ax.set_xlabel("index (descending)")
        ax.set_ylabel(ylabel, fontsize=8)
    legend = axes[0].legend(fontsize=7, ncol=2, loc="upper right")  # fixed: "best" follows the curves
    fig.suptitle(f"{stage}: QK bilinear form, heads summed", fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.15, top=0.82, wspace=0.26)  # tight_layout costs ~0.4 s
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


# ------------------------------------------------------------------------------------------------ image tables
def image_table_figure(
    cells: Sequence[Sequence[Any]],
    *,
    titles: Sequence[Sequence[str]] | None = None,
    columns: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    notes: Sequence[Sequence[str]] | None = None,
    title: str = "",
    panel_px: int = 128,
    dpi: int = 72,
    legend: Sequence[tuple[str, Any]] = (),
):
    """Images in rows and columns, each named: a title over each cell (``titles``, or ``columns`` over the first
    row's), a label left of each row, a note under each cell (its figures: errors, logits), a title over all, and
    under it a ``legend`` of (label, colour) patches (the colours of overlays).

    ``cells``: rows of (H, W) gray or (H, W, 3) RGB arrays in [0, 1], drawn as they are (gray from black at 0 to
    white at 1, nearest-neighbour), each in a ``panel_px`` square; ``None`` leaves a cell empty. Laid out by hand
    (constrained layout is 10x slower): the panels keep their size whatever the text around them.
    """
    import textwrap

    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows, cols = len(cells), max((len(row) for row in cells), default=0)
    if titles is None and columns is not None:
        titles = [list(columns)] + [[""] * cols for _ in range(rows - 1)]
    chars = max(8, int(panel_px / 5.2))  # characters of 8 pt text across a panel
    wrap = lambda text, width=chars: "\n".join(textwrap.fill(line, width) for line in str(text).split("\n")) if text else ""  # noqa: E731
    titles = [[wrap(t) for t in row] for row in titles] if titles is not None else None
    notes = [[wrap(n, int(chars * 8 / 7)) for n in row] for row in notes] if notes is not None else None
    lines = lambda grid, r: max((t.count("\n") + 1 for t in grid[r] if t), default=0) if grid is not None and r < len(grid) else 0  # noqa: E731
    panel, gap = panel_px / dpi, 0.08
    head = [0.16 * lines(titles, r) + (0.04 if lines(titles, r) else 0) for r in range(rows)]  # inches over each row
    foot = [0.14 * lines(notes, r) + (0.04 if lines(notes, r) else 0) for r in range(rows)]  # and under it
    left = 0.15 + (0.16 * max(label.count("\n") + 1 for label in row_labels) if row_labels else 0)
    width = left + cols * panel + (cols - 1) * gap + 0.15
    wrapped_title = textwrap.fill(title, max(20, int(width * dpi / 6.2))) if title else ""
    top = 0.1 + (0.17 * (wrapped_title.count("\n") + 1) if title else 0) + (0.3 if legend else 0)
    height = top + sum(head) + rows * panel + sum(foot) + (rows - 1) * gap + 0.1
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    y = height - top
    for r, row in enumerate(cells):
        y -= head[r] + panel
        for c, image in enumerate(row):
            if image is None:
                continue
            ax = fig.add_axes(((left + c * (panel + gap)) / width, y / height, panel / width, panel / height))
            data = np.asarray(image, dtype=float)
            ax.imshow(np.clip(data, 0.0, 1.0), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if titles is not None and r < len(titles) and c < len(titles[r]) and titles[r][c]:
                ax.set_title(titles[r][c], fontsize=8, pad=2)
            if notes is not None and r < len(notes) and c < len(notes[r]) and notes[r][c]:
                ax.set_xlabel(notes[r][c], fontsize=7, labelpad=2)
            if c == 0 and row_labels:
                ax.set_ylabel(row_labels[r], fontsize=8, labelpad=2)
        y -= foot[r] + gap
    if wrapped_title:
        fig.suptitle(wrapped_title, fontsize=9, y=1 - 0.06 / height, va="top")
    if legend:
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=colour, label=label) for label, colour in legend]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, (height - top + 0.02) / height), handlelength=1.2, borderaxespad=0)
    return fig


def chw_to_image(tensor: Any) -> np.ndarray:
    """(C, H, W) in [0, 1] (a tensor or an array) -> (H, W) gray for one channel, (H, W, 3) for three, the channel
    mean otherwise: what :func:`image_table_figure` draws."""
    data = as_array(tensor)
    return data[0] if data.shape[0] == 1 else data.transpose(1, 2, 0) if data.shape[0] == 3 else data.mean(0)


# ------------------------------------------------------------------------------------------- keeping, drawing
# ---------------------------------------------------------------------------------------------- figure kinds
class Figure:
    """A figure kind: values (numpy arrays, plain types: picklable for the figure worker) and how to draw them.

    ``layout()`` names what fixes the figure's structure (blocks, heads, shapes, tick labels): a kept figure is
    updated in place only for an equal layout; ``None`` (the default) builds a new figure every time.
    ``shareable``: the layout alone fixes every pixel an update does not redraw, so one kept figure may serve
    several tags (not so for a ``tight_layout`` figure whose title width moves its axes: :class:`Heatmap`)."""

    shareable = False

    def layout(self) -> Hashable | None:
        return None

    def build(self):
        raise NotImplementedError

    def update(self, fig) -> None:
        raise NotImplementedError


@dataclass
class Heatmap(Figure):
    """A 2-D array as a labelled heatmap with a colour bar (rows top to bottom; NaN cells in ``nan_color``);
    ``annotate`` writes each cell's value. ``vmin`` / ``vmax`` None: the data's range."""

    matrix: Any
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    xticklabels: Sequence[str] | None = None
    yticklabels: Sequence[str] | None = None
    cmap: str = "viridis"
    annotate: bool = False
    colorbar_label: str = ""
    figsize: tuple[float, float] | None = None
    vmin: float | None = None
    vmax: float | None = None
    nan_color: str = "0.75"

    def layout(self) -> Hashable:
        ticks = tuple(tuple(t) if t is not None else None for t in (self.xticklabels, self.yticklabels))
        return (np.shape(self.matrix), ticks, self.xlabel, self.ylabel, self.cmap, self.annotate, self.colorbar_label,
                self.figsize, self.nan_color)

    def build(self):
        return heatmap_figure(self.matrix, title=self.title, xlabel=self.xlabel, ylabel=self.ylabel, xticklabels=self.xticklabels,
                              yticklabels=self.yticklabels, cmap=self.cmap, annotate=self.annotate, colorbar_label=self.colorbar_label,
                              figsize=self.figsize, vmin=self.vmin, vmax=self.vmax, nan_color=self.nan_color)

    def update(self, fig) -> None:
        update_heatmap(fig, self.matrix, title=self.title, vmin=self.vmin, vmax=self.vmax)


def confusion_matrix(counts: Any, class_names: Sequence[str]) -> Heatmap:
    """Confusion matrix (rows: true class, columns: predicted) with the count written in each cell."""
    names = list(class_names)
    return Heatmap(as_array(counts), title=CONFUSION_TITLE, xlabel="predicted", ylabel="true", xticklabels=names,
                   yticklabels=names, cmap="Blues", annotate=True, figsize=(2.5 + 0.6 * len(names), 2.0 + 0.5 * len(names)))


@dataclass
class LocalDrift(Figure):
    """The Drotos poster's within-matrix map of one block: ``grids`` metric -> [(heads, rows in head)] for Q, K, V."""

    block: str
    grids: dict[str, list[Any]]
    step: int

    shareable = True  # fixed axes positions (subplots_adjust); the block's name is in the redrawn suptitle

    def layout(self) -> Hashable:
        return tuple(self.grids), np.shape(next(iter(self.grids.values()))[0])

    def build(self):
        return local_drift_figure(self.block, self.grids, self.step)

    def update(self, fig) -> None:
        update_local_drift_figure(fig, self.block, self.grids, self.step)


@dataclass
class StageCurves(Figure):
    """Philip et al.'s Fig. 5 for one stage: ``curves`` block -> (symmetric-part eigenvalues, antisymmetric lambda,
    singular values) of the head-summed W_Q W_K^T, each descending."""

    stage: str
    curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]

    def layout(self) -> Hashable:
        return tuple((b, *(len(v) for v in values)) for b, values in self.curves.items())

    def build(self):
        return stage_curves_figure(self.stage, self.curves)

    def update(self, fig) -> None:
        update_stage_curves_figure(fig, self.curves)


def class_names_upto(class_names: Sequence[str], top: int) -> list[str]:
    """Names of the foreground classes 1 .. max(``top``, the names given): ``class_names[k - 1]``, else "class k"."""
    return [class_names[k - 1] if k <= len(class_names) else f"class {k}" for k in range(1, max(top, len(class_names)) + 1)]


@dataclass
class SegmentationOverlay(Figure):
    """Rows of ``image | ground truth | prediction``: ``images`` (N, S, S) first channel, each scaled from its own
    minimum (black) to its maximum (white), ``truth`` / ``pred`` (N, S, S) label maps, overlaid in colour (class i
    in tab10 colour i, named in the legend); over each row's prediction the Dice of each class in the row's truth
    or prediction, on the pixels shown. ``view``: what the rows show (a volume's slice), in the title."""

    images: np.ndarray
    truth: np.ndarray
    pred: np.ndarray
    class_names: list[str] = field(default_factory=list)
    view: str = ""

    def build(self):
        cmap = matplotlib.colormaps["tab10"]
        cells, titles = [], []
        for r in range(len(self.images)):
            img = np.asarray(self.images[r], dtype=float)  # (S, S)
            img = (img - img.min()) / (img.max() - img.min() + 1e-8)
            truth, pred = np.asarray(self.truth[r]), np.asarray(self.pred[r])
            cells.append([img, self.overlay(img, truth, cmap), self.overlay(img, pred, cmap)])
            titles.append(["", "", self.dice_text(truth, pred)])
        titles[0] = ["image", "ground truth", f"prediction\n{titles[0][2]}"]
        names = class_names_upto(self.class_names, int(max(np.max(self.truth), np.max(self.pred), 1)))
        legend = [(f"{k} {name}", self.blend(np.ones(3), np.asarray(cmap(k % 10)[:3]))) for k, name in enumerate(names, 1)]
        title = "validation images: image (min to max) | ground truth | prediction; Dice on the pixels shown"
        return image_table_figure(cells, titles=titles, row_labels=[f"#{r}" for r in range(len(cells))],
                                  title=title + (f"; {self.view}" if self.view else ""), legend=legend,
                                  panel_px=max(128, int(np.asarray(self.images).shape[-1])), dpi=90)

    @staticmethod
    def blend(under: np.ndarray, colour: np.ndarray) -> np.ndarray:
        return (1 - OVERLAY_ALPHA) * under + OVERLAY_ALPHA * colour

    def overlay(self, img: np.ndarray, labels: np.ndarray, cmap) -> np.ndarray:
        """(S, S) gray in [0, 1] with each foreground class's colour laid over it: (S, S, 3)."""
        rgb = np.repeat(img[..., None], 3, axis=2)
        colours = np.asarray(cmap(labels % 10))[..., :3]
        return np.where((labels > 0)[..., None], self.blend(rgb, colours), rgb)

    def dice_text(self, truth: np.ndarray, pred: np.ndarray) -> str:
        """Dice 2|T and P| / (|T| + |P|) of each foreground class in ``truth`` or ``pred``; none: "no foreground"."""
        parts = []
        for k in sorted((set(np.unique(truth).tolist()) | set(np.unique(pred).tolist())) - {0}):
            t, p = truth == k, pred == k
            parts.append(f"{class_names_upto(self.class_names, k)[k - 1]} {2 * np.logical_and(t, p).sum() / (t.sum() + p.sum()):.2f}")
        return "Dice: " + ", ".join(parts) if parts else "no foreground"


@dataclass
class DetectionOverlay(Figure):
    """Rows of ``image | ground truth | prediction`` for instance detection: ``images`` (N, S, S) first channel,
    each scaled from its own minimum to its maximum; per image its ground-truth and predicted instances, each a dict
    of ``boxes`` (M, 4) x1 y1 x2 y2 in pixels, ``labels`` (M,) classes from 1, ``masks`` (M, S, S) bool (optional)
    and, predicted, ``scores`` (M,). The predictions scoring at least ``min_score`` are drawn (box, mask, class and
    score, in class i's tab10 colour i); over each row's prediction how many there are against the ground truth."""

    images: np.ndarray
    truth: list[dict[str, np.ndarray]]
    pred: list[dict[str, np.ndarray]]
    class_names: list[str] = field(default_factory=list)
    min_score: float = 0.5

    def build(self):
        from matplotlib.patches import Rectangle

        cmap = matplotlib.colormaps["tab10"]
        shown = [{k: np.asarray(v)[np.asarray(p["scores"]) >= self.min_score] for k, v in p.items()} for p in self.pred]
        cells, titles = [], []
        for r, image in enumerate(self.images):
            img = np.asarray(image, dtype=float)
            img = (img - img.min()) / (img.max() - img.min() + 1e-8)
            rgb = np.repeat(img[..., None], 3, axis=2)
            cells.append([img, self.masked(rgb, self.truth[r], cmap), self.masked(rgb, shown[r], cmap)])
            counts, scores = (len(self.truth[r]["labels"]), len(shown[r]["labels"])), np.asarray(self.pred[r]["scores"])
            found = f"{counts[1]} detection{'s' * (counts[1] != 1)}"
            if counts[1] == 0 and scores.size:
                found += f" (top score {float(scores.max()):.2f})"
            titles.append(["", f"{counts[0]} instance{'s' * (counts[0] != 1)}", found])
        titles[0] = ["image", f"ground truth\n{titles[0][1]}", f"prediction (score >= {self.min_score:g})\n{titles[0][2]}"]
        labels = [int(v) for group in (*self.truth, *self.pred) for v in np.asarray(group["labels"]).reshape(-1)]
        names = class_names_upto(self.class_names, max([1, *labels]))
        legend = [(f"{k} {name}", cmap(k % 10)) for k, name in enumerate(names, 1)]
        side = int(np.asarray(self.images).shape[-1])
        fig = image_table_figure(cells, titles=titles, row_labels=[f"#{r}" for r in range(len(cells))], legend=legend,
                                 title="validation images: image (min to max) | ground truth | prediction: boxes, "
                                       "masks, class and score", panel_px=max(160, min(side, 320)), dpi=90)
        panels = [ax for ax in fig.axes if ax.get_images()]
        for r in range(len(cells)):
            for c, instances in ((1, self.truth[r]), (2, shown[r])):
                ax = panels[3 * r + c]
                scores = instances.get("scores")
                for i, (box, label) in enumerate(zip(np.asarray(instances["boxes"]).reshape(-1, 4), np.asarray(instances["labels"]))):
                    x1, y1, x2, y2 = (float(v) for v in box)
                    colour = cmap(int(label) % 10)
                    ax.add_patch(Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1, y2 - y1, fill=False, edgecolor=colour, linewidth=1.2))
                    text = names[int(label) - 1]
                    if scores is not None:
                        text += f" {float(scores[i]):.2f}"
                    ax.text(x1 - 0.5, y1 - 0.5, text, fontsize=6, color="white", va="bottom", ha="left", clip_on=True,
                            bbox={"facecolor": colour, "alpha": 0.8, "pad": 0.5, "edgecolor": "none"})
        return fig

    @staticmethod
    def masked(rgb: np.ndarray, instances: dict[str, np.ndarray], cmap) -> np.ndarray:
        """``rgb`` with each instance's mask in its class's colour laid over it (later instances on top)."""
        out = rgb.copy()
        masks = instances.get("masks")
        for mask, label in zip(() if masks is None else np.asarray(masks), np.asarray(instances["labels"])):
            colour = np.asarray(cmap(int(label) % 10)[:3])
            area = np.asarray(mask, dtype=bool)
            out[area] = (1 - OVERLAY_ALPHA) * out[area] + OVERLAY_ALPHA * colour
        return out


# ------------------------------------------------------------------------------------------- keeping, drawing
class FigureStore:
    """Figures kept by tag: ``render`` builds a tag's figure the first time (or for a new layout), else updates
    it, and returns its image as PNG bytes; ``builds`` counts the builds per tag.

    Tags whose figures are of one ``shareable`` kind and have one layout share one kept figure (e.g. the local
    drift maps of the blocks of one stage): a tag's first image is then an update of a figure another tag built,
    with the pixels a new figure would have (an update sets every value a build does), so such figures are built
    once per layout rather than once per tag (the tiny quickstart SwinUNETR: 4 local drift maps built instead of
    8, about 1 s less drawing in the first figure epoch)."""

    def __init__(self) -> None:
        self.figures: dict[str, _Kept] = {}
        self.builds: dict[str, int] = {}
        self._by_layout: dict[tuple[type, Hashable], _Kept] = {}

    def render(self, tag: str, figure: Figure) -> tuple[bytes, bool]:
        """PNG of the tag's figure with ``figure``'s values, and whether it was built."""
        layout = figure.layout()
        kept = self.figures.get(tag)
        if figure.shareable and layout is not None and (kept is None or kept.layout != layout):
            kept = self._by_layout.get((type(figure), layout))
        built = kept is None or layout is None or kept.layout != layout
        if built:
            fig = figure.build()
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)  # keeps text metrics
            kept = _Kept(canvas, layout)
            if figure.shareable and layout is not None:
                self._by_layout[(type(figure), layout)] = kept
            self.builds[tag] = self.builds.get(tag, 0) + 1
        else:
            figure.update(kept.canvas.figure)
        self.figures[tag] = kept
        _draw(kept)
        return png(np.asarray(kept.canvas.buffer_rgba())[:, :, :3]), built


def render_png(figure: Figure) -> bytes:
    """PNG bytes of a figure drawn once (nothing kept)."""
    return FigureStore().render("", figure)[0]


class _Kept:
    """A kept figure: its canvas, the layout it was built for, its redrawn artists and static background."""

    __slots__ = ("canvas", "layout", "animated", "background", "static_key", "backgrounds")

    def __init__(self, canvas, layout: Any) -> None:
        self.canvas, self.layout = canvas, layout
        self.animated = list(canvas.figure.__dict__.get("_vitlab_redrawn", ()))  # see redrawn()
        self.background = None
        self.static_key = None  # see static_parts_depend_on()
        self.backgrounds = 0  # how many times the static background was drawn


def _draw(kept: _Kept) -> None:
    """Rasterise a kept figure: whole, or its redrawn artists over the kept static background."""
    canvas, fig = kept.canvas, kept.canvas.figure
    if not kept.animated:
        canvas.draw()
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
