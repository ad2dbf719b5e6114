"""Optimizer parameter groups (weight decay, layer-wise lr decay) and freezing parts of a model."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional, Union

from torch import nn

from vitlab.models.adapter import unwrap_model
from vitlab.models.anatomy import part_prefixes
from vitlab.models.registry import get_adapter

__all__ = ["NO_WEIGHT_DECAY_NAMES", "freeze", "layer_ids", "parameter_groups"]

# parameters never decayed besides every 0/1-d tensor (norm weights, biases)
NO_WEIGHT_DECAY_NAMES = frozenset({
    "pos_embed", "pos_embedding", "absolute_pos_embed", "cls_token", "class_token", "reg_token", "dist_token",
    "relative_position_bias_table", "logit_scale",
})
_BLOCK_RANGE = re.compile(r"^blocks:(\d+)(?:-(\d+))?$")


def _block_prefixes(model: nn.Module) -> list[tuple[str, int]]:
    """(state-dict prefix, global block index) of every block."""
    adapter = get_adapter(model)
    return [(view.qualname + ".", view.global_index) for view in adapter.block_views(model)]


def layer_ids(model: nn.Module) -> dict[str, int]:
    """Layer id of every parameter for layer-wise lr decay.

    Embedding (everything before the first block) = 0, block g = g + 1 (Swin patch merging joins the
    block it feeds), everything after the blocks (final norm, head) = ``num_blocks + 1``.
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    block_prefixes = _block_prefixes(model)
    entry_prefixes = adapter.stage_entry_prefixes(model)
    embedding_prefixes = tuple(adapter.embedding_prefixes(model))
    last = len(block_prefixes) + 1
    ids = {}
    for name, _ in model.named_parameters():
        layer = next((index + 1 for prefix, index in block_prefixes if name.startswith(prefix)), None)
        if layer is None:
            layer = next((index + 1 for prefix, index in entry_prefixes.items() if name.startswith(prefix)), None)
        if layer is None:
            layer = 0 if name.startswith(embedding_prefixes) else last
        ids[name] = layer
    return ids


def _no_decay(name: str, ndim: int, extra: set[str]) -> bool:
    return ndim <= 1 or name.rsplit(".", 1)[-1] in NO_WEIGHT_DECAY_NAMES or name in extra


def parameter_groups(model: nn.Module, weight_decay: float, layer_decay: Optional[float] = None) -> list[dict]:
    """AdamW parameter groups covering every trainable parameter exactly once.

    No decay on norms, biases (every 0/1-d tensor), position embeddings, class/register tokens and
    Swin's ``relative_position_bias_table``. With ``layer_decay`` each group also carries
    ``lr_scale = layer_decay ** (num_layers - layer_id)`` (``num_layers = num_blocks + 1``, see
    :func:`layer_ids`); multiply the group's lr by it (timm's schedulers do this themselves).

    A detector / segmenter (a model with ``vitlab_backbone()``) gets its backbone's groups, and its other
    parameters (pyramid, heads) join them as the last layer.

    Args:
        model: A supported model.
        weight_decay: Decay for the decayed groups.
        layer_decay: Layer-wise lr decay factor in (0, 1], or None for two groups only.

    Returns:
        Groups ``{"params", "weight_decay", "name"[, "lr_scale", "layer_id"]}`` for ``torch.optim``
        (``name`` is what Lightning's LearningRateMonitor shows).
    """
    outer = getattr(model, "_orig_mod", model)
    model = unwrap_model(model)
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if layer_decay is not None and not 0 < layer_decay <= 1:
        raise ValueError(f"layer_decay must be in (0, 1] or None, got {layer_decay}")
    extra = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    ids = layer_ids(model) if layer_decay is not None else {}
    num_layers = len(_block_prefixes(model)) + 1
    groups: dict[tuple[int, bool], dict] = {}
    inside = {id(param) for param in model.parameters()}  # a task model's heads join the last layer
    heads = [(name, param) for name, param in outer.named_parameters() if id(param) not in inside]
    for name, param in [*model.named_parameters(), *heads]:
        if not param.requires_grad:
            continue
        no_decay = _no_decay(name, param.ndim, extra)
        layer = ids.get(name, num_layers if layer_decay is not None and id(param) not in inside else -1)
        key = (layer, no_decay)
        if key not in groups:
            kind = "no_decay" if no_decay else "decay"
            group = {"params": [], "weight_decay": 0.0 if no_decay else float(weight_decay),
                     "name": kind if layer < 0 else f"layer{layer}_{kind}"}
            if layer >= 0:
                group.update(layer_id=layer, lr_scale=float(layer_decay ** (num_layers - layer)))
            groups[key] = group
        groups[key]["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def _valid_parts(model: nn.Module) -> list[str]:
    parts = sorted(get_adapter(model).parts(model))
    return parts + ["embed", "blocks:<i> or blocks:<i>-<j> (inclusive)", "all_but_head", "all"]


def _part_prefixes(model: nn.Module, part: str) -> tuple[str, ...]:
    named = part_prefixes(model, part)
    if named is not None:
        return named
    if part == "all":
        return ("",)
    match = _BLOCK_RANGE.match(part)
    if match:
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        block_prefixes = _block_prefixes(model)
        if first > last or last >= len(block_prefixes):
            raise ValueError(f"freeze part {part!r} out of range: blocks are 0-{len(block_prefixes) - 1}")
        return tuple(prefix for prefix, index in block_prefixes if first <= index <= last)
    raise ValueError(f"unknown freeze part {part!r} for {get_adapter(model).description}: valid parts are "
                     + ", ".join(_valid_parts(model)))


def freeze(model: nn.Module, parts: Union[str, Iterable[str]]) -> list[str]:
    """Sets ``requires_grad = False`` on the named parts.

    Args:
        model: A supported model.
        parts: Names among ``patch_embed``, ``pos_embed``, ``cls_token``, ``norm``, ``head`` (where the
            family has them), ``embed`` (everything before the first block), ``blocks:0-3`` (global
            block indices, inclusive), ``all_but_head``, ``all``.

    Returns:
        Names of the parameters frozen.

    Raises:
        ValueError: unknown part (the message lists the valid ones) or block range out of range.
    """
    model = unwrap_model(model)
    parts = [parts] if isinstance(parts, str) else list(parts)
    names = [name for name, _ in model.named_parameters()]
    selected: set[str] = set()
    for part in parts:
        if part == "all_but_head":
            head = _part_prefixes(model, "head")
            selected.update(name for name in names if not name.startswith(head))
            continue
        prefixes = _part_prefixes(model, part)
        selected.update(name for name in names if name.startswith(prefixes))
    frozen = []
    for name, param in model.named_parameters():
        if name in selected:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
