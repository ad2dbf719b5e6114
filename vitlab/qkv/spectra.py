"""The spectrum of every block's QK bilinear form W_Q W_K^T (Philip et al., Fig. 5), reported: TensorBoard scalars,
per-stage figures, the positive-mass map and CSV tables. Shared by the QKSpectra callback and ``probe.py spectra``;
no Lightning here."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from vitlab.analysis.spectra import block_spectra  # noqa: F401  (the report's input, imported from here too)
from vitlab.qkv.state import block_stage
from vitlab.outputs.files import write_csv
from vitlab.outputs.tensorboard import add_scalars, log_figure

SCALARS = ("positive_mass", "symmetry_score", "effective_rank")


def spectra_rows(spectra: dict[str, Any], epoch: int | None = None) -> list[dict[str, Any]]:
    """One table row per (block, head) plus one per block for the head-summed matrix (``head = sum``)."""
    rows = []
    for block, s in spectra.items():
        lead = {"epoch": epoch} if epoch is not None else {}
        for h in range(len(s.positive_mass)):
            rows.append({**lead, "block": block, "head": h, **{k: float(getattr(s, k)[h]) for k in SCALARS}, "top_singular_value": float(s.singular_values[h, 0])})
        rows.append({**lead, "block": block, "head": "sum", **{k: float(getattr(s.summed, k)[0]) for k in SCALARS}, "top_singular_value": float(s.summed.singular_values[0, 0])})
    return rows


def stage_curves(spectra: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """block -> the head-summed spectra :class:`vitlab.outputs.figures.StageCurves` plots, as numpy arrays."""
    return {b: tuple(v[0].double().cpu().numpy() for v in (s.summed.sym_eigvals, s.summed.asym_imag, s.summed.singular_values))
            for b, s in spectra.items()}


def report_spectra(
    writer, spectra: dict[str, Any], step: int, table_path: Path | None = None, epoch: int | None = None, figures: bool = True,
    figure_worker=None,
) -> None:
    """Write QK-spectra scalars, per-stage figures and the positive-mass heatmap (+ optional CSV).

    Figures go through ``figure_worker`` (a :class:`vitlab.runtime.FigureWorker`), else are drawn at once."""
    scalars = {}
    for block, s in spectra.items():
        for name in SCALARS:
            scalars[f"spectra/{name}/{block}"] = float(getattr(s, name).float().mean())
            scalars[f"spectra_summed/{name}/{block}"] = float(getattr(s.summed, name)[0])
    add_scalars(writer, scalars, step)
    if figures:
        from vitlab.outputs.figures import Heatmap, StageCurves

        by_stage: dict[str, dict[str, Any]] = defaultdict(dict)
        for block, s in spectra.items():
            by_stage[block_stage(block)][block] = s
        for stage, group in by_stage.items():
            log_figure(writer, f"spectra_figure/{stage}", step, StageCurves(stage, stage_curves(group)), figure_worker)
        max_heads = max(len(s.positive_mass) for s in spectra.values())
        grid = np.full((len(spectra), max_heads), np.nan)
        for i, s in enumerate(spectra.values()):
            grid[i, : len(s.positive_mass)] = s.positive_mass.double().cpu().numpy()
        figure = Heatmap(grid, title=f"positive mass of sym(W_Q W_K^T), step {step}", xlabel="head (white: the block has fewer heads)",
                         ylabel="block", xticklabels=[str(h) for h in range(max_heads)], yticklabels=list(spectra), cmap="coolwarm",
                         vmin=0.0, vmax=1.0, colorbar_label="positive mass [0, 1]", nan_color="white",
                         figsize=(4.8 + 0.3 * max_heads, 1.8 + 0.3 * len(spectra)))
        log_figure(writer, "spectra_heads/positive_mass", step, figure, figure_worker)
    if table_path is not None:
        write_csv(table_path, spectra_rows(spectra, epoch))


def spectra_layout() -> dict[str, Any]:
    """Custom-scalars layout: one chart per spectral statistic, per head mean and head-summed."""
    return {"spectra": {name: ["Multiline", [rf"spectra/{name}/.*", rf"spectra_summed/{name}/.*"]] for name in SCALARS}}
