"""One re-implementation of a transformer block forward, used for ablation and capture.

Every supported pre-norm block computes ``x = x + branch1(norm1(x))`` then ``x = x + branch2(norm2(x))``
(branch1 = attention or token-mixing MLP, branch2 = channel MLP, each including the library's
LayerScale / drop-path / dropout); a res-post-norm block (Swin V2, adapter ``norm_placement = "post"``)
computes ``x = x + drop_path(norm1(branch1(x)))`` then ``x = x + drop_path(norm2(branch2(x)))``, so there
``qkv_input`` / ``mlp_input`` are the stream itself and a removed norm drops the norm inside the branch
(a norm on the stream after both adds, Swin V2-Cr's ``norm3``, is always kept). :func:`patched_forward`
replays exactly the library's operations through the family adapter, so with every switch on it is
bit-identical to the library forward, while switches drop a branch, a norm or a residual, and taps report
the intermediate tensors. The forward is installed on the block *instance*, so the state_dict is untouched
and weights load into patched models.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

from torch import Tensor, nn

from vitlab.models.adapter import FamilyAdapter

__all__ = ["BlockState", "BlockSwitches", "TAP_SITES", "block_state", "patch_block", "patched_forward",
           "release_block"]

# sites reported to taps, in forward order; shapes are the block's own layout
TAP_SITES = ("qkv_input", "attn", "mlp_input", "mlp", "resid")
_STATE_KEY = "_vitlab_block_state"


@dataclass
class BlockSwitches:
    """Which parts of a block run (all True = the library block)."""

    mixer: bool = True
    mlp: bool = True
    norm1: bool = True
    norm2: bool = True
    residual_mixer: bool = True
    residual_mlp: bool = True

    def all_on(self) -> bool:
        return all(getattr(self, item.name) for item in fields(self))


class BlockState:
    """Per-block patch state: the adapter, cached parts, switches and taps."""

    def __init__(self, adapter: FamilyAdapter, block: nn.Module):
        self.adapter = adapter
        self.norm1 = adapter.part(block, "norm1")
        self.norm2 = adapter.part(block, "norm2")
        self.switches = BlockSwitches()
        self.taps: dict[str, list[Callable[[Tensor], None]]] = {}
        self.previous_forward = block.__dict__.get("forward")

    def idle(self) -> bool:
        return self.switches.all_on() and not any(self.taps.values())


def _emit(taps: dict[str, list[Callable[[Tensor], None]]], site: str, tensor: Tensor) -> None:
    for tap in taps.get(site, ()):
        tap(tensor)


def patched_forward(block: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    """The block forward with switches and taps (x: (B, N, C), or (B, H, W, C) for Swin); further
    arguments of the library call go to the token-mixing branch."""
    state: BlockState = block.__dict__[_STATE_KEY]
    switches, taps, adapter = state.switches, state.taps, state.adapter
    post = adapter.norm_placement == "post"
    if switches.mixer:
        if post:
            _emit(taps, "qkv_input", x)
            branch = adapter.mixer_branch(block, x, *args, norm=state.norm1 if switches.norm1 else _identity, **kwargs)
        else:
            h = state.norm1(x) if switches.norm1 else x
            _emit(taps, "qkv_input", h)
            branch = adapter.mixer_branch(block, h, *args, **kwargs)
        _emit(taps, "attn", branch)
        x = x + branch if switches.residual_mixer else branch
    x, undo_layout = adapter.to_mlp_layout(x)
    if switches.mlp:
        if post:
            _emit(taps, "mlp_input", x)
            branch = adapter.mlp_branch(block, x, norm=state.norm2 if switches.norm2 else _identity)
        else:
            h = state.norm2(x) if switches.norm2 else x
            _emit(taps, "mlp_input", h)
            branch = adapter.mlp_branch(block, h)
        _emit(taps, "mlp", branch)
        x = x + branch if switches.residual_mlp else branch
    x = undo_layout(adapter.main_branch_norm(block, x))
    _emit(taps, "resid", x)
    return adapter.block_output(x)


def _identity(x: Tensor) -> Tensor:
    return x


def block_state(block: nn.Module) -> BlockState | None:
    """The patch state of a block, or None when it runs the library forward."""
    return block.__dict__.get(_STATE_KEY)


def patch_block(block: nn.Module, adapter: FamilyAdapter) -> BlockState:
    """Installs :func:`patched_forward` on ``block`` (idempotent) and returns its state."""
    state = block_state(block)
    if state is None:
        state = BlockState(adapter, block)
        block.__dict__[_STATE_KEY] = state
        block.forward = functools.partial(patched_forward, block)  # picklable and deep-copyable
    return state


def release_block(block: nn.Module, force: bool = False) -> None:
    """Puts the library forward back when no switch is off and no tap is set (or when ``force``)."""
    state = block_state(block)
    if state is None or not (force or state.idle()):
        return
    del block.__dict__[_STATE_KEY]
    if state.previous_forward is None:
        del block.forward
    else:
        block.forward = state.previous_forward
