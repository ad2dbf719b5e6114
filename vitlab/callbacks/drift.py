"""QKVDrift: how every block's query/key/value rows move away from the weights training started from."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from vitlab.analysis import drift_summary, head_grid, row_drift
from vitlab.callbacks._state import (
    MATRICES,
    block_stage,
    EpochCallback,
    head_counts,
    load_snapshot,
    qkv_state,
    snapshot_name,
    unwrap,
)
from vitlab.outputs.files import save_safetensors, write_csv
from vitlab.outputs.tensorboard import add_scalars, epoch_end_step, figures_due, log_figure, tensorboard_writer, write_layout_once
from vitlab.runtime import figure_worker

DRIFT_METRICS = ("cosine_distance", "euclidean", "mse", "dot")
MATRIX_METRICS = ("rel_frobenius", "norm_ratio")
LOCAL_METRICS = ("cosine_distance", "euclidean")


def drift_tables(
    ref: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], blocks: list[str]
) -> tuple[dict[tuple[str, str], dict[str, torch.Tensor]], dict[tuple[str, str], dict[str, float]]]:
    """Per-row drift and per-matrix summaries of every (block, Q|K|V) weight between two flat states.

    Returns:
        rows: (block, matrix) -> ``row_drift`` output (per-row float64 tensors).
        summary: (block, matrix) -> row-metric means plus ``rel_frobenius`` (||cur - ref||_F / ||ref||_F)
        and ``norm_ratio`` (||cur||_F / ||ref||_F).
    """
    rows: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    summary: dict[tuple[str, str], dict[str, float]] = {}
    for block in blocks:
        for m in MATRICES:
            key = f"{block}.{m}.weight"
            rows[(block, m)] = r = row_drift(ref[key], cur[key])
            full = drift_summary(r)
            summary[(block, m)] = {**{name: full[f"{name}_mean"] for name in DRIFT_METRICS}, **{k: full[k] for k in MATRIX_METRICS}}
    return rows, summary


def extra_drift(ref: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> dict[str, float]:
    """Absolute Frobenius change ||cur - ref||_F of biases and relative-position tables (``key`` -> value).

    Absolute, not relative: biases commonly start at zero, where a relative change has no scale.
    """
    return {
        key: float((value.double() - ref[key].double()).norm())
        for key, value in cur.items()
        if not key.endswith(".weight") and key in ref
    }


def _log_scalars(writer, sum_ref, sum_prev, step) -> None:
    metrics = DRIFT_METRICS + MATRIX_METRICS
    scalars = {f"drift/{name}/{block}.{m}": values[name] for (block, m), values in sum_ref.items() for name in metrics}
    for prefix, summary in (("drift", sum_ref), ("drift_step", sum_prev)):
        if summary is None:
            continue
        by_stage: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        for (block, m), values in summary.items():
            for name in metrics:
                by_stage[(name, block_stage(block), m)].append(values[name])
                by_stage[(name, "global", m)].append(values[name])
        for (name, stage, m), vals in by_stage.items():
            group = "global" if stage == "global" else "stage"
            tag = f"{prefix}_{group}/{name}/{m}" if stage == "global" else f"{prefix}_{group}/{name}/{stage}.{m}"
            scalars[tag] = sum(vals) / len(vals)
    add_scalars(writer, scalars, step)


def _log_extras(writer, extras: dict[str, float], step: int) -> None:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for key, value in extras.items():
        kind = key.split(".", 2)[2]  # q.bias / k.bias / v.bias / rel_pos_table
        by_kind[kind.replace(".", "_")].append(value)
    add_scalars(writer, {f"drift_global/frobenius_change/{kind}": sum(vals) / len(vals) for kind, vals in by_kind.items()}, step)


def _log_histograms(writer, rows_ref, step) -> None:
    for name in DRIFT_METRICS:
        for m in MATRICES:
            values = torch.cat([r[name] for (b, mm), r in rows_ref.items() if mm == m])
            writer.add_histogram(f"drift_rows/{name}/{m}", values, step)


def _log_images(writer, rows_ref, sum_ref, heads, step, local_maps: bool = True, worker=None) -> None:
    from vitlab.outputs.figures import Heatmap, LocalDrift

    blocks = list(heads)
    for name in DRIFT_METRICS + ("rel_frobenius",):
        grid = np.array([[sum_ref[(b, m)][name] for m in MATRICES] for b in blocks]).T  # (3, blocks)
        figure = Heatmap(grid, title=f"{name} vs reference\n(mean over rows), step {step}", xticklabels=blocks,
                         yticklabels=[m.upper() for m in MATRICES], xlabel="block", figsize=(3.0 + 0.32 * len(blocks), 3.4))
        log_figure(writer, f"drift_map/{name}", step, figure, worker)
    if not local_maps:
        return
    for block in blocks:
        grids = {name: [head_grid(rows_ref[(block, m)][name], heads[block]).double().numpy() for m in MATRICES] for name in LOCAL_METRICS}
        log_figure(writer, f"drift_local/{block}", step, LocalDrift(block, grids, step), worker)


def drift_layout() -> dict[str, Any]:
    """Custom-scalars layout: one category per metric, charts per Q/K/V, per stage and global."""
    layout: dict[str, Any] = {}
    for name in DRIFT_METRICS + MATRIX_METRICS:
        charts = {f"{m.upper()} per block": ["Multiline", [rf"drift/{name}/.*\.{m}$"]] for m in MATRICES}
        charts["per stage"] = ["Multiline", [rf"drift_stage/{name}/.*"]]
        charts["global (vs reference | vs previous epoch)"] = ["Multiline", [rf"drift_global/{name}/.*", rf"drift_step_global/{name}/.*"]]
        layout[f"drift: {name}"] = charts
    return layout


def write_drift_table(path: Path, epoch: int, rows_ref, heads) -> None:
    """The full per-row table (one line per block, matrix and row) as CSV."""
    table = []
    for (block, m), r in rows_ref.items():
        head_dim = len(r["dot"]) // heads[block]
        columns = {k: r[k].tolist() for k in DRIFT_METRICS + ("ref_norm", "cur_norm")}
        for i in range(len(r["dot"])):
            table.append({"epoch": epoch, "block": block, "stage": block_stage(block), "matrix": m, "row": i, "head": i // head_dim, **{k: v[i] for k, v in columns.items()}})
    write_csv(path, table)


def report_drift(
    writer,
    ref: dict[str, torch.Tensor],
    cur: dict[str, torch.Tensor],
    prev: dict[str, torch.Tensor] | None,
    heads: dict[str, int],
    step: int,
    table_path: Path | None = None,
    epoch: int = 0,
    local_maps: bool = True,
    figures: bool = True,
    figure_worker=None,
) -> dict[tuple[str, str], dict[str, float]]:
    """Compute and write one drift report (TensorBoard scalars, histograms, images; optional CSV).

    Shared by :class:`QKVDrift` (every epoch) and ``probe.py drift`` (two checkpoints). Returns the
    per-(block, matrix) summary against ``ref``. Figures go through ``figure_worker`` (a
    :class:`vitlab.runtime.FigureWorker`), else are drawn at once.
    """
    blocks = list(heads)
    rows_ref, sum_ref = drift_tables(ref, cur, blocks)
    sum_prev = drift_tables(prev, cur, blocks)[1] if prev is not None else None
    _log_scalars(writer, sum_ref, sum_prev, step)
    _log_extras(writer, extra_drift(ref, cur), step)
    _log_histograms(writer, rows_ref, step)
    if figures:
        _log_images(writer, rows_ref, sum_ref, heads, step, local_maps, figure_worker)
    if table_path is not None:
        write_drift_table(table_path, epoch, rows_ref, heads)
    return sum_ref


class QKVDrift(EpochCallback, pl.Callback):
    """Logs the Drotos poster's Q/K/V drift every epoch: against the reference (fit start) and the previous epoch.

    TensorBoard (no tag explosion): scalars ``drift/<metric>/<block>.<q|k|v>`` (mean over rows, vs the
    reference), ``drift_stage/...`` and ``drift_global/...`` aggregates, ``drift_step/...`` (vs the previous
    epoch, per stage and global); histograms ``drift_rows/<metric>/<q|k|v>`` of per-row values; images
    ``drift_map/<metric>`` (blocks x Q/K/V) and ``drift_local/<block>`` (heads x rows-within-head heatmaps of
    Q|K|V, rows: cosine distance, Euclidean), and a custom-scalars layout. The full per-row table of each
    epoch goes to ``<run>/qkv/drift_epoch_{k:03d}.csv``.

    Args:
        every_n_epochs: Compute after every N-th completed epoch.
        local_maps: Log the per-block heads x rows heatmaps.
        figures_every_n_epochs: Draw the images every N-th epoch (and the first and last); ``None``: about
            5 per run. Scalars, histograms and tables are written every ``every_n_epochs``.
        write_csv: Write the per-row CSV table.
    """

    def __init__(
        self, every_n_epochs: int = 1, local_maps: bool = True, write_csv: bool = True, figures_every_n_epochs: int | None = None
    ) -> None:
        super().__init__(every_n_epochs)
        if figures_every_n_epochs is not None and figures_every_n_epochs < 1:
            raise ValueError(f"QKVDrift.figures_every_n_epochs must be >= 1 or null, got {figures_every_n_epochs}")
        self.figures_every_n_epochs = figures_every_n_epochs
        self.local_maps = local_maps
        self.write_csv = write_csv
        self.reference_file: str | None = None
        self.logged_epochs: list[int] = []
        self._ref: dict[str, torch.Tensor] | None = None
        self._prev: dict[str, torch.Tensor] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        assert self._dir is not None
        current = qkv_state(unwrap(pl_module))
        if self.reference_file and Path(self.reference_file).is_file():
            self._ref, _ = load_snapshot(self.reference_file)  # resumed: the same reference as before
        else:
            if self.reference_file:
                raise FileNotFoundError(f"QKVDrift: reference snapshot {self.reference_file} is missing; cannot resume drift")
            self._ref = current
            path = self._dir / snapshot_name(0)
            if not path.exists():
                path = self._dir / "drift_reference.safetensors"
                save_safetensors(current, path, {"epoch": 0, "global_step": int(trainer.global_step)})
            else:
                exact, meta = load_snapshot(path)
                if meta.get("dtype", "fp32") != "fp32":  # a half-precision snapshot is not an exact reference
                    path = self._dir / "drift_reference.safetensors"
                    save_safetensors(current, path, {"epoch": 0, "global_step": int(trainer.global_step)})
            self.reference_file = str(path)
        self._prev = current  # on resume: the restored weights = the end of the last finished epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        completed = trainer.current_epoch + 1
        if completed % self.every_n_epochs or not trainer.is_global_zero or completed in self.logged_epochs:
            return
        model = unwrap(pl_module)
        current = qkv_state(model)
        writer = tensorboard_writer(trainer)
        table = self._dir / f"drift_epoch_{completed:03d}.csv" if self.write_csv else None
        worker = figure_worker(trainer)
        figures = worker is not None and figures_due(trainer, completed, self.figures_every_n_epochs)
        report_drift(writer, self._ref, current, self._prev, head_counts(model), epoch_end_step(trainer), table, completed, self.local_maps, figures, worker)
        write_layout_once(trainer)
        self._prev = current
        self.logged_epochs.append(completed)

    def tensorboard_layout(self) -> dict[str, Any]:
        return drift_layout()

    def state_dict(self) -> dict[str, Any]:
        return {"reference_file": self.reference_file, "logged_epochs": list(self.logged_epochs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reference_file = state_dict.get("reference_file")
        self.logged_epochs = [int(e) for e in state_dict.get("logged_epochs", [])]
