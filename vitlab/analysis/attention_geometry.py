"""Attention in the geometry of the image: attention vs query-key distance in mm, and the three orthogonal
planes of a 3-D token map through a query token (distances in 3-D probes are millimetres: docs/volumes.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_CHUNK = 1 << 21  # token pairs per step of attention_vs_distance

__all__ = ["DistanceStats", "token_centres", "window_pairs", "attention_vs_distance", "merge_distance_stats", "orthogonal_planes", "query_token"]


def token_centres(grid: Sequence[int], token_size: Sequence[float]) -> Tensor:
    """Centres of the tokens of a row-major grid: (index + 0.5) x token size, per axis.

    Args:
        grid: token grid, e.g. (gi, gj, gk) or (gh, gw).
        token_size: extent of one token along each axis (mm, or 1.0 for grid steps).

    Returns:
        (prod(grid), len(grid)) float64 coordinates, tokens in row-major order.
    """
    if len(grid) != len(token_size):
        raise ValueError(f"token_centres: grid {tuple(grid)} and token size {tuple(token_size)} differ in length")
    axes = [(torch.arange(n, dtype=torch.float64) + 0.5) * float(s) for n, s in zip(grid, token_size)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(grid))


@dataclass
class DistanceStats:
    """Attention against the distance between query and key token centres, as mergeable sums.

    Attributes:
        bin_edges: (n_bins + 1,) float64 distance bin edges (mm); bins are [low, high), the last one closed.
        pair_counts: (n_bins,) float64 number of (sample, query, key) pairs in each bin.
        attention_sums: (H, n_bins) float64 attention weight summed over the pairs in each bin.
        weighted_distance: (H,) float64 sum over pairs of attention x distance.
        mass: (H,) float64 sum over pairs of attention (the denominator of the mean attention distance).
    """

    bin_edges: Tensor
    pair_counts: Tensor
    attention_sums: Tensor
    weighted_distance: Tensor
    mass: Tensor

    @property
    def mean_attention(self) -> Tensor:
        """(H, n_bins) mean attention weight per distance bin (NaN where a bin has no pairs)."""
        return self.attention_sums / self.pair_counts

    @property
    def mean_distance(self) -> Tensor:
        """(H,) attention-weighted mean distance (Dosovitskiy et al.'s "attention distance")."""
        return self.weighted_distance / self.mass


def window_pairs(slots: Tensor, grid: Sequence[int], window: Sequence[int]) -> Tensor:
    """The slot pairs of (shifted) windows that attend to each other: both real tokens, and less than one window
    apart along every axis of the token grid. A shifted window's slots that wrapped around the grid edge (the
    cyclic roll) are a grid side apart and masked out of each other's softmax, as Swin's attention mask does.

    Args:
        slots: (G, T) token index (row-major in ``grid``) of every window slot; pad slots hold prod(grid).
        grid: token grid, 2-D or 3-D.
        window: window size per axis (one window when it covers the grid).

    Returns:
        (G, T, T) bool.
    """
    tokens = math.prod(grid)
    index = torch.stack(torch.meshgrid(*[torch.arange(n) for n in grid], indexing="ij"), -1).reshape(tokens, len(grid))
    index = torch.cat([index, index.new_zeros(1, len(grid))])[slots]  # (G, T, D); pad slots -> row `tokens`
    near = ((index[:, :, None] - index[:, None]).abs() < torch.tensor([int(w) for w in window])).all(-1)  # (G, T, T)
    real = slots < tokens
    return near & real[:, :, None] & real[:, None, :]


def attention_vs_distance(probs: Tensor, coords: Tensor, bin_edges: Tensor, valid: Tensor | None = None,
                          pairs: Tensor | None = None, reach: Sequence[float] | None = None) -> DistanceStats:
    """Sums of attention per query-key distance bin, and the attention-weighted distance, per head.

    Args:
        probs: (B*G, H, T, T) post-softmax attention of G groups of T tokens (one group: a ViT's patch tokens;
            Swin: its windows, B samples of G windows each, sample-major), rows = queries.
        coords: (G, T, D) or (T, D) token centres of every group's slots (mm).
        bin_edges: (n_bins + 1,) increasing distance bin edges; pairs beyond the last edge count in no bin
            but still in the mean distance.
        valid: (G, T) bool, False for pad slots (their pairs count nowhere); None: all valid.
        pairs: (G, T, T) bool, the pairs that count (e.g. :func:`window_pairs`: not masked apart); None: all
            pairs of valid slots.
        reach: (D,) pairs count only when closer than this along every axis: Swin's (window - 1/2) x token
            size keeps the pairs of :func:`window_pairs` without a (G, T, T) mask in memory.

    Returns:
        :class:`DistanceStats` of the batch (sums: merge batches with :func:`merge_distance_stats`).
    """
    if probs.ndim != 4 or probs.shape[-1] != probs.shape[-2]:
        raise ValueError(f"attention_vs_distance: probs must be (B*G, H, T, T), got {tuple(probs.shape)}")
    coords = coords.to(torch.float64)
    if coords.ndim == 2:
        coords = coords[None]
    groups, tokens = coords.shape[:2]
    if tokens != probs.shape[-1] or probs.shape[0] % groups:
        raise ValueError(f"attention_vs_distance: coords {tuple(coords.shape)} do not match probs {tuple(probs.shape)}")
    edges = bin_edges.to(torch.float64)
    if edges.ndim != 1 or edges.numel() < 2 or bool((edges[1:] <= edges[:-1]).any()):
        raise ValueError("attention_vs_distance: bin_edges must be 1-D, increasing, with at least 2 edges")
    valid = torch.ones(groups, tokens, dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
    heads, n_bins = probs.shape[1], edges.numel() - 1
    windows = probs.detach().reshape(-1, groups, heads, tokens, tokens)  # (B, G, H, T, T)
    samples = windows.shape[0]
    sums = torch.zeros(heads, n_bins + 1, dtype=torch.float64)
    counts = torch.zeros(n_bins + 1, dtype=torch.float64)
    weighted = torch.zeros(heads, dtype=torch.float64)
    mass = torch.zeros(heads, dtype=torch.float64)
    step = max(1, _CHUNK // (tokens * tokens))  # groups at a time: memory bounded also for 7^3-token windows
    for g in range(0, groups, step):
        part = slice(g, g + step)
        distance = (coords[part, :, None] - coords[part, None]).norm(dim=-1)  # (g, T, T); not cdist: its matmul form misplaces pairs on bin edges
        pair_ok = valid[part, :, None] & valid[part, None, :]  # (g, T, T)
        if pairs is not None:
            pair_ok = pair_ok & pairs[part].to(torch.bool).cpu()
        if reach is not None:
            offset = (coords[part, :, None] - coords[part, None]).abs()  # (g, T, T, D)
            pair_ok = pair_ok & (offset < torch.tensor(reach, dtype=torch.float64)).all(-1)
        index = torch.bucketize(distance, edges, right=True) - 1  # (g, T, T): bin of each pair
        index = torch.where(distance == edges[-1], n_bins - 1, index)  # last bin closed
        index = torch.where(pair_ok & (index >= 0) & (index < n_bins), index, n_bins)  # overflow slot n_bins, dropped below
        per_group = torch.zeros(pair_ok.shape[0], heads, tokens, tokens, dtype=torch.float64)  # summed over samples
        for sample in windows[:, part].cpu():
            per_group += sample.to(torch.float64)
        per_group *= pair_ok[:, None]
        sums.index_add_(1, index.reshape(-1), per_group.transpose(0, 1).reshape(heads, -1))
        counts += torch.bincount(index.reshape(-1), minlength=n_bins + 1).to(torch.float64) * samples
        weighted += (per_group * distance[:, None]).sum(dim=(0, 2, 3))
        mass += per_group.sum(dim=(0, 2, 3))
    return DistanceStats(edges, counts[:n_bins], sums[:, :n_bins], weighted, mass)


def merge_distance_stats(parts: Sequence[DistanceStats]) -> DistanceStats:
    """The statistics of disjoint batches together (exact: every field is a sum)."""
    if not parts:
        raise ValueError("merge_distance_stats: nothing to merge")
    first = parts[0]
    if any(not torch.equal(p.bin_edges, first.bin_edges) for p in parts):
        raise ValueError("merge_distance_stats: the parts have different bin edges")
    return DistanceStats(first.bin_edges, sum(p.pair_counts for p in parts), sum(p.attention_sums for p in parts),
                         sum(p.weighted_distance for p in parts), sum(p.mass for p in parts))


def query_token(voxel: Sequence[int], size: Sequence[int], grid: Sequence[int]) -> tuple[int, ...]:
    """The token (grid index per axis) that holds input voxel ``voxel`` of an input of ``size`` voxels."""
    if len(voxel) != len(size) or len(size) != len(grid):
        raise ValueError(f"query_token: voxel {tuple(voxel)}, size {tuple(size)} and grid {tuple(grid)} differ in length")
    if any(not 0 <= v < n for v, n in zip(voxel, size)):
        raise ValueError(f"query_token: voxel {tuple(voxel)} outside the input of {tuple(size)} voxels")
    return tuple(int(v) * int(g) // int(n) for v, n, g in zip(voxel, size, grid))


def orthogonal_planes(token_map: Tensor, grid: Sequence[int], token: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The three orthogonal planes of a 3-D token map through one token.

    Args:
        token_map: (..., N) values over the tokens of a row-major (gi, gj, gk) grid, N = gi*gj*gk (e.g. one
            query's attention row over the patch tokens).
        grid: (gi, gj, gk).
        token: (ti, tj, tk) grid index the planes pass through.

    Returns:
        axial (..., gi, gj) at k = tk, coronal (..., gi, gk) at j = tj, sagittal (..., gj, gk) at i = ti.
    """
    if len(grid) != 3 or len(token) != 3 or token_map.shape[-1] != math.prod(grid):
        raise ValueError(f"orthogonal_planes: map {tuple(token_map.shape)} does not match the 3-D grid {tuple(grid)}")
    if any(not 0 <= t < g for t, g in zip(token, grid)):
        raise ValueError(f"orthogonal_planes: token {tuple(token)} outside the grid {tuple(grid)}")
    volume = token_map.reshape(*token_map.shape[:-1], *grid)  # (..., gi, gj, gk)
    ti, tj, tk = token
    return volume[..., :, :, tk], volume[..., :, tj, :], volume[..., ti, :, :]
