"""What the Lightning callbacks share: the every-N-epochs setting, the run folder, the strategy check, and the
per-epoch work off the training thread (one capture of the Q/K/V weights per step, one worker per run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vitlab import models
from vitlab.qkv.state import QKVCapture, unwrap
from vitlab.qkv.worker import QKVWorker


def check_strategy(trainer: Any, owner: str) -> None:
    """Refuse strategies whose sharded weights this callback cannot read (one clear line): FSDP1 and DeepSpeed.
    Weights sharded with FSDP2 (Lightning's ``ModelParallelStrategy``, :func:`vitlab.models.shard`) are read."""
    name = type(getattr(trainer, "strategy", None)).__name__
    if "FSDP" in name or "DeepSpeed" in name:
        raise RuntimeError(
            f"{owner} does not support {name} (weights sharded in a way it cannot read); shard with FSDP2 instead "
            "(strategy: pytorch_lightning.strategies.ModelParallelStrategy with init_args data_parallel_size: <devices>, "
            "tensor_parallel_size: 1, save_distributed_checkpoint: false), use ddp / auto, or remove the callback"
        )


def loads_after_fit_start(trainer: Any) -> bool:
    """Whether the strategy loads a resumed fit's checkpoint only after ``on_fit_start`` (it does not say yet, then,
    whether there is one: ``trainer.ckpt_path`` is set when it loads)."""
    return bool(trainer.strategy.restore_checkpoint_after_setup)


def snapshot_dir(trainer: Any, subdir: str = "qkv") -> Path:
    """``<run>/qkv``. Must be called on every rank: ``trainer.log_dir`` is a collective under DDP."""
    log_dir = trainer.log_dir
    root = Path(log_dir) if log_dir else Path(trainer.default_root_dir)
    return root / subdir


class EpochCallback:
    """Mixin of the Q/K/V callbacks: ``every_n_epochs`` validation, a state key per setting, run folder.

    Subclasses set ``needs_tensorboard`` and call ``super().__init__(every_n_epochs)``.
    """

    needs_tensorboard = True

    def __init__(self, every_n_epochs: int = 1) -> None:
        if every_n_epochs < 1:
            raise ValueError(f"{type(self).__name__}.every_n_epochs must be >= 1, got {every_n_epochs}")
        self.every_n_epochs = every_n_epochs
        self._dir: Path | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_epochs=self.every_n_epochs)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        owner = type(self).__name__
        check_strategy(trainer, owner)
        model = unwrap(pl_module)
        if not any(b.has_attention for b in models.blocks(model)):
            raise ValueError(
                f"{owner}: {models.family_name(model)} model has no attention blocks (no query/key/value); "
                "remove the Q/K/V callbacks from trainer.callbacks for this model"
            )
        if self.needs_tensorboard:
            from vitlab.outputs.tensorboard import require_tensorboard

            require_tensorboard(trainer, owner)
        self._dir = snapshot_dir(trainer)  # collective under DDP: every rank calls it

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not loads_after_fit_start(trainer):
            self.fit_start(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if loads_after_fit_start(trainer):
            self.fit_start(trainer, pl_module)

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The callback's work as the fit starts, with a resumed fit's checkpoint (weights and this callback's state)
        loaded: at ``on_fit_start``, or at ``on_train_start`` under strategies that load the checkpoint after
        ``on_fit_start`` (sharded ones: ModelParallelStrategy, FSDP, DeepSpeed)."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """A checkpoint never exists before the work of the epochs it covers is on disk: the run's checkpoint writer
        waits for it on its own thread (:class:`vitlab.checkpoint_writer.BackgroundCheckpointIO`); any other writer
        writes at once, so the work is finished here first."""
        from vitlab.checkpoint_writer import settles_checkpoints

        worker = getattr(trainer, "_vitlab_qkv_worker", None)
        if worker is not None and not settles_checkpoints(trainer.strategy.checkpoint_io):
            worker.flush()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        finish_epoch_work(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        finish_epoch_work(trainer, raise_errors=False)


def shared_capture(trainer: Any, pl_module: Any) -> QKVCapture | None:
    """The Q/K/V weights of this optimizer step on rank 0, captured once for every Q/K/V callback that asks at this
    step; None on the other ranks.

    Call it on every rank at the same points (the callbacks decide whether to act from state every rank holds alike):
    a network sharded across the ranks (:func:`vitlab.models.shard`) is gathered block by block for the copy, a
    collective the other ranks join without copying; an unsharded one is read on rank 0 alone."""
    model = unwrap(pl_module)
    zero = trainer.is_global_zero
    if not zero and not models.is_sharded(model):
        return None
    capture = getattr(trainer, "_vitlab_qkv_capture", None)
    if capture is None or capture.step != trainer.global_step or capture.model is not model:
        capture = QKVCapture(model, trainer.global_step, keep=zero)
        capture.model = model
        trainer._vitlab_qkv_capture = capture
    return capture if zero else None


def qkv_worker(trainer: Any, pl_module: Any) -> QKVWorker:
    """The run's :class:`~vitlab.qkv.worker.QKVWorker`: a background thread when the weights are on a GPU, else
    inline (see :mod:`vitlab.qkv.worker`)."""
    worker = getattr(trainer, "_vitlab_qkv_worker", None)
    if worker is None:
        worker = QKVWorker(background=next(unwrap(pl_module).parameters()).is_cuda)
        worker.epoch = None
        trainer._vitlab_qkv_worker = worker
    return worker


def submit_epoch_work(trainer: Any, pl_module: Any, job: Callable[[], Any]) -> None:
    """Hand one callback's work of this epoch to the run's worker. At most one epoch's work waits: the first job of
    an epoch waits for the previous epoch's (a worker slower than the epochs makes training wait, not memory grow)."""
    worker = qkv_worker(trainer, pl_module)
    epoch = (trainer.current_epoch, trainer.global_step)
    if worker.epoch != epoch:
        worker.wait_done(worker.submitted)
        worker.epoch = epoch
    worker.submit(job)


def finish_epoch_work(trainer: Any, raise_errors: bool = True) -> None:
    """Wait for every job handed to the run's worker; then let its thread end (the end of a fit, an exception)."""
    worker = getattr(trainer, "_vitlab_qkv_worker", None)
    if worker is None:
        return
    trainer._vitlab_qkv_worker = None
    flush_and_close(worker, raise_errors)


def flush_and_close(worker: Any, raise_errors: bool = True) -> None:
    """Wait for what a background worker (Q/K/V or figures) was handed, then close it; a job's error is raised
    unless ``raise_errors`` is False (an exception is already on its way)."""
    try:
        worker.flush()
    except Exception:
        if raise_errors:
            raise
    finally:
        worker.close()
