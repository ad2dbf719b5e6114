"""RuntimeCallback: the figure worker's whole life in a fit, and the task's validation figures."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from vitlab.runtime import FIGURE_MODES, FigureWorker, available_cores


class RuntimeCallback(pl.Callback):
    """Owns the run-time machinery of :mod:`vitlab.runtime` during a fit, as ``LearningRateMonitor`` owns its
    per-batch work: starts the figure worker at set-up (rank 0), pauses it during each training and validation
    step when the run trains on the CPU with every core busy, draws the task module's validation figures when
    they are due (``validation_figures()``, e.g. the confusion matrix), and writes every pending image before
    the logger closes (end of the fit, or an exception). ``train.py`` adds it with the config's
    ``runtime.figures``; the Q/K/V callbacks find its worker through :func:`vitlab.runtime.figure_worker`.

    Args:
        figures: ``auto`` (a figure worker process), ``inline`` (in the training process) or ``off``.
        workers: The run's loader worker processes (they count among the busy cores).
    """

    owns_figures = True

    def __init__(self, figures: str = "auto", workers: int = 0) -> None:
        if figures not in FIGURE_MODES:
            raise ValueError(f"RuntimeCallback.figures must be one of {', '.join(FIGURE_MODES)}, got {figures!r}")
        self.figures = figures
        self.workers = workers
        self.figure_worker: FigureWorker | None = None
        self._pause = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self.figures != "off" and self.figure_worker is None:
            self.figure_worker = FigureWorker(process=self.figures == "auto")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        worker = self.figure_worker
        self._pause = (worker is not None and worker.process and pl_module.device.type == "cpu"
                       and torch.get_num_threads() + self.workers >= available_cores())

    def _paused(self, paused: bool) -> None:
        if self._pause:
            self.figure_worker.pause() if paused else self.figure_worker.resume()

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._paused(True)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._paused(False)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._paused(True)

    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._paused(False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The task's figures of this validation (after its epoch-end hook), at its ``val/*`` metrics' step."""
        log_validation_figures(trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(raise_errors=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(raise_errors=False)  # before Lightning finalizes the logger: the images drawn so far are kept

    def _close(self, raise_errors: bool) -> None:
        worker, self.figure_worker = self.figure_worker, None
        if worker is None:
            return
        try:
            worker.flush()
        except Exception:
            if raise_errors:
                raise
        finally:
            worker.close()


def log_validation_figures(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Draw ``pl_module.validation_figures()`` (tag -> figure) when figures are due after this validation."""
    from vitlab.outputs.tensorboard import figures_due, logging_step, tensorboard_writer
    from vitlab.runtime import figure_worker

    make = getattr(pl_module, "validation_figures", None)
    if make is None or trainer.sanity_checking or not trainer.is_global_zero or not figures_due(trainer, trainer.current_epoch + 1):
        return
    writer, worker = tensorboard_writer(trainer), figure_worker(trainer)
    if writer is None or worker is None:
        return
    for tag, figure in make().items():
        worker.submit(writer, tag, logging_step(trainer), figure)
