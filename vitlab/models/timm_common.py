"""Building blocks shared by the timm family adapters (``timm_families``, ``timm_swin_v2``,
``timm_relpos_families``): timm's explicit-attention switch, its checkpoint converters, the flat-blocks
base adapter, the attention-probability hook and the fused Q/K/V bias of attentions with separate biases.

A module of its own so that no family module imports another: each imports this one and
:mod:`vitlab.models.adapter` only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from vitlab.models.adapter import FamilyAdapter, _pair

__all__: list[str] = []  # private helpers of the timm adapters


@contextmanager
def _hooked(site: nn.Module, sink: Callable[[Tensor], None], use_output: bool) -> Iterator[None]:
    """Report the probabilities passing ``site`` (output of ``softmax`` or input of ``attn_drop``)."""
    if use_output:
        handle = site.register_forward_hook(lambda module, args, output: sink(output))
    else:
        handle = site.register_forward_pre_hook(lambda module, args: sink(args[0]))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _explicit_attention(attn: nn.Module, hook_site: nn.Module, use_output: bool,
                        sink: Callable[[Tensor], None]) -> Iterator[None]:
    """Force timm's explicit (non-fused) attention path and report the probabilities seen at
    ``hook_site`` (input of ``attn_drop`` or output of ``softmax``); restores everything on exit."""
    fused = attn.fused_attn
    attn.fused_attn = False
    try:
        with _hooked(hook_site, sink, use_output):
            yield
    finally:
        attn.fused_attn = fused


def _timm_filter(filter_fn: Callable, state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Apply timm's checkpoint converter; a file of another architecture is left for the key check."""
    try:
        return filter_fn(state_dict, model)
    except (AttributeError, KeyError, RuntimeError, ValueError, IndexError):
        return state_dict


class _TimmPlainBlocks(FamilyAdapter):
    """Shared parts of timm models with a flat ``blocks`` list and a ``stem``/``patch_embed``."""

    embed_module: str = "patch_embed"

    def _patch_embed(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.embed_module)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return _pair(self._patch_embed(model).img_size)

    def _grid(self, model: nn.Module) -> tuple[int, int]:
        return _pair(self._patch_embed(model).grid_size)


def _fused_bias(attn: nn.Module) -> Optional[Tensor]:
    """(3C',) bias q | k | v of a timm attention with separate ``q_bias`` / ``k_bias`` / ``v_bias``."""
    if attn.q_bias is None:
        return attn.qkv.bias
    k_bias = attn.k_bias if attn.k_bias is not None else torch.zeros_like(attn.q_bias)
    return torch.cat([attn.q_bias, k_bias, attn.v_bias])
