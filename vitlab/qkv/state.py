"""The flat Q/K/V state of a model and its snapshot files: what callbacks and probes share (no Lightning)."""

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


def qkv_views(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The live (not copied) Q/K/V weights, biases and rel-pos tables of every attention block (or of the blocks
    ``names``), under the keys of :func:`qkv_state`."""
    state: dict[str, torch.Tensor] = {}
    views = models.qkv(model, names)
    tables = {b.name: b.rel_pos_table for b in models.blocks(model) if b.has_attention and b.name in views}
    for block, parts in views.items():
        for m in MATRICES:
            state[f"{block}.{m}.weight"] = parts[m].detach()
            bias = parts.get(f"{m}_bias")
            if bias is not None:
                state[f"{block}.{m}.bias"] = bias.detach()
        table = tables.get(block)
        if table is not None:
            state[f"{block}.rel_pos_table"] = table.detach()
    return state


def qkv_state(model: torch.nn.Module, device: str | torch.device | None = "cpu") -> dict[str, torch.Tensor]:
    """Flat float32 copies of every attention block's Q/K/V weights, biases and rel-pos tables.

    Keys: ``{block}.{q|k|v}.weight`` (out, in), ``{block}.{q|k|v}.bias`` (out,) when present and
    ``{block}.rel_pos_table`` ((2w-1)^2, heads) for Swin.

    Args:
        model: A supported model.
        device: Where the copies go (default the CPU); None: beside the weights (see :class:`QKVCapture` for a
            copy that never waits for the device).
    """
    return {key: value.to(value.device if device is None else device, torch.float32, copy=True)
            for key, value in qkv_views(model).items()}


class QKVCapture:
    """A copy of the Q/K/V state taken beside the weights without waiting for the device, and its host copy.

    Taking it launches one concatenation into a flat float32 buffer on the weights' device (on a GPU, queued behind
    the training step that produced the weights; the host does not wait). :meth:`host` then copies the buffer to
    pinned host memory and waits for that copy only: call it off the training thread (the Q/K/V callbacks' worker).
    Both dictionaries hold views of one flat buffer each, under :func:`qkv_state`'s keys.

    Of a network sharded across ranks (:func:`vitlab.models.shard`), the blocks are made whole one at a time and each
    block's part copied there (:func:`vitlab.models.whole_blocks`): a collective, so every rank takes the capture at
    the same point; ``keep=False`` (the ranks that write nothing) joins the gathers and copies nothing.

    Args:
        model: A supported model.
        step: The optimizer step the weights belong to (for whoever shares the capture).
        keep: Copy the weights (False: only join a sharded network's gathers; :attr:`tensors` is then empty).
    """

    def __init__(self, model: torch.nn.Module, step: int = 0, keep: bool = True) -> None:
        self.step = step
        self.keys, self.shapes, parts = [], [], []
        for names in models.whole_blocks(model):
            if not keep:
                continue
            views = qkv_views(model, names)
            self.keys += list(views)
            self.shapes += [tuple(v.shape) for v in views.values()]
            part = torch.cat([v.reshape(-1).float() for v in views.values()])  # one kernel on the device
            if part.data_ptr() in {v.data_ptr() for v in views.values()}:  # one tensor: cat may return it as it is
                part = part.clone()
            parts.append(part)
        if not parts:
            parts.append(torch.zeros(0))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # (total,)
        self.device = flat.device
        self._flat = flat
        self.tensors = self._split(flat)
        self._event = None
        if flat.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._host: dict[str, torch.Tensor] | None = None

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        return {k: part.view(shape) for k, part, shape in zip(self.keys, flat.split(sizes), self.shapes)}

    def host(self) -> dict[str, torch.Tensor]:
        """The state in host memory (on the CPU: :attr:`tensors` themselves). Waits for the copy, not the training."""
        if self._host is None:
            if self._flat.is_cuda:
                buffer = torch.empty(self._flat.shape, dtype=torch.float32, pin_memory=True)
                with torch.cuda.device(self._flat.device):
                    torch.cuda.current_stream().wait_event(self._event)
                    buffer.copy_(self._flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                done.synchronize()
                self._host = self._split(buffer)
            else:
                self._host = self.tensors
        return self._host


def head_counts(model: torch.nn.Module) -> dict[str, int]:
    """Block name -> number of attention heads."""
    return {b.name: b.num_heads for b in models.blocks(model) if b.has_attention}


def block_stage(name: str) -> str:
    """``stage2.block5`` -> ``stage2``."""
    return name.split(".", 1)[0]


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
