"""The spectrum of every block's QK bilinear form W_Q W_K^T (seed 002, Fig. 5): computed and reported.

Shared by the QKSpectra callback (:mod:`vitlab.callbacks.spectra_callback`) and ``probe.py spectra``; no Lightning here.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch

from vitlab.analysis import qk_spectra
from vitlab.callbacks._state import block_stage
from vitlab.tblog import FigureCache, heatmap_figure, log_figure, new_figure, update_heatmap, write_csv

SCALARS = ("positive_mass", "symmetry_score", "effective_rank")


def block_spectra(state: dict[str, torch.Tensor], heads: dict[str, int]) -> dict[str, Any]:
    """``qk_spectra`` of every block of a flat Q/K/V state (see :func:`vitlab.callbacks._state.qkv_state`)."""
    return {b: qk_spectra(state[f"{b}.q.weight"], state[f"{b}.k.weight"], h) for b, h in heads.items()}


def spectra_rows(spectra: dict[str, Any], epoch: int | None = None) -> list[dict[str, Any]]:
    """One table row per (block, head) plus one per block for the head-summed matrix (``head = sum``)."""
    rows = []
    for block, s in spectra.items():
        lead = {"epoch": epoch} if epoch is not None else {}
        for h in range(len(s.positive_mass)):
            rows.append({**lead, "block": block, "head": h, **{k: float(getattr(s, k)[h]) for k in SCALARS}, "top_singular_value": float(s.singular_values[h, 0])})
        rows.append({**lead, "block": block, "head": "sum", **{k: float(getattr(s.summed, k)[0]) for k in SCALARS}, "top_singular_value": float(s.summed.singular_values[0, 0])})
    return rows


def stage_figure(stage: str, spectra: dict[str, Any]):
    """Seed 002's Fig. 5 for one stage: symmetric-part eigenvalues, antisymmetric |lambda|, singular values."""
    fig = new_figure((12, 3.4))
    axes = fig.subplots(1, 3)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(len(spectra), 1)))
    for color, (block, s) in zip(colors, spectra.items()):
        label = block.split(".", 1)[1]
        sym = s.summed.sym_eigvals[0].double().cpu().numpy()
        axes[0].plot(np.arange(1, len(sym) + 1), sym, color=color, label=label, lw=1.2)
        asym = s.summed.asym_imag[0].double().cpu().numpy()
        axes[1].plot(np.arange(1, len(asym) + 1), asym, color=color, lw=1.2)
        sv = s.summed.singular_values[0].double().cpu().numpy()
        axes[2].semilogy(np.arange(1, len(sv) + 1), sv / max(sv[0], 1e-30), color=color, lw=1.2)
    axes[0].axhline(0.0, color="k", lw=0.6)
    axes[0].set_title("eigenvalues of sym. part (W_Q W_K^T)", fontsize=9)
    axes[1].set_title("antisym. part: lambda of +-i lambda pairs", fontsize=9)
    axes[2].set_title("singular values / largest", fontsize=9)
    for ax in axes:
        ax.set_xlabel("index")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{stage}: QK bilinear form, heads summed", fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.82, wspace=0.22)  # tight_layout costs ~0.4 s
    return fig


def update_stage_figure(fig, spectra: dict[str, Any]) -> None:
    """New spectra (same blocks and sizes) in a :func:`stage_figure`: the pixels a new one would have."""
    axes = fig.axes[:3]
    for i, s in enumerate(spectra.values()):
        curves = (s.summed.sym_eigvals[0], s.summed.asym_imag[0], s.summed.singular_values[0])
        for ax, values in zip(axes, curves):
            y = values.double().cpu().numpy()
            if ax is axes[2]:
                y = y / max(y[0], 1e-30)
            ax.lines[i].set_ydata(y)
    for ax in axes:
        ax.relim()
        ax.autoscale_view()


def _update_stage(group, fig) -> None:
    update_stage_figure(fig, group)


def _update_positive_mass(grid, title, fig) -> None:
    update_heatmap(fig, grid, title=title, vmin=0.0, vmax=1.0)


def report_spectra(
    writer, spectra: dict[str, Any], step: int, table_path: Path | None = None, epoch: int | None = None, figures: bool = True,
    figure_cache: FigureCache | None = None,
) -> None:
    """Write QK-spectra scalars, per-stage figures and the positive-mass heatmap (+ optional CSV).

    ``figure_cache`` keeps the figures for the next report (see :class:`vitlab.tblog.FigureCache`)."""
    for block, s in spectra.items():
        for name in SCALARS:
            writer.add_scalar(f"spectra/{name}/{block}", float(getattr(s, name).float().mean()), step)
            writer.add_scalar(f"spectra_summed/{name}/{block}", float(getattr(s.summed, name)[0]), step)
    if figures:
        by_stage: dict[str, dict[str, Any]] = defaultdict(dict)
        for block, s in spectra.items():
            by_stage[block_stage(block)][block] = s
        for stage, group in by_stage.items():  # (partial: the figure may be drawn later, with this loop's values)
            log_figure(writer, f"spectra_figure/{stage}", step, partial(stage_figure, stage, group),
                       partial(_update_stage, group), figure_cache,
                       layout=tuple((b, len(s.summed.sym_eigvals[0]), len(s.summed.asym_imag[0]), len(s.summed.singular_values[0])) for b, s in group.items()))
        max_heads = max(len(s.positive_mass) for s in spectra.values())
        grid = torch.full((len(spectra), max_heads), float("nan"))
        for i, s in enumerate(spectra.values()):
            grid[i, : len(s.positive_mass)] = s.positive_mass.float()
        blocks = list(spectra)
        title = f"positive mass of sym(W_Q W_K^T), step {step}"
        build = partial(
            heatmap_figure,
            grid,
            title=title,
            xlabel="head (white: the block has fewer heads)",
            ylabel="block",
            xticklabels=[str(h) for h in range(max_heads)],
            yticklabels=blocks,
            cmap="coolwarm",
            vmin=0.0,
            vmax=1.0,
            colorbar_label="positive mass [0, 1]",
            nan_color="white",
            figsize=(4.8 + 0.3 * max_heads, 1.8 + 0.3 * len(blocks)),
        )
        log_figure(writer, "spectra_heads/positive_mass", step, build, partial(_update_positive_mass, grid, title), figure_cache,
                   layout=(tuple(blocks), max_heads))
    if table_path is not None:
        write_csv(table_path, spectra_rows(spectra, epoch))


def spectra_layout() -> dict[str, Any]:
    """Custom-scalars layout: one chart per spectral statistic, per head mean and head-summed."""
    return {"spectra": {name: ["Multiline", [rf"spectra/{name}/.*", rf"spectra_summed/{name}/.*"]] for name in SCALARS}}
