"""The Q/K/V drift report (the Drotos poster): per-row drift against a reference and the previous epoch, as TensorBoard
scalars, histograms, images and a CSV table. Shared by the QKVDrift callback and ``probe.py drift``; no Lightning here."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.analysis import DRIFT_METRICS, MATRIX_METRICS, drift_tables, extra_drift, head_grid  # noqa: F401
from vitlab.qkv.state import MATRICES, block_stage
from vitlab.outputs.files import write_csv_arrays
from vitlab.outputs.tensorboard import add_scalars, log_figure

LOCAL_METRICS = ("cosine_distance", "euclidean")
#: The colour bar of each ``drift_map`` figure: what a cell is, in which units (a row u of the reference weight,
#: v of the current one, d_in entries; the weights' own units).
DRIFT_MAP_UNITS = {
    "cosine_distance": "1 - cos(u, v)  (unitless)",
    "euclidean": "|u - v|  (weight units)",
    "mse": "|u - v|^2 / d_in  (weight units^2)",
    "dot": "u . v  (weight units^2)",
    "rel_frobenius": "|W - W_ref|_F / |W_ref|_F  (ratio)",
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
                         yticklabels=[m.upper() for m in MATRICES], xlabel="block", ylabel="projection",
                         colorbar_label=DRIFT_MAP_UNITS[name], figsize=(3.0 + 0.32 * len(blocks), 3.4))
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


def drift_table_columns(epoch: int, rows_ref, heads) -> dict[str, np.ndarray]:
    """The full per-row table (one row per block, matrix and weight row) as numpy columns: made in a few array
    operations per block, written by :func:`vitlab.outputs.files.write_csv_arrays` (a ViT-B epoch has 27,648 rows)."""
    keys = list(rows_ref)
    counts = [len(rows_ref[key]["dot"]) for key in keys]
    names = DRIFT_METRICS + ("ref_norm", "cur_norm")
    return {
        "epoch": np.full(sum(counts), epoch, dtype=np.int64),
        "block": np.repeat(np.array([block for block, _ in keys]), counts),
        "stage": np.repeat(np.array([block_stage(block) for block, _ in keys]), counts),
        "matrix": np.repeat(np.array([m for _, m in keys]), counts),
        "row": np.concatenate([np.arange(count) for count in counts]),
        "head": np.concatenate([np.arange(count) // (count // heads[block]) for (block, _), count in zip(keys, counts)]),
        **{name: np.concatenate([rows_ref[key][name].double().numpy() for key in keys]) for name in names},
    }


def write_drift_table(path: Path, epoch: int, rows_ref, heads, tables=None) -> None:
    """The full per-row table as CSV; written by ``tables`` (a :class:`vitlab.table_worker.TableWorker`: a child
    process, beside training on a GPU) when given, else here."""
    columns = drift_table_columns(epoch, rows_ref, heads)
    (tables.write if tables is not None else write_csv_arrays)(path, columns)


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
    tables=None,
) -> dict[tuple[str, str], dict[str, float]]:
    """Compute and write one drift report (TensorBoard scalars, histograms, images; optional CSV).

    Shared by :class:`QKVDrift` (every epoch) and ``probe.py drift`` (two checkpoints). Returns the
    per-(block, matrix) summary against ``ref``. Figures go through ``figure_worker`` (a
    :class:`vitlab.runtime.FigureWorker`), else are drawn at once; the CSV table through ``tables`` (a
    :class:`vitlab.table_worker.TableWorker`), else is written here.
    """
    blocks = list(heads)
    rows_ref, sum_ref = drift_tables(ref, cur, blocks, out_device="cpu")  # (computed where the states are)
    sum_prev = drift_tables(prev, cur, blocks)[1] if prev is not None else None
    _log_scalars(writer, sum_ref, sum_prev, step)
    _log_extras(writer, extra_drift(ref, cur), step)
    _log_histograms(writer, rows_ref, step)
    if figures:
        _log_images(writer, rows_ref, sum_ref, heads, step, local_maps, figure_worker)
    if table_path is not None:
        write_drift_table(table_path, epoch, rows_ref, heads, tables)
    return sum_ref
