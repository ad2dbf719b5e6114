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
