"""Recording post-softmax attention probabilities of every block (and Swin's dense token form)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Optional, Union

import torch
from torch import Tensor, nn

from vitlab.models.adapter import BlockView, FamilyAdapter, unwrap_model, window_slot_tokens
from vitlab.models.anatomy import BlockRef, select_blocks
from vitlab.models.registry import get_adapter

__all__ = ["AttentionRecord", "dense_window_attention", "record_attention"]


def dense_window_attention(window_probs: Tensor, slot_tokens: Tensor, num_tokens: int) -> Tensor:
    """Scatter Swin window probabilities into a token x token matrix in original token order.

    Args:
        window_probs: (B*nW, H, T, T) probabilities of the windows (T = window area).
        slot_tokens: (nW, T) original token index of every window slot; pad slots hold ``num_tokens``.
        num_tokens: Tokens N of the (unpadded) grid.

    Returns:
        (B, H, N, N); zero between tokens in different windows. Rows sum to 1 unless the grid was padded
        (the pad keys' share of the probability is dropped).
    """
    num_windows, area = slot_tokens.shape
    batch = window_probs.shape[0] // num_windows
    heads = window_probs.shape[1]
    probs = window_probs.reshape(batch, num_windows, heads, area, area).transpose(1, 2)  # (B, H, nW, T, T)
    slots = slot_tokens.to(window_probs.device)
    rows = slots[:, :, None].expand(num_windows, area, area)
    cols = slots[:, None, :].expand(num_windows, area, area)
    dense = window_probs.new_zeros(batch, heads, num_tokens + 1, num_tokens + 1)
    dense[:, :, rows, cols] = probs
    return dense[:, :, :num_tokens, :num_tokens]


class AttentionRecord:
    """Attention probabilities recorded by :func:`record_attention`.

    Attributes:
        views: The recorded blocks by name.
        grids: Runtime token grid (H, W) per block name (for Swin, the grid the windows tile); (D, H, W) for
            3-D models.
    """

    def __init__(self, views: list[BlockView], adapter: FamilyAdapter, to_cpu: bool):
        self._adapter = adapter
        self.views = {view.name: view for view in views}
        self.grids: dict[str, tuple[int, int]] = {view.name: view.grid for view in views}
        self._to_cpu = to_cpu
        self._chunks: dict[str, list[Tensor]] = {view.name: [] for view in views}

    def _sink(self, name: str):
        def store(probs: Tensor) -> None:
            probs = probs.detach()
            self._chunks[name].append(probs.cpu() if self._to_cpu else probs)
        return store

    @property
    def attentions(self) -> dict[str, Tensor]:
        """Block name -> probabilities concatenated over forward passes: (B, heads, N, N) for ViT
        (prefix tokens included), (B*nW, heads, w*w, w*w) raw windows for Swin (shifted-window order)."""
        joined = {}
        for name, chunks in self._chunks.items():
            if len(chunks) > 1:
                self._chunks[name] = chunks = [torch.cat(chunks, dim=0)]
            if chunks:
                joined[name] = chunks[0]
        return joined

    def dense(self, name: str) -> Tensor:
        """Token x token probabilities (B, heads, N, N) of block ``name`` in original token order
        (Swin windows scattered and the cyclic shift undone; ViT returned as recorded)."""
        attentions = self.attentions
        if name not in attentions:
            raise KeyError(f"no attention recorded for block {name!r}; recorded: {sorted(attentions)}")
        view = self.views[name]
        geometry = self._adapter.window_geometry(view.module, self.grids[name])
        if geometry is None:
            return attentions[name]
        window, shift, roll_before_pad = geometry
        grid = self.grids[name]
        slots = window_slot_tokens(grid, window, shift, roll_before_pad)
        return dense_window_attention(attentions[name], slots, math.prod(grid))

    def patch_windows(self, name: str) -> tuple[Tensor, Tensor]:
        """Attention among patch tokens in the groups it is computed over, for per-pair statistics.

        The same form for every family, without the memory of the dense Swin matrix: ViT is one group of
        all patch tokens (prefix tokens dropped, so rows sum to 1 minus the mass on them); Swin gives its
        raw windows, whose pairs are exactly the token pairs that interact.

        Returns:
            ``probs`` (B*G, heads, T, T) over the T slots of each of the G groups, and ``slots`` (G, T):
            the patch-token index (row-major in ``grids[name]``) of every slot; pad slots hold the number of
            patch tokens (H*W, or D*H*W for 3-D models).
        """
        attentions = self.attentions
        if name not in attentions:
            raise KeyError(f"no attention recorded for block {name!r}; recorded: {sorted(attentions)}")
        grid = self.grids[name]
        geometry = self._adapter.window_geometry(self.views[name].module, grid)
        if geometry is None:
            prefix = self.views[name].num_prefix_tokens
            probs = attentions[name][:, :, prefix:, prefix:]  # (B, heads, T, T)
            return probs, torch.arange(probs.shape[-1]).unsqueeze(0)
        window, shift, roll_before_pad = geometry
        return attentions[name], window_slot_tokens(grid, window, shift, roll_before_pad)


@contextmanager
def record_attention(model: nn.Module, blocks: Optional[Union[BlockRef, Iterable[BlockRef]]] = None,
                     to_cpu: bool = False) -> Iterator[AttentionRecord]:
    """Records post-softmax attention of the chosen blocks during the forwards run inside the context.

    timm models switch to their explicit attention path while recording (outputs equal up to
    fused-kernel rounding, ~1e-6); torchvision ViT asks ``nn.MultiheadAttention`` for per-head weights;
    torchvision Swin's functional softmax is intercepted. Every flag and hook is restored on exit,
    also after an exception.

    Args:
        model: A supported model with attention (not MLP-Mixer).
        blocks: Global indices or names; None = all blocks.
        to_cpu: Move recorded probabilities to the CPU as they arrive.

    Yields:
        An :class:`AttentionRecord` (``.attentions``, ``.dense(name)``, ``.grids``).

    Raises:
        ValueError: for MLP-Mixer (no attention) or bad block references.
    """
    model = unwrap_model(model)
    adapter = get_adapter(model)
    if adapter.mixer_name != "attention":
        raise ValueError(f"{adapter.description} has no attention to record: token mixing is an MLP")
    views = select_blocks(model, blocks)
    record = AttentionRecord(views, adapter, to_cpu)
    with ExitStack() as stack:
        for view in views:
            stack.enter_context(adapter.attention_recorder(view.module, record._sink(view.name)))
            if view.window_size is not None:
                hook = _grid_hook(record, view.name, adapter)
                stack.callback(view.module.register_forward_pre_hook(hook).remove)
        yield record


def _grid_hook(record: AttentionRecord, name: str, adapter: FamilyAdapter):
    """Forward pre-hook storing the runtime (H, W) (3-D: (D, H, W)) of a Swin block call."""
    def hook(module: nn.Module, args: tuple) -> None:
        record.grids[name] = adapter.runtime_grid(module, args)
    return hook
