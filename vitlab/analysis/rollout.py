"""Attention rollout (Abnar & Zuidema 2020) and token-grid helpers (docs/analyses.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["attention_rollout", "rollout_map", "pool_tokens", "pool_window_attention", "window_query_rows"]

_FUSIONS = ("mean", "max", "min")


def attention_rollout(
    attentions: Sequence[Tensor],
    residual_weight: float = 0.5,
    head_fusion: Literal["mean", "max", "min"] = "mean",
) -> Tensor:
    """Roll attention out through the layers: R = A_hat_L ... A_hat_1.

    A_hat_l = (1 - w) * fuse_h(A_l) + w * I, rows renormalised to sum to 1 (the identity stands for the
    residual path), with w = ``residual_weight``; with the defaults A_hat = mean_h(A)/2 + I/2.
    Uniform attention gives R = w^L I + (1 - w^L) 11^T / N.

    Args:
        attentions: per layer, in forward order, (B, H, N, N) post-softmax attention (rows = queries), all
            with the same N. Swin stages differ in N: pool earlier stages with :func:`pool_tokens` first.
        residual_weight: w in [0, 1].
        head_fusion: how heads are combined: "mean" (the paper), "max" or "min".

    Returns:
        (B, N, N) rollout; row i is how much query token i draws from each input token. float32 for
        half-precision input, else the input dtype.
    """
    if len(attentions) == 0:
        raise ValueError("attention_rollout: need at least one attention tensor")
    if head_fusion not in _FUSIONS:
        raise ValueError(f"attention_rollout: head_fusion must be one of {_FUSIONS}, got {head_fusion!r}")
    if not 0.0 <= residual_weight <= 1.0:
        raise ValueError(f"attention_rollout: residual_weight must be in [0, 1], got {residual_weight}")
    first = attentions[0]
    if first.ndim != 4 or first.shape[-1] != first.shape[-2]:
        raise ValueError(f"attention_rollout: layer 0 attention must be (B, H, N, N), got {tuple(first.shape)}")
    batch, _, tokens, _ = first.shape
    dtype = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
    eye = torch.eye(tokens, dtype=dtype, device=first.device)  # (N, N)
    rollout = eye.expand(batch, tokens, tokens)
    for layer, attn in enumerate(attentions):
        if attn.ndim != 4 or attn.shape[0] != batch or attn.shape[-2:] != (tokens, tokens):
            raise ValueError(
                f"attention_rollout: layer {layer} attention has shape {tuple(attn.shape)}, expected "
                f"({batch}, H, {tokens}, {tokens}); pool stages of other resolutions with pool_tokens"
            )
        a = attn.detach().to(dtype)
        fused = a.mean(1) if head_fusion == "mean" else a.amax(1) if head_fusion == "max" else a.amin(1)  # (B, N, N)
        a_hat = (1.0 - residual_weight) * fused + residual_weight * eye  # (B, N, N)
        a_hat = a_hat / a_hat.sum(-1, keepdim=True)  # rows sum to 1
        rollout = a_hat @ rollout  # (B, N, N): later layers multiply from the left
    return rollout


def rollout_map(rollout: Tensor, num_prefix_tokens: int, grid: tuple[int, ...]) -> Tensor:
    """Rollout as an image-shaped map over the patch grid.

    With prefix tokens (CLS, distillation, registers) the map is the first prefix token's row over the patch
    tokens, R[:, 0, prefix:]; without any (Swin, Mixer, GAP models) it is the mean over all query rows.

    Args:
        rollout: (B, N, N) from :func:`attention_rollout`.
        num_prefix_tokens: tokens before the patch tokens.
        grid: (H, W) patch grid (3-D models: (D, H, W)), prod(grid) = N - num_prefix_tokens, row-major.

    Returns:
        (B, *grid) map.
    """
    if rollout.ndim != 3 or rollout.shape[-1] != rollout.shape[-2]:
        raise ValueError(f"rollout_map: rollout must be (B, N, N), got {tuple(rollout.shape)}")
    tokens = rollout.shape[-1]
    if num_prefix_tokens < 0 or len(grid) not in (2, 3) or math.prod(grid) != tokens - num_prefix_tokens:
        raise ValueError(
            f"rollout_map: grid {tuple(grid)} with {num_prefix_tokens} prefix tokens does not match N = {tokens} "
            "(need prod(grid) = N - num_prefix_tokens)"
        )
    rows = rollout[:, 0] if num_prefix_tokens > 0 else rollout.mean(1)  # (B, N)
    return rows[:, num_prefix_tokens:].reshape(-1, *grid)


def pool_tokens(attn_dense: Tensor, grid: tuple[int, ...], factor: int = 2) -> Tensor:
    """Pool a token x token attention matrix onto a coarser grid (Swin patch merging between stages).

    Each coarse token merges a factor^d block of fine tokens (d = 2 or 3 grid axes) with equal weights (1/4
    for factor 2 in 2-D, 1/8 in 3-D): a coarse query row is the mean of its fine query rows, and a coarse key
    column the sum of its fine key columns, so rows that summed to 1 still do. Pool earlier-stage attention
    to the last stage's grid, then roll out all layers at that resolution.

    Args:
        attn_dense: (..., N, N) attention over tokens of a row-major grid, N = prod(grid).
        grid: (H, W) or (D, H, W), every side divisible by ``factor``.
        factor: merge factor per side (2 per Swin stage; 2**k to jump k stages).

    Returns:
        (..., N / factor^d, N / factor^d) pooled attention.
    """
    tokens = attn_dense.shape[-1]
    if attn_dense.ndim < 2 or attn_dense.shape[-2] != tokens or len(grid) not in (2, 3) or math.prod(grid) != tokens:
        raise ValueError(
            f"pool_tokens: attention {tuple(attn_dense.shape)} must be (..., N, N) with N = prod of the 2-D or 3-D grid {tuple(grid)}"
        )
    if factor < 1 or any(side % factor for side in grid):
        raise ValueError(f"pool_tokens: factor {factor} must be >= 1 and divide every grid side {tuple(grid)}")
    lead = attn_dense.shape[:-2]
    coarse = [side // factor for side in grid]
    split = [n for side in coarse for n in (side, factor)]  # (r, f, c, f) in 2-D, (d, f, r, f, c, f) in 3-D
    blocks = attn_dense.reshape(*lead, *split, *split)  # query axes x key axes
    axes = len(split)
    query_f = tuple(-2 * axes + 1 + 2 * a for a in range(len(grid)))  # the query's within-block axes
    key_f = tuple(-axes + 1 + 2 * a for a in range(len(grid)))
    pooled = blocks.mean(dim=query_f).sum(dim=key_f)  # key axes are the last ones: negative indices still hold
    return pooled.reshape(*lead, math.prod(coarse), math.prod(coarse))


def pool_window_attention(window_probs: Tensor, slots: Tensor, grid: tuple[int, ...], factor: int) -> Tensor:
    """:func:`pool_tokens` of Swin's dense attention, straight from its windows (no N x N matrix: a 96^3 SwinUNETR's
    first stage has 48^3 tokens, too many for a dense form).

    Args:
        window_probs: (B*G, H, T, T) attention of the G windows of each of B samples (sample-major).
        slots: (G, T) token index (row-major in ``grid``) of every window slot; pad slots hold prod(grid).
        grid: (H, W) or (D, H, W), every side divisible by ``factor``.
        factor: merge factor per side.

    Returns:
        (B, H, M, M) with M = prod(grid) / factor^d: pool_tokens(dense, grid, factor).
    """
    if len(grid) not in (2, 3) or factor < 1 or any(side % factor for side in grid):
        raise ValueError(f"pool_window_attention: factor {factor} must be >= 1 and divide every side of the 2-D or 3-D grid {tuple(grid)}")
    groups, area = slots.shape
    if window_probs.ndim != 4 or window_probs.shape[0] % groups or window_probs.shape[-2:] != (area, area):
        raise ValueError(f"pool_window_attention: windows {tuple(window_probs.shape)} do not match slots {tuple(slots.shape)}")
    batch, heads = window_probs.shape[0] // groups, window_probs.shape[1]
    coarse = [side // factor for side in grid]
    index = torch.stack(torch.meshgrid(*[torch.arange(n) for n in grid], indexing="ij"), -1).reshape(-1, len(grid)) // factor
    cell = torch.zeros(len(index), dtype=torch.long)
    for axis, side in enumerate(coarse):
        cell = cell * side + index[:, axis]  # coarse token of every fine token, row-major
    tokens = math.prod(coarse)
    cell = torch.cat([cell, torch.tensor([tokens])])[slots.cpu()]  # (G, T); pad slots -> dropped row / column
    pair = (cell[:, :, None] * (tokens + 1) + cell[:, None, :]).reshape(-1)  # (G*T*T,)
    values = window_probs.reshape(batch, groups, heads, area, area).transpose(1, 2).reshape(batch, heads, -1)  # (B, H, G*T*T)
    pooled = values.new_zeros(batch, heads, (tokens + 1) ** 2).index_add_(2, pair.to(values.device), values)
    return pooled.reshape(batch, heads, tokens + 1, tokens + 1)[..., :tokens, :tokens] / factor ** len(grid)


def window_query_rows(window_probs: Tensor, slots: Tensor, num_tokens: int, token: int) -> Tensor:
    """One query token's attention row over all tokens, from Swin windows (zero outside its window).

    Args:
        window_probs: (B*G, H, T, T) as :func:`pool_window_attention`; slots: (G, T), pad slots hold ``num_tokens``.
        num_tokens: N, tokens of the grid.
        token: the query's token index (row-major).

    Returns:
        (B, H, N): the query's row of the dense form.
    """
    groups, area = slots.shape
    where = (slots == token).nonzero()
    if len(where) != 1:
        raise ValueError(f"window_query_rows: token {token} is in {len(where)} window slots, expected 1")
    g, t = (int(v) for v in where[0])
    rows = window_probs.reshape(-1, groups, *window_probs.shape[1:])[:, g, :, t]  # (B, H, T)
    dense = rows.new_zeros(*rows.shape[:2], num_tokens + 1)
    dense[:, :, slots[g].to(rows.device)] = rows
    return dense[:, :, :num_tokens]
