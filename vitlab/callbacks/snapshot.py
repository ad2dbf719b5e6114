"""QKVSnapshot: every block's query/key/value weights on disk, once before training and every N epochs."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from vitlab.callbacks.base import EpochCallback, shared_capture, submit_epoch_work
from vitlab.qkv.state import head_counts, snapshot_name
from vitlab.outputs.files import save_safetensors
from vitlab.outputs.tensorboard import tensorboard_writer

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class QKVSnapshot(EpochCallback, pl.Callback):
    """Writes ``<run>/qkv/epoch_{k:03d}.safetensors`` with all Q/K/V weights, biases and Swin tables.

    ``k`` counts completed training epochs: ``epoch_000`` is the reference (the weights training
    starts from, before any step), written at fit start. A resumed run continues the sequence: files
    written before its checkpoint are never rewritten; one written after it (by a run killed before its next
    checkpoint) belongs to an epoch that is re-run and is replaced. Rank 0 writes, atomically (temp file + rename).

    Args:
        every_n_epochs: Write a snapshot after every N-th completed epoch (the last epoch is always written).
        dtype: ``fp32`` (exact), or ``fp16`` / ``bf16`` to halve the disk.
    """

    def __init__(self, every_n_epochs: int = 1, dtype: str = "fp32") -> None:
        super().__init__(every_n_epochs)
        if dtype not in _DTYPES:
            raise ValueError(f"QKVSnapshot.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.written: list[int] = []
        self._size_logged = False

    needs_tensorboard = False  # it writes files; the size note goes to TensorBoard only when there is one

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_epochs=self.every_n_epochs, dtype=self.dtype)

    def fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, pl_module, epoch=0)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        completed = trainer.current_epoch + 1
        is_last = trainer.max_epochs is not None and completed >= trainer.max_epochs
        if completed % self.every_n_epochs == 0 or is_last:
            self._write(trainer, pl_module, epoch=completed)

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, epoch: int) -> None:
        assert self._dir is not None, "QKVSnapshot.setup was not called"
        path = self._dir / snapshot_name(epoch)
        if epoch in self.written:
            return
        # a file not in ``written`` was left by a run killed before its next checkpoint: the epoch is being
        # re-run, so its snapshot is rewritten with the weights of the run that continues
        self.written.append(epoch)
        capture = shared_capture(trainer, pl_module)  # (the copy reaches the host and the disk on the Q/K/V worker)
        if capture is None:  # (a rank that writes nothing: it only joined a sharded network's gathers)
            return
        dtype = _DTYPES[self.dtype]
        metadata = {
            "model": str(pl_module.hparams.get("model_name", type(capture.model).__name__)) if hasattr(pl_module, "hparams") else type(capture.model).__name__,
            "heads": head_counts(capture.model),
            "epoch": epoch,
            "global_step": int(trainer.global_step),
            "dtype": self.dtype,
        }
        note = None if self._size_logged else tensorboard_writer(trainer)
        first, self._size_logged = not self._size_logged, True

        def write() -> None:
            tensors = {k: v.to(dtype) for k, v in capture.host().items()}
            save_safetensors(tensors, path, metadata)
            if first:
                size_mb = path.stat().st_size / 2**20
                rank_zero_info(f"QKVSnapshot: {len(tensors)} tensors, {size_mb:.2f} MiB per snapshot in {self._dir}")
                if note is not None:
                    note.add_text("qkv/snapshot", f"{len(tensors)} tensors, {size_mb:.2f} MiB per snapshot ({self.dtype}) in `{self._dir}`", 0)

        submit_epoch_work(trainer, pl_module, write)

    def state_dict(self) -> dict[str, Any]:
        return {"written": list(self.written), "every_n_epochs": self.every_n_epochs, "dtype": self.dtype, "size_logged": self._size_logged}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.written = [int(e) for e in state_dict.get("written", [])]
        self._size_logged = bool(state_dict.get("size_logged", self.written != []))  # one note per run
