"""What the Lightning callbacks share: the every-N-epochs setting, the run folder, the strategy check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitlab import models
from vitlab.qkv.state import unwrap


def check_strategy(trainer: Any, owner: str) -> None:
    """Refuse strategies whose sharded weights this callback cannot read yet (one clear line)."""
    name = type(getattr(trainer, "strategy", None)).__name__
    if "FSDP" in name or "DeepSpeed" in name:
        raise RuntimeError(
            f"{owner} does not support {name} yet (weights are sharded across ranks); "
            "use strategy ddp / ddp_spawn / auto, or remove the callback"
        )


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
