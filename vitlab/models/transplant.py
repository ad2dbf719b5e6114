"""Transplanting trained parts (patch embedding, position embedding, blocks, norms, head) into a model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

import torch
from torch import nn

from vitlab.models.adapter import unwrap_model
from vitlab.models.anatomy import part_prefixes, select_blocks
from vitlab.models.registry import get_adapter

__all__ = ["TransplantReport", "transplant", "transplant_parts"]

# block-level parts "<part>@<block>" -> adapter part (None = the whole block)
_BLOCK_PARTS = {"block": None, "norm1": "norm1", "norm2": "norm2", "mlp": "mlp", "attn": "mixer",
                "attention": "mixer", "token_mixing": "mixer"}


@dataclass(frozen=True)
class TransplantReport:
    """What :func:`transplant` copied.

    Attributes:
        parts: The requested parts.
        copied: (state_dict key, shape) of every copied tensor.
    """

    parts: tuple[str, ...]
    copied: tuple[tuple[str, tuple[int, ...]], ...]


def transplant_parts(model: nn.Module) -> list[str]:
    """Valid part names for ``model``."""
    model = unwrap_model(model)
    top = sorted(get_adapter(model).parts(model))
    mixer = "attn" if get_adapter(model).mixer_name == "attention" else "token_mixing"
    return top + ["embed", "block@<i>", "norm1@<i>", f"{mixer}@<i>", "norm2@<i>", "mlp@<i>"]


def _prefixes(model: nn.Module, part: str) -> tuple[str, ...]:
    named = part_prefixes(model, part)
    if named is not None:
        return named
    adapter = get_adapter(model)
    kind, sep, ref = part.partition("@")
    if sep and kind in _BLOCK_PARTS and ref:
        view = select_blocks(model, ref)[0]
        sub = _BLOCK_PARTS[kind]
        if sub is None:
            return (view.qualname + ".",)
        allowed = ("attn", "attention") if adapter.mixer_name == "attention" else ("token_mixing",)
        if sub == "mixer" and kind not in allowed:
            raise ValueError(f"{adapter.description} has no {kind.replace('_', ' ')}: use '{allowed[0]}@{ref}'")
        return (f"{view.qualname}.{adapter.part_names[sub]}.",)
    raise ValueError(f"unknown transplant part {part!r} for {adapter.description}: valid are "
                     + ", ".join(transplant_parts(model)))


def transplant(target: nn.Module, source: nn.Module, parts: Union[str, Iterable[str]]) -> TransplantReport:
    """Copies the named parts of ``source`` into ``target`` (same architecture); all else is untouched.

    Args:
        target: The model receiving weights (e.g. a freshly initialised one).
        source: The model giving weights (e.g. a trained one).
        parts: Names among ``patch_embed``, ``pos_embed``, ``cls_token``, ``norm``, ``head`` (where the
            family has them), ``embed`` (all before the first block), and per block ``block@3``,
            ``norm1@0``, ``attn@2``, ``norm2@1``, ``mlp@0`` (index or name such as ``stage1.block0``).

    Returns:
        A :class:`TransplantReport` listing the copied keys and shapes.

    Raises:
        ValueError: different architectures (the first mismatched key is named), unknown part.
    """
    target, source = unwrap_model(target), unwrap_model(source)
    target_family, source_family = get_adapter(target), get_adapter(source)
    if target_family.family != source_family.family:
        raise ValueError(f"cannot transplant from {source_family.description} into {target_family.description}")
    target_state, source_state = target.state_dict(), source.state_dict()
    for key in list(target_state) + [key for key in source_state if key not in target_state]:
        if key not in source_state or key not in target_state or source_state[key].shape != target_state[key].shape:
            shapes = [tuple(state[key].shape) if key in state else "absent" for state in (source_state, target_state)]
            raise ValueError(f"cannot transplant between different architectures: first mismatch at {key!r} "
                             f"(source {shapes[0]}, target {shapes[1]})")
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    prefixes = tuple(prefix for part in parts for prefix in _prefixes(target, part))
    subset = {key: value for key, value in source_state.items() if key.startswith(prefixes)}
    if not subset:
        raise ValueError(f"parts {list(parts)} match no weights of this {target_family.description}")
    with torch.no_grad():
        result = target.load_state_dict(subset, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    copied = tuple((key, tuple(value.shape)) for key, value in subset.items())
    return TransplantReport(parts=parts, copied=copied)
