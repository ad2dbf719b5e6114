"""QKVDrift: how every block's query/key/value rows move away from the weights training started from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from vitlab.callbacks.base import EpochCallback, qkv_worker, shared_capture, submit_epoch_work
from vitlab.callbacks.snapshot import QKVSnapshot
from vitlab.outputs.files import save_safetensors
from vitlab.outputs.tensorboard import epoch_end_step, figures_due, tensorboard_writer, write_layout_once
from vitlab.qkv.drift import drift_layout, report_drift
from vitlab.qkv.state import head_counts, load_snapshot, snapshot_name
from vitlab.runtime import figure_worker


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

    def fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        capture = shared_capture(trainer, pl_module)  # (every rank: None where nothing is written)
        if capture is None:
            return
        assert self._dir is not None
        current = capture.tensors  # (beside the weights: the drift is computed there)
        if self.reference_file and Path(self.reference_file).is_file():
            reference, _ = load_snapshot(self.reference_file)  # resumed: the same reference as before
            self._ref = {key: value.to(capture.device) for key, value in reference.items()}
        else:
            if self.reference_file:
                raise FileNotFoundError(f"QKVDrift: reference snapshot {self.reference_file} is missing; cannot resume drift")
            self._ref = current
            # the exact reference is the fit-start snapshot when a float32 one is written, else a file of its own
            snapshots = [cb for cb in trainer.callbacks if isinstance(cb, QKVSnapshot) and cb.dtype == "fp32" and 0 in cb.written]
            path = self._dir / (snapshot_name(0) if snapshots else "drift_reference.safetensors")
            if not snapshots:
                metadata = {"epoch": 0, "global_step": int(trainer.global_step)}
                submit_epoch_work(trainer, pl_module, lambda: save_safetensors(capture.host(), path, metadata))
            self.reference_file = str(path)
        self._prev = current  # on resume: the restored weights = the end of the last finished epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        completed = trainer.current_epoch + 1
        if completed % self.every_n_epochs or completed in self.logged_epochs:
            return
        self.logged_epochs.append(completed)
        capture = shared_capture(trainer, pl_module)  # (every rank: None where nothing is written)
        if capture is None:
            return
        current, reference, previous = capture.tensors, self._ref, self._prev
        heads = head_counts(capture.model)
        writer = tensorboard_writer(trainer)
        table = self._dir / f"drift_epoch_{completed:03d}.csv" if self.write_csv else None
        worker = figure_worker(trainer)
        figures = worker is not None and figures_due(trainer, completed, self.figures_every_n_epochs)
        step, local_maps = epoch_end_step(trainer), self.local_maps
        tables = qkv_worker(trainer, pl_module).tables  # (beside a GPU: a child process formats the table)
        submit_epoch_work(trainer, pl_module, lambda: report_drift(writer, reference, current, previous, heads, step, table, completed,
                                                                   local_maps, figures, worker, tables))
        write_layout_once(trainer)
        self._prev = current

    def tensorboard_layout(self) -> dict[str, Any]:
        return drift_layout()

    def state_dict(self) -> dict[str, Any]:
        return {"reference_file": self.reference_file, "logged_epochs": list(self.logged_epochs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reference_file = state_dict.get("reference_file")
        self.logged_epochs = [int(e) for e in state_dict.get("logged_epochs", [])]
