"""RuntimeCallback: the figure worker's whole life in a fit, the task's validation figures, and what a checkpoint
must hold for a resumed run to be the run that was never stopped (random streams, figures not yet written)."""

from __future__ import annotations

import functools
from typing import Any

import pytorch_lightning as pl

from vitlab.callbacks.base import loads_after_fit_start
from vitlab.figure_worker import FIGURE_MODES, FigureWorker
from vitlab.runtime import available_cores


SETTLE_KEY = "_vitlab_settle"  # in a checkpoint between its taking and its writing only


class RuntimeCallback(pl.Callback):
    """Owns the run-time machinery of :mod:`vitlab.runtime` during a fit, as ``LearningRateMonitor`` owns its
    per-batch work: starts the figure worker at set-up (rank 0), pauses it during each training and validation
    step when the run trains on the CPU with every core busy, draws the task module's validation figures when
    they are due (``validation_figures()``, e.g. the confusion matrix), and writes every pending image before
    the logger closes (end of the fit, or an exception). ``train.py`` adds it with the config's
    ``runtime.figures``; the Q/K/V callbacks find its worker through :func:`vitlab.runtime.figure_worker`.

    **Resuming.** Its state in a checkpoint (:meth:`state_dict`) makes a run resumed from it continue as the
    uninterrupted run did:

    - *the random streams of every rank* (:mod:`vitlab.random_state`; gathered from all ranks, each rank restores
      its own). They are taken when the checkpoint is, at the end of an epoch, and put back at the start of the
      first epoch the resumed run trains (or its first batch): between those two points the uninterrupted run
      draws nothing, while the resumed run draws in between for its own start (the model's initialisation, the
      loaders' first iterators; its sanity check is isolated by Lightning).
    - *the figures not yet written* (tag, step and values): the checkpoint is written at once, never held back by
      a figure worker behind the epochs, and a run resumed from it draws those the killed run had not written
      to its event files (``written_images``), so every image is there exactly once.

    Before a checkpoint is written the epoch's ``train/*`` metrics and the loggers are flushed
    (:func:`settle_outputs`): every scalar at or below its step is on disk.

    **The next epoch's batches during this epoch's end.** After an epoch's last training batch it restarts the
    training loaders' persistent workers on the next epoch (:func:`start_next_epoch`), so that epoch's first batch is
    made while this one validates, runs its epoch-end callbacks and checkpoints: the same batches, made earlier.

    **Checkpoints beside a GPU.** When the run trains on a GPU (one device or DDP) with Lightning's own checkpoint
    writer, checkpoints are written by :class:`vitlab.checkpoint_writer.BackgroundCheckpointIO`: the training
    thread only queues copies to pinned host memory, and a background thread writes each file once the Q/K/V
    callbacks' work of the epochs it covers is on disk (the figures still pending then are the ones it lists, the
    loggers flushed), so a checkpoint costs the GPU no idle time and still never exists before what it covers.

    **Label maps a byte a voxel on their way to the GPU.** When the run trains on a GPU, a dense data module's loader
    workers send the label maps as uint8 (:attr:`vitlab.data.dense_data.DenseImageData.narrow_label_maps`), widened
    to int64 on the device.

    **Batches normalised on the GPU.** When the run trains on a GPU, the data module's loaders leave the pipelines'
    final Normalize to the device (:attr:`vitlab.data.image_data.ImageData.normalize_on_device`): the workers collate,
    and the training process pins and copies, the images before it (a gray image for a model of three channels: a
    third of the bytes), and the data module normalises each batch where it arrives, to the same values.

    Args:
        figures: ``auto`` (a figure worker process), ``inline`` (in the training process) or ``off``.
        workers: The run's loader worker processes (they count among the busy cores).
        checkpoints: ``auto`` (written in the background on a GPU, at once on the CPU), ``background`` or ``inline``.
        normalize: ``auto`` (on the device beside a GPU, else in the loaders), ``device`` or ``loader``.
    """

    owns_figures = True

    def __init__(self, figures: str = "auto", workers: int = 0, checkpoints: str = "auto", normalize: str = "auto") -> None:
        if figures not in FIGURE_MODES:
            raise ValueError(f"RuntimeCallback.figures must be one of {', '.join(FIGURE_MODES)}, got {figures!r}")
        if checkpoints not in ("auto", "background", "inline"):
            raise ValueError(f"RuntimeCallback.checkpoints must be one of auto, background, inline, got {checkpoints!r}")
        if normalize not in ("auto", "device", "loader"):
            raise ValueError(f"RuntimeCallback.normalize must be one of auto, device, loader, got {normalize!r}")
        self.checkpoints = checkpoints
        self.normalize = normalize
        self.figures = figures
        self.workers = workers
        self.figure_worker: FigureWorker | None = None
        self._pause = False
        self._epoch_end = False  # between this callback's on_train_epoch_end and the next epoch's start
        self._skipped_files: int | None = None  # data/skipped_files as last logged (rank 0)
        self._loaded: dict[str, Any] | None = None  # the state of the checkpoint this fit resumes from
        self._restore_streams = False  # the loaded random streams wait for the first epoch (or batch)
        self._resumed_done = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        strategy = getattr(trainer, "strategy", None)
        on_gpu = strategy is not None and strategy.root_device.type == "cuda"
        if hasattr(datamodule, "normalize_on_device"):  # (before the loaders are made)
            datamodule.normalize_on_device = self.normalize == "device" or (self.normalize == "auto" and on_gpu)
        if hasattr(datamodule, "narrow_label_maps"):  # label maps from the workers as uint8, widened on the GPU
            datamodule.narrow_label_maps = on_gpu
        if stage == "fit":
            self._write_checkpoints_in_background(trainer)
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

    def _write_checkpoints_in_background(self, trainer: pl.Trainer) -> None:
        """Put :class:`~vitlab.checkpoint_writer.BackgroundCheckpointIO` in the strategy's place (see the class docstring)."""
        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
        from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

        from vitlab.checkpoint_writer import BackgroundCheckpointIO

        strategy = getattr(trainer, "strategy", None)
        if strategy is None or self.checkpoints == "inline" or isinstance(strategy.checkpoint_io, BackgroundCheckpointIO):
            return
        plain = type(strategy.checkpoint_io) is TorchCheckpointIO and type(strategy) in (SingleDeviceStrategy, DDPStrategy)
        if self.checkpoints == "auto" and not (plain and strategy.root_device.type == "cuda"):
            return
        strategy.checkpoint_io = BackgroundCheckpointIO(strategy.checkpoint_io, settle=functools.partial(self._settle, trainer))

    def _settle(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """(The checkpoint writer's thread, before it writes the host copy ``checkpoint``.) Wait for the Q/K/V work
        handed to its worker by the time the checkpoint was taken; list the figures pending now; flush the loggers."""
        from vitlab.outputs.tensorboard import tensorboard_writer

        settle = checkpoint.pop(SETTLE_KEY, {})
        worker = getattr(trainer, "_vitlab_qkv_worker", None)
        if worker is not None and settle.get("qkv_jobs"):
            worker.wait_done(settle["qkv_jobs"])
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        figures = self.figure_worker
        if state is not None and figures is not None:
            state["figures"] = [figure_state(tag, step, ordinal, figure) for tag, step, ordinal, figure in figures.pending()]
        writer = tensorboard_writer(trainer) if trainer.is_global_zero else None
        if writer is not None:
            writer.flush()

    def state_dict(self) -> dict[str, Any]:
        """``rng``: every rank's random streams (a collective: Lightning dumps a checkpoint on every rank);
        ``figures``: the figures handed to the figure worker and not yet written, as plain values."""
        import torch.distributed as dist

        from vitlab import random_state

        streams = [random_state.capture()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, streams[0])
            streams = gathered
        worker = self.figure_worker
        pending = worker.pending() if worker is not None else []
        return {"rng": streams, "figures": [figure_state(tag, step, ordinal, figure) for tag, step, ordinal, figure in pending],
                "skipped_files": self._skipped_files}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict
        self._restore_streams = bool(state_dict.get("rng"))
        logged = state_dict.get("skipped_files")
        if logged is not None and self._skipped_files is not None:  # (rank 0) the count its points already show
            self._skipped_files = max(self._skipped_files, int(logged))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not loads_after_fit_start(trainer):  # (then the checkpoint is loaded by now)
            self._resumed(trainer)  # (a resumed run with nothing left to train has no train start)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        self._resumed(trainer)  # (strategies that load the checkpoint after on_fit_start)
        worker = self.figure_worker
        self._pause = (worker is not None and worker.process and pl_module.device.type == "cpu"
                       and torch.get_num_threads() + self.workers >= available_cores())

    def _resumed(self, trainer: pl.Trainer) -> None:
        """Once per resumed fit (rank 0), when the checkpoint's state is loaded: say when it holds no random streams;
        draw the figures it lists that the event files lack."""
        if self._resumed_done or not trainer.ckpt_path or not trainer.is_global_zero:
            return
        self._resumed_done = True
        loaded = self._loaded or {}
        if not loaded.get("rng"):
            print(f"vitlab: {trainer.ckpt_path} holds no random streams (written by an older vitlab): the resumed run's "
                  "random draws (dropout, drop path) continue from the seed, not where the killed run stopped")
        self._redraw_figures(trainer, loaded.get("figures") or [])

    def _redraw_figures(self, trainer: pl.Trainer, states: list[dict[str, Any]]) -> None:
        """Draw the figures the checkpoint lists (not yet written when it was taken) that the event files lack."""
        from vitlab.outputs.tensorboard import tensorboard_writer, written_images

        writer, worker = tensorboard_writer(trainer), self.figure_worker
        if not states or writer is None or worker is None:
            return
        written = written_images(trainer.logger.log_dir)  # (the worker draws in order: the first n of a tag and step)
        missing = [state for state in states if state["ordinal"] >= written[(state["tag"], state["step"])]]
        for state in missing:
            worker.submit(writer, state["tag"], state["step"], figure_from_state(state), ordinal=state["ordinal"])
        if missing:
            steps = sorted({int(state["step"]) for state in missing})
            print(f"vitlab: drawing {len(missing)} figure(s) of step(s) {', '.join(map(str, steps))} that the checkpoint "
                  "lists and the stopped run had not written")

    def _restore(self, trainer: pl.Trainer) -> None:
        """Each rank's random streams as the checkpoint holds them (once, at the first epoch or batch)."""
        self._restore_streams = False
        from vitlab import random_state

        streams = self._loaded["rng"]
        rank, world = trainer.global_rank, trainer.world_size
        notes = random_state.restore(streams[rank]) if rank < len(streams) else ["not saved: this rank keeps its own"]
        if trainer.is_global_zero and (len(streams) != world or notes):
            print(f"vitlab: {trainer.ckpt_path}: random streams of {len(streams)} rank(s) for {world} here"
                  + (f" (rank(s) {', '.join(map(str, range(len(streams), world)))} keep their own draws)" if world > len(streams) else "")
                  + (f"; rank 0: {'; '.join(notes)}" if notes else "") + ": the resumed run's random draws differ "
                  "from an uninterrupted run's")

    def _paused(self, paused: bool) -> None:
        if self._pause:
            self.figure_worker.pause() if paused else self.figure_worker.resume()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end = False
        if self._restore_streams:
            self._restore(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end = True  # (runs before the checkpoints: Lightning calls monitoring callbacks last)
        if trainer.is_global_zero:
            self._skipped_files = log_skipped_files(trainer, self._skipped_files)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._restore_streams:  # resumed within an epoch (a checkpoint saved by steps)
            self._restore(trainer)
        self._paused(True)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._paused(False)
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            start_next_epoch(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._paused(True)

    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._paused(False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The task's figures of this validation (after its epoch-end hook), at its ``val/*`` metrics' step."""
        log_validation_figures(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Before a checkpoint is written, the scalars it covers are on disk (after :meth:`state_dict` listed the
        figures not yet written): a run killed at any moment after it and resumed from it has every point up to
        its step, and the resumed run writes the rest."""
        settle_outputs(trainer, self._epoch_end)
        from vitlab.checkpoint_writer import settles_checkpoints

        if settles_checkpoints(trainer.strategy.checkpoint_io):  # what the writer's thread waits for (see _settle)
            worker = getattr(trainer, "_vitlab_qkv_worker", None)
            checkpoint[SETTLE_KEY] = {"qkv_jobs": worker.submitted if worker is not None else 0}

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(raise_errors=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(raise_errors=False)  # before Lightning finalizes the logger: the images drawn so far are kept

    def _close(self, raise_errors: bool) -> None:
        worker, self.figure_worker = self.figure_worker, None
        if worker is not None:
            from vitlab.callbacks.base import flush_and_close

            flush_and_close(worker, raise_errors)


def start_next_epoch(trainer: pl.Trainer) -> bool:
    """After an epoch's last training batch: the training loaders' persistent workers begin the next epoch's
    batches now (:class:`vitlab.data.sampling.EpochLoader`), during the validation, epoch-end callbacks and
    checkpoints, instead of when that epoch starts. Nothing when no epoch follows (``max_epochs``, ``max_steps``,
    a stop requested) or when the loaders are made again each epoch. Returns whether any loader started."""
    from vitlab.data.sampling import EpochLoader

    loop = trainer.fit_loop
    next_epoch = loop.epoch_progress.current.processed + 1
    if (trainer.should_stop or trainer.reload_dataloaders_every_n_epochs
            or (trainer.max_epochs is not None and trainer.max_epochs >= 0 and next_epoch >= trainer.max_epochs)
            or (trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)):
        return False
    combined = getattr(loop, "_combined_loader", None)
    loaders = combined.flattened if combined is not None else []
    return any([loader.start_epoch(next_epoch) for loader in loaders if isinstance(loader, EpochLoader)])


def figure_state(tag: str, step: int, ordinal: int, figure: Any) -> dict[str, Any]:
    """A figure object (:mod:`vitlab.outputs.figures`) as a checkpoint can hold it (``weights_only`` loading):
    its image's tag, step and ordinal (images of that tag and step before it), its kind's name and its fields,
    numpy arrays as tensors (string arrays as lists)."""
    import dataclasses

    import numpy as np
    import torch

    def plain(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.tolist() if value.dtype.kind in "USO" else torch.from_numpy(np.ascontiguousarray(value))
        return value.item() if isinstance(value, np.generic) else value

    return {"tag": tag, "step": int(step), "ordinal": int(ordinal), "kind": type(figure).__name__,
            "fields": {f.name: _map_leaves(getattr(figure, f.name), plain) for f in dataclasses.fields(figure)}}


def figure_from_state(state: dict[str, Any]) -> Any:
    """The figure object of :func:`figure_state` (a kind of :mod:`vitlab.outputs.figures` only)."""
    import torch

    from vitlab.outputs import figures

    kind = getattr(figures, state["kind"], None)
    if not (isinstance(kind, type) and issubclass(kind, figures.Figure)):
        raise ValueError(f"a checkpoint lists a figure of unknown kind {state['kind']!r} (tag {state['tag']})")
    arrays = lambda value: value.numpy() if isinstance(value, torch.Tensor) else value  # noqa: E731
    return kind(**{name: _map_leaves(value, arrays) for name, value in state["fields"].items()})


def _map_leaves(value: Any, leaf) -> Any:
    """``leaf`` applied to every value inside dicts, lists and tuples (kept as such)."""
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, leaf) for v in value)
    return leaf(value)


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


def settle_outputs(trainer: pl.Trainer, epoch_end: bool) -> None:
    """Put on disk what a checkpoint written now covers (all ranks call it: metrics may synchronise);
    ``epoch_end``: the checkpoint is saved in ``on_train_epoch_end``.

    1. The training epoch's metrics (``train/acc``, ``train/loss_epoch`` ...): Lightning writes them to the
       loggers after the monitoring callbacks' ``on_train_epoch_end``, i.e. after a checkpoint saved there, and a
       run resumed from that checkpoint never logs them again. They are logged now, at the step Lightning
       gives them (its own call then finds nothing left to log).
    2. Every logger flushed (TensorBoard's writer otherwise writes on its own schedule), images the figure worker
       has written included; those it has not are listed in the checkpoint (:class:`RuntimeCallback`).
    """
    # Lightning has no public API for either step; tests/callbacks/test_lightning_internals.py pins both
    if epoch_end and trainer.training:
        loop = trainer.fit_loop.epoch_loop
        loop._batches_that_stepped -= 1  # as Lightning's fit loop does for the epoch-end metrics
        try:
            trainer._logger_connector.update_train_epoch_metrics()
        finally:
            loop._batches_that_stepped += 1
    for logger in trainer.loggers:
        logger.save()
