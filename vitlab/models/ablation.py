"""Ablating residuals, norms, attention / token mixing and MLPs of trained blocks (the Attentionless article;
the identities: docs/analyses.md).

A removed branch maps x -> x, a removed residual maps x -> f(x), a removed norm is the identity
(affine part included). Blocks are patched in place on the instance (see :mod:`blockpatch`): the
state_dict keys are unchanged, so trained weights load into ablated models and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional, Union

from torch import nn

from vitlab.models.adapter import FamilyAdapter, unwrap_model
from vitlab.models.anatomy import BlockRef, blocks as all_blocks, select_blocks
from vitlab.models.blockpatch import BlockSwitches, block_state, patch_block, release_block
from vitlab.models.registry import get_adapter

__all__ = ["ablate", "ablated", "ablation_state", "ablation_components", "restore"]

_GROUPS = {"residual": ("residual_{mixer}", "residual_mlp"), "layernorm": ("norm1", "norm2")}


def ablation_components(model: nn.Module) -> list[str]:
    """Valid ``remove`` names for ``model`` (``token_mixing`` replaces ``attention`` for MLP-Mixer)."""
    mixer = get_adapter(model).mixer_name
    return ["residual", f"residual_{mixer}", "residual_mlp", "layernorm", "norm1", "norm2", mixer, "mlp"]


def _switch_names(adapter: FamilyAdapter, components: Iterable[str], valid: list[str]) -> set[str]:
    """Component names -> :class:`BlockSwitches` field names."""
    mixer = adapter.mixer_name
    field_of = {mixer: "mixer", f"residual_{mixer}": "residual_mixer", "residual_mlp": "residual_mlp",
                "norm1": "norm1", "norm2": "norm2", "mlp": "mlp"}
    switches: set[str] = set()
    for component in components:
        if component in _GROUPS:
            switches.update(field_of[name.format(mixer=mixer)] for name in _GROUPS[component])
        elif component in field_of:
            switches.add(field_of[component])
        elif mixer != "attention" and component in ("attention", "residual_attention"):
            raise ValueError(f"{adapter.description} has no attention: token mixing is an MLP; use "
                             f"{component.replace('attention', 'token_mixing')!r} (valid: {', '.join(valid)})")
        else:
            raise ValueError(f"unknown ablation component {component!r}: valid are {', '.join(valid)}")
    return switches


def ablate(model: nn.Module, remove: Union[str, Iterable[str]],
           blocks: Optional[Union[BlockRef, Iterable[BlockRef]]] = None) -> nn.Module:
    """Removes block components in place (cumulative over calls; undo with :func:`restore`).

    Args:
        model: A supported model (weights already loaded or not: keys do not change).
        remove: Any of ``residual`` (both), ``residual_attention``, ``residual_mlp``, ``layernorm``
            (both), ``norm1``, ``norm2``, ``attention``, ``mlp``; MLP-Mixer uses ``token_mixing`` /
            ``residual_token_mixing`` instead of the attention names. An empty list patches the blocks
            with everything kept (bit-identical to the library).
        blocks: Global indices or names (``stage1.block0``) of the blocks to change; None = all.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: unknown component (valid ones listed), ``attention`` on MLP-Mixer, bad block.
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    remove = [remove] if isinstance(remove, str) else list(remove)
    switches_off = _switch_names(adapter, remove, ablation_components(model))
    for view in select_blocks(model, blocks):
        state = patch_block(view.module, adapter)
        state.switches = replace(state.switches, **{name: False for name in switches_off})
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undoes every ablation (keeps capture taps that are active)."""
    model = unwrap_model(model)
    for view in all_blocks(model):
        state = block_state(view.module)
        if state is not None:
            state.switches = BlockSwitches()
            release_block(view.module)
    return model


def ablation_state(model: nn.Module) -> dict[str, list[str]]:
    """Removed switches per ablated block: ``{block name: ["mixer", "residual_mlp", ...]}``."""
    model = unwrap_model(model)
    result = {}
    for view in all_blocks(model):
        state = block_state(view.module)
        if state is not None and not state.switches.all_on():
            result[view.name] = [name for name, on in vars(state.switches).items() if not on]
    return result


@contextmanager
def ablated(model: nn.Module, remove: Union[str, Iterable[str]],
            blocks: Optional[Union[BlockRef, Iterable[BlockRef]]] = None) -> Iterator[nn.Module]:
    """Context manager form of :func:`ablate`; the previous switches come back on exit (also on error)."""
    model = unwrap_model(model)
    saved = {view.global_index: replace(block_state(view.module).switches)
             for view in all_blocks(model) if block_state(view.module) is not None}
    try:
        yield ablate(model, remove, blocks)
    finally:
        for view in all_blocks(model):
            state = block_state(view.module)
            if state is not None:
                state.switches = saved.get(view.global_index, BlockSwitches())
                release_block(view.module)
