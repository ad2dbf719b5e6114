"""Shared plumbing of the Q/K/V callbacks: flat weight state, run folders, strategy checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vitlab import models

MATRICES = ("q", "k", "v")


def unwrap(pl_module: Any) -> torch.nn.Module:
    """The network inside a LightningModule (``.model`` by vitlab convention), else the module itself."""
    return getattr(pl_module, "model", pl_module)


def check_strategy(trainer: Any, owner: str) -> None:
    """Refuse strategies whose sharded weights this callback cannot read yet (one clear line)."""
    name = type(getattr(trainer, "strategy", None)).__name__
    if "FSDP" in name or "DeepSpeed" in name:
        raise RuntimeError(
            f"{owner} does not support {name} yet (weights are sharded across ranks); "
            "use strategy ddp / ddp_spawn / auto, or remove the callback"
        )


def qkv_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Flat CPU float32 copies of every attention block's Q/K/V weights, biases and rel-pos tables.

    Keys: ``{block}.{q|k|v}.weight`` (out, in), ``{block}.{q|k|v}.bias`` (out,) when present and
    ``{block}.rel_pos_table`` ((2w-1)^2, heads) for Swin.
    """
    state: dict[str, torch.Tensor] = {}
    views = models.qkv(model)
    tables = {b.name: b.rel_pos_table for b in models.blocks(model) if b.has_attention}
    for block, parts in views.items():
        for m in MATRICES:
            state[f"{block}.{m}.weight"] = parts[m].detach().to("cpu", torch.float32, copy=True)
            bias = parts.get(f"{m}_bias")
            if bias is not None:
                state[f"{block}.{m}.bias"] = bias.detach().to("cpu", torch.float32, copy=True)
        table = tables.get(block)
        if table is not None:
            state[f"{block}.rel_pos_table"] = table.detach().to("cpu", torch.float32, copy=True)
    return state


def head_counts(model: torch.nn.Module) -> dict[str, int]:
    """Block name -> number of attention heads."""
    return {b.name: b.num_heads for b in models.blocks(model) if b.has_attention}


def block_stage(name: str) -> str:
    """``stage2.block5`` -> ``stage2``."""
    return name.split(".", 1)[0]


def snapshot_dir(trainer: Any, subdir: str = "qkv") -> Path:
    """``<run>/qkv``. Must be called on every rank: ``trainer.log_dir`` is a collective under DDP."""
    log_dir = trainer.log_dir
    root = Path(log_dir) if log_dir else Path(trainer.default_root_dir)
    return root / subdir


def snapshot_name(epoch: int) -> str:
    """File name of the snapshot after ``epoch`` completed epochs (000 = the reference)."""
    return f"epoch_{epoch:03d}.safetensors"


def load_snapshot(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a snapshot written by :class:`QKVSnapshot`: float32 tensors and decoded metadata."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata() or {}
        for key in handle.keys():
            tensors[key] = handle.get_tensor(key).float()
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except (json.JSONDecodeError, TypeError):
            meta[key] = value
    return tensors, meta


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
