"""QKSpectra: the spectrum of every block's QK bilinear form W_Q W_K^T, each epoch (Philip et al., Fig. 5)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from vitlab.callbacks.base import EpochCallback, qkv_worker, shared_capture, submit_epoch_work
from vitlab.qkv.state import head_counts
from vitlab.qkv.spectra import block_spectra, report_spectra, spectra_layout
from vitlab.outputs.tensorboard import epoch_end_step, figures_due, tensorboard_writer, write_layout_once
from vitlab.runtime import figure_worker


class QKSpectra(EpochCallback, pl.Callback):
    """Logs the QK bilinear form's spectra of every attention block at fit start and every N epochs.

    Per block: positive mass of the symmetric part's spectrum, symmetry score and effective rank (head
    mean as ``spectra/...``, head-summed matrix as ``spectra_summed/...``); per stage a figure of the
    eigenvalues of the symmetric and antisymmetric parts and the singular values; a blocks x heads
    positive-mass heatmap; and ``<run>/qkv/spectra_epoch_{k:03d}.csv`` per block and head.

    Cosine-attention models (Swin V2) get the spectra of the same Wq^T Wk, the bilinear form of the
    un-normalised q.k: sign structure and effective rank carry over to the cosine logits, singular-value
    magnitudes do not (see :mod:`vitlab.analysis.spectra`).

    Args:
        every_n_epochs: Compute after every N-th completed epoch (and once at fit start, epoch 0).
        write_csv: Write the per-head CSV table.
        figures_every_n_epochs: Draw the figures every N-th epoch (and at fit start and the last epoch);
            ``None``: about 5 per run.
        device: Where the eigenproblems are solved. ``cpu`` (default): on the host, from the copy of the weights the
            snapshot takes anyway, each problem on one core and as many at once as the run has torch threads
            (:mod:`vitlab.solver_pool`); beside a GPU the Q/K/V worker hands them out, and the GPU is left to
            training (cuSOLVER solves a batch of symmetric problems larger than 32 x 32 one matrix at a time: a ViT-B
            epoch has 400+ of them). ``weights``: where the weights are (the GPU when training on one).
    """

    def __init__(self, every_n_epochs: int = 1, write_csv: bool = True, figures_every_n_epochs: int | None = None,
                 device: str = "cpu") -> None:
        super().__init__(every_n_epochs)
        if figures_every_n_epochs is not None and figures_every_n_epochs < 1:
            raise ValueError(f"QKSpectra.figures_every_n_epochs must be >= 1 or null, got {figures_every_n_epochs}")
        if device not in ("cpu", "weights"):
            raise ValueError(f"QKSpectra.device must be 'cpu' or 'weights', got {device!r}")
        self.device = device
        self.figures_every_n_epochs = figures_every_n_epochs
        self.write_csv = write_csv
        self.logged_epochs: list[int] = []

    def fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, epoch=0)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        completed = trainer.current_epoch + 1
        if completed % self.every_n_epochs == 0:
            self._log(trainer, pl_module, epoch=completed)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, epoch: int) -> None:
        if epoch in self.logged_epochs:
            return
        self.logged_epochs.append(epoch)
        capture = shared_capture(trainer, pl_module)  # (every rank: None where nothing is written)
        if capture is None:
            return
        heads = head_counts(capture.model)
        writer = tensorboard_writer(trainer)
        table = self._dir / f"spectra_epoch_{epoch:03d}.csv" if self.write_csv and self._dir else None
        worker = figure_worker(trainer)
        figures = worker is not None and figures_due(trainer, epoch, self.figures_every_n_epochs)
        step, on_host = epoch_end_step(trainer) if epoch else 0, self.device == "cpu"
        qkv = qkv_worker(trainer, pl_module) if on_host else None

        def report() -> None:  # (A's eigenvalues only for the figures' curves: the scalars and the table need none)
            spectra = block_spectra(capture.host() if on_host else capture.tensors, heads, out_device="cpu",
                                    antisymmetric=figures, executor=qkv and qkv.solvers)
            report_spectra(writer, spectra, step, table, epoch, figures, worker)

        submit_epoch_work(trainer, pl_module, report)
        write_layout_once(trainer)

    def tensorboard_layout(self) -> dict[str, Any]:
        return spectra_layout()

    def state_dict(self) -> dict[str, Any]:
        return {"logged_epochs": list(self.logged_epochs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.logged_epochs = [int(e) for e in state_dict.get("logged_epochs", [])]
