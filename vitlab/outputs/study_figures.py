"""The figures of a study (``probe.py claims --study``): a forest plot of the claims, the Attentionless table,
and each validation metric's curves per variant over the seeds. numpy and matplotlib only.

Each function takes plain numbers and returns a matplotlib figure (:func:`vitlab.outputs.figures.new_figure`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
import numpy as np

from vitlab.outputs.figures import new_figure

VERDICT_COLORS = {"holds": "tab:green", "does not hold": "tab:red", "inconclusive": "tab:orange"}
OTHER_COLOR = "0.45"  # too few seeds / not testable


@dataclass
class Row:
    """One line of a forest plot or table panel: a variant's per-seed values, their mean and interval."""

    label: str
    values: Sequence[float]
    mean: float
    low: float | None
    high: float | None
    verdict: str = ""
    note: str = ""


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def _rows_panel(ax, rows: Sequence[Row], color_of, threshold: float | None = None, side: str | None = None) -> None:
    """Variants top to bottom: seeds as dots, the mean as a diamond, the interval as a bar; the threshold dashed,
    the side where the claim holds shaded."""
    y = np.arange(len(rows))[::-1]
    for yi, row in zip(y, rows):
        color = color_of(row)
        jitter = np.linspace(-0.12, 0.12, len(row.values)) if len(row.values) > 1 else np.zeros(len(row.values))
        ax.scatter(row.values, yi + jitter, s=14, color="0.55", zorder=2, linewidths=0)
        if row.low is not None and row.high is not None:
            ax.plot([row.low, row.high], [yi, yi], color=color, lw=2.4, solid_capstyle="butt", zorder=3)
        if np.isfinite(row.mean):
            ax.scatter([row.mean], [yi], marker="D", s=34, color=color, zorder=4, edgecolors="k", linewidths=0.5)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    if threshold is not None:
        ax.axvline(threshold, color="k", ls="--", lw=1.0, zorder=1)
        lo, hi = ax.get_xlim()
        lo, hi = min(lo, threshold), max(hi, threshold)
        span = hi - lo or 1.0
        lo, hi = lo - 0.05 * span, hi + 0.05 * span
        if side is not None:
            ax.axvspan(lo if side.startswith("<") else threshold, threshold if side.startswith("<") else hi,
                       color="tab:green", alpha=0.08, zorder=0)
        ax.set_xlim(lo, hi)
    ax.grid(axis="x", color="0.9", lw=0.6)
    ax.set_axisbelow(True)


def _annotate(ax, rows: Sequence[Row], color_of) -> None:
    """Each row's mean [interval] and verdict, right of the panel."""
    y = np.arange(len(rows))[::-1]
    for yi, row in zip(y, rows):
        interval = f"[{row.low:.3g}, {row.high:.3g}]" if row.low is not None else "(no interval)"
        text = f"{row.mean:.3g} {interval}" + (f"  {row.verdict}" if row.verdict else "") + (f"  {row.note}" if row.note else "")
        ax.annotate(text, xy=(1.01, yi), xycoords=("axes fraction", "data"), va="center", fontsize=7.5, color=color_of(row))


def forest_figure(claims: Sequence[Mapping[str, Any]], title: str):
    """One panel per claim: each variant's statistic T over the seeds with its interval and the claim's threshold.

    ``claims``: dicts with ``id``, ``claim``, ``statistic``, ``threshold``, ``holds_when`` and ``rows`` (:class:`Row`
    per variant, ``verdict`` set).
    """
    heights = [0.9 + 0.32 * len(c["rows"]) for c in claims]
    total = 1.0 + sum(heights)  # inches
    fig = new_figure((11.0, total), dpi=100)
    axes = fig.subplots(len(claims), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]

    def color_of(row: Row) -> str:
        return VERDICT_COLORS.get(row.verdict, OTHER_COLOR)

    for ax, claim in zip(axes, claims):
        _rows_panel(ax, claim["rows"], color_of, claim["threshold"], claim["holds_when"])
        _annotate(ax, claim["rows"], color_of)
        ax.set_title(f"{claim['id']}: {claim['claim']}  (holds when T {claim['holds_when']} {claim['threshold']:g}, "
                     "dashed; shaded: the claim's side)", fontsize=8.5, loc="left")
        ax.set_xlabel("T = " + _wrap(claim["statistic"], 110), fontsize=7.5)
        ax.tick_params(axis="x", labelsize=7.5)
    fig.suptitle(f"{title}\nclaims over seeds: dots = runs, diamond = mean, bar = 95 % interval of the mean "
                 "(green: holds, red: does not hold, orange: inconclusive, grey: too few seeds)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.72, 1 - 0.55 / total))  # right: the values; top: the title's two lines
    return fig


def table_figure(rows: Mapping[str, Sequence[Row]], references: Mapping[str, float], seeds: int, title: str):
    """The Attentionless table as a figure: one panel per metric (e.g. best validation balanced accuracy, AUROC),
    each variant's mean and interval over the seeds, the seeds as dots, chance as a dashed line.

    ``rows``: metric label -> rows per variant; ``references``: metric label -> chance level.
    """
    n = max(len(r) for r in rows.values())
    height = 1.9 + 0.45 * n
    fig = new_figure((12.0, height), dpi=100)
    axes = fig.subplots(1, len(rows), squeeze=False)[0]
    palette = matplotlib.colormaps["tab10"]
    for ax, (metric, metric_rows) in zip(axes, rows.items()):
        colors = {r.label: palette(i % 10) for i, r in enumerate(metric_rows)}

        def color_of(row: Row, colors=colors):
            return colors[row.label]

        _rows_panel(ax, metric_rows, color_of)
        if metric in references:
            ax.axvline(references[metric], color="k", ls="--", lw=1.0)
            ax.annotate("chance", xy=(references[metric], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        ha="left", va="bottom")
        _annotate(ax, metric_rows, color_of)
        ax.set_xlabel(f"{metric} (fraction)\nmean and 95 % interval over {seeds} seeds; dots: seeds", fontsize=8)
    fig.suptitle(title, fontsize=10)
    # room for the variant names left of each panel and the values right of it (tight_layout ignores annotations)
    fig.subplots_adjust(left=0.13, right=0.85, wspace=1.0, bottom=0.95 / height, top=1 - 0.7 / height)
    return fig


def curves_figure(metric: str, curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], title: str):
    """A validation metric per epoch for each variant: the mean over seeds as a line, min to max over seeds as a band.

    ``curves``: variant -> seed -> [(epoch, value)]; epochs missing in some seed are left out of the mean.
    """
    fig = new_figure((10.0, 4.6), dpi=100)
    ax = fig.subplots()
    palette = matplotlib.colormaps["tab10"]
    for i, (variant, by_seed) in enumerate(curves.items()):
        epochs = sorted(set.intersection(*(set(e for e, _ in c) for c in by_seed.values()))) if by_seed else []
        if not epochs:
            continue
        table = np.array([[dict(c)[e] for e in epochs] for c in by_seed.values()])  # (seeds, epochs)
        x = np.array(epochs) + 1  # epochs trained
        color = palette(i % 10)
        ax.fill_between(x, table.min(axis=0), table.max(axis=0), color=color, alpha=0.18, linewidth=0)
        ax.plot(x, table.mean(axis=0), color=color, lw=1.6, label=f"{variant} ({len(by_seed)} seeds)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epochs trained")
    ax.set_ylabel(metric)
    ax.grid(color="0.92", lw=0.6)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="variant", title_fontsize=8)
    ax.set_title(f"{title}\n{metric} per variant: line = mean over seeds, band = min to max over seeds", fontsize=9)
    fig.tight_layout()
    return fig
