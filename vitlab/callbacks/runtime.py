"""RuntimeCallback: the figure worker's whole life in a fit, and the task's validation figures."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins import CheckpointIO

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
        self._epoch_end = False  # between this callback's on_train_epoch_end and the next epoch's start
        self._skipped_files: int | None = None  # data/skipped_files as last logged (rank 0)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        from vitlab.outputs.tensorboard import resume_step

        run_dir = getattr(trainer.logger, "log_dir", None)  # (not trainer.log_dir: it broadcasts, and only rank 0 is here)
        if resume_step(trainer) > 0 and run_dir:  # a killed run's half-written snapshots and tables
            from vitlab.outputs.files import remove_stale_temps

            for path in remove_stale_temps(run_dir):
                print(f"vitlab: removed {path}, left by the killed run")
        self._skipped_files = log_skipped_files(trainer, None)
        if self.figures != "off" and self.figure_worker is None:
            self.figure_worker = FigureWorker(process=self.figures == "auto")
            if self.figure_worker.process and type(trainer.strategy).__name__ in ("SingleDeviceStrategy", "DDPStrategy"):
                # (strategies whose rank 0 writes the whole checkpoint through strategy.checkpoint_io)
                trainer.strategy.checkpoint_io = SettledCheckpointIO(trainer.strategy.checkpoint_io, self.figure_worker, trainer.loggers)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        worker = self.figure_worker
        self._pause = (worker is not None and worker.process and pl_module.device.type == "cpu"
                       and torch.get_num_threads() + self.workers >= available_cores())

    def _paused(self, paused: bool) -> None:
        if self._pause:
            self.figure_worker.pause() if paused else self.figure_worker.resume()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end = False

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end = True  # (runs before the checkpoints: Lightning calls monitoring callbacks last)
        if trainer.is_global_zero:
            self._skipped_files = log_skipped_files(trainer, self._skipped_files)

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

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Before a checkpoint is written, everything it says happened is on disk: a run killed at any moment
        after it and resumed from it has every point up to its step, and the resumed run writes the rest."""
        settled = isinstance(trainer.strategy.checkpoint_io, SettledCheckpointIO)  # it waits for the figures itself
        settle_outputs(trainer, None if settled else self.figure_worker, self._epoch_end)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, SettledCheckpointIO):
            trainer.strategy.checkpoint_io = io.checkpoint_io  # (its writes were waited for by the strategy's teardown)
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


def log_skipped_files(trainer: pl.Trainer, logged: int | None) -> int | None:
    """``data/skipped_files``: the bad files the data module left out (its ``skipped_files``) to the trainer's loggers.

    ``logged`` None (the fit's set-up): the count at step 0, once per run (a resumed run keeps its first start's
    point). Later (the end of a training epoch): the count again, at the epoch's step, when files that failed only
    when loaded (by this process or its loader workers) have raised it. Returns the count now known.
    """
    count = getattr(trainer.datamodule, "skipped_files", None)
    if count is None:
        return logged
    from vitlab.outputs.tensorboard import epoch_end_step, resume_step

    if logged is None:
        step = 0 if resume_step(trainer) == 0 else None
    else:
        step = epoch_end_step(trainer) if count > logged else None
    for logger in trainer.loggers if step is not None else ():
        logger.log_metrics({"data/skipped_files": float(count)}, step=step)
    return count


def settle_outputs(trainer: pl.Trainer, worker: FigureWorker | None, epoch_end: bool) -> None:
    """Put on disk what a checkpoint written now covers (all ranks call it: metrics may synchronise);
    ``epoch_end``: the checkpoint is saved in ``on_train_epoch_end``.

    1. The training epoch's metrics (``train/acc``, ``train/loss_epoch`` ...): Lightning writes them to the
       loggers after the monitoring callbacks' ``on_train_epoch_end``, i.e. after a checkpoint saved there, and a
       run resumed from that checkpoint never logs them again. They are logged now, at the step Lightning
       gives them (its own call then finds nothing left to log).
    2. Every figure handed to the figure worker: drawn and written (a resumed run does not draw them again).
    3. Every logger flushed (TensorBoard's writer otherwise writes on its own schedule).
    """
    if epoch_end and trainer.training:
        loop = trainer.fit_loop.epoch_loop
        loop._batches_that_stepped -= 1  # as Lightning's fit loop does for the epoch-end metrics
        try:
            trainer._logger_connector.update_train_epoch_metrics()
        finally:
            loop._batches_that_stepped += 1
    if worker is not None:
        worker.flush()
    for logger in trainer.loggers:
        logger.save()


class SettledCheckpointIO(CheckpointIO):
    """Writes a checkpoint only once every figure handed to the figure worker before it is in the event file.

    When figures are still being drawn, the checkpoint's tensors are copied at once and the file is written by a
    thread after them, so training goes on meanwhile (a figure set takes seconds to draw); a run killed before
    the file exists resumes from the previous checkpoint and draws the set again. Removals wait for the writes
    before them; the strategy's teardown waits for all (``teardown``). Installed by :class:`RuntimeCallback`.
    """

    def __init__(self, checkpoint_io: CheckpointIO, worker: FigureWorker, loggers: list) -> None:
        super().__init__()
        self.checkpoint_io, self.worker, self.loggers = checkpoint_io, worker, loggers
        self._executor = None
        self._writes: list = []  # (figures it waits for, future)
        self._error: BaseException | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._raise_error()
        count = self.worker.submitted
        if self._executor is None and self.worker.written >= count:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        import torch
        from lightning_utilities.core.apply_func import apply_to_collection

        for mark, future in self._writes:  # at most one epoch's checkpoints wait: figures slower than epochs block here
            if mark < count:
                future.result()
        self._writes = [(mark, future) for mark, future in self._writes if not future.done()]
        # a copy in host memory taken now, before training goes on (not on the GPU: it may have no room for it)
        copy = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))

        def write() -> None:
            self.worker.wait_written(count)
            for logger in self.loggers:
                logger.save()  # (flushes TensorBoard's writer: the images are on disk before the checkpoint)
            self.checkpoint_io.save_checkpoint(copy, path, storage_options=storage_options)

        self._writes.append((count, self._submit(write)))

    def remove_checkpoint(self, path: Any) -> None:
        if self._executor is None:
            self.checkpoint_io.remove_checkpoint(path)
        else:
            self._submit(lambda: self.checkpoint_io.remove_checkpoint(path))

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._drain()
        return self.checkpoint_io.load_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        self._drain()
        self.checkpoint_io.teardown()

    def _submit(self, task):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitlab-checkpoint")

        def run() -> None:
            try:
                task()
            except BaseException as exc:  # noqa: BLE001  (raised in the training process at the next call)
                self._error = self._error or exc

        return self._executor.submit(run)

    def _drain(self) -> None:
        executor, self._executor, self._writes = self._executor, None, []
        if executor is not None:
            executor.shutdown(wait=True)
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
