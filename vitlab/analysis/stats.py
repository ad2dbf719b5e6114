"""Activation statistics: kurtosis, linear CKA, attention against patch-embedding angle (Philip et al.; the
definitions: docs/analyses.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["excess_kurtosis", "linear_cka", "AngleStats", "attention_vs_angle"]


def excess_kurtosis(x: Tensor, dim: int = 0) -> Tensor:
    """Excess kurtosis m4 / m2^2 - 3 with biased central moments (= ``scipy.stats.kurtosis`` default).

    0 for a Gaussian, > 0 for heavy tails / sparse activations. A constant slice gives NaN (as scipy).

    Args:
        x: samples along ``dim``; any real dtype.
        dim: sample dimension.

    Returns:
        float64 tensor of ``x``'s shape without ``dim``.
    """
    if x.ndim == 0 or x.shape[dim] < 2:
        raise ValueError(f"excess_kurtosis: need at least 2 samples along dim {dim}, got shape {tuple(x.shape)}")
    centred = x.to(torch.float64) - x.to(torch.float64).mean(dim, keepdim=True)
    sq = centred.square()
    m2 = sq.mean(dim)
    m4 = sq.square().mean(dim)
    return m4 / m2.square() - 3.0


def linear_cka(x: Tensor, y: Tensor) -> Tensor:
    """Linear centred kernel alignment (Kornblith et al. 2019) between two representations of N inputs.

    CKA = |Y^T X|_F^2 / (|X^T X|_F |Y^T Y|_F) after centring every feature; 1 for identical representations,
    invariant to orthogonal maps and isotropic scaling. Computed in feature space or, when that is
    cheaper (features > samples), through the N x N Gram matrices (same value: |Y^T X|_F^2 = tr(K_X K_Y)).

    Args:
        x: (N, D1) features (flatten tokens into the feature or sample axis before calling).
        y: (N, D2) features of the same N inputs.

    Returns:
        float64 scalar (NaN when a representation is constant).
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"linear_cka: need x (N, D1) and y (N, D2) with equal N, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    x = x.to(torch.float64)
    y = y.to(torch.float64, copy=False).to(x.device)
    x = x - x.mean(0, keepdim=True)  # (N, D1)
    y = y - y.mean(0, keepdim=True)  # (N, D2)
    n, d1, d2 = x.shape[0], x.shape[1], y.shape[1]
    if d1 * d2 + d1 * d1 + d2 * d2 <= n * n:  # feature space
        cross = (y.T @ x).square().sum()
        norm_x, norm_y = torch.linalg.matrix_norm(x.T @ x), torch.linalg.matrix_norm(y.T @ y)
    else:  # sample space
        k_x, k_y = x @ x.T, y @ y.T  # (N, N)
        cross = (k_x * k_y).sum()
        norm_x, norm_y = torch.linalg.matrix_norm(k_x), torch.linalg.matrix_norm(k_y)
    return cross / (norm_x * norm_y)


@dataclass(frozen=True)
class AngleStats:
    """Attention against the angle between the patch embeddings of query and key.

    Attributes:
        bin_edges: (n_bins + 1,) float64 angle bin edges in degrees, 0 .. 180.
        bin_counts: (n_bins,) int64 number of off-diagonal (i != j) token pairs in each bin, over the batch.
        mean_attention: (H, n_bins) float64 mean attention weight of the pairs in each bin (NaN if empty).
        self_attention: (H,) mean attention of a token to itself (i == j, kept out of the bins).
        mass_below_90: (H,) fraction of the off-diagonal attention mass on pairs with angle < 90 degrees.
        mass_above_90: (H,) the same for angle > 90 (pairs at exactly 90 count in neither).
    """

    bin_edges: Tensor
    bin_counts: Tensor
    mean_attention: Tensor
    self_attention: Tensor
    mass_below_90: Tensor
    mass_above_90: Tensor


def attention_vs_angle(attn: Tensor, h: Tensor, bin_degrees: float = 5.0) -> AngleStats:
    """Bin attention weights by the angle theta_ij = arccos cos(h_i, h_j) between token embeddings (Philip et al.).

    Args:
        attn: (B, H, N, N) post-softmax attention over patch tokens only (caller drops prefix tokens).
        h: (B, N, C) the attention input (the norm1 output) of the same tokens. A zero vector has angle 90
            with everything.
        bin_degrees: bin width in degrees (the last bin is shorter when it does not divide 180).

    Returns:
        :class:`AngleStats`.
    """
    if attn.ndim != 4 or h.ndim != 3 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(
            f"attention_vs_angle: need attn (B, H, N, N) and h (B, N, C), got {tuple(attn.shape)} and {tuple(h.shape)}"
        )
    batch, heads, tokens, _ = attn.shape
    if h.shape[:2] != (batch, tokens):
        raise ValueError(
            f"attention_vs_angle: h {tuple(h.shape)} must be (B, N, C) = ({batch}, {tokens}, C) like attn "
            f"{tuple(attn.shape)}; drop prefix tokens from both"
        )
    if not 0 < bin_degrees <= 180:
        raise ValueError(f"attention_vs_angle: bin_degrees must be in (0, 180], got {bin_degrees}")
    n_bins = math.ceil(180.0 / bin_degrees - 1e-9)
    edges = torch.arange(n_bins + 1, dtype=torch.float64, device=attn.device).mul_(bin_degrees).clamp_(max=180.0)

    unit = torch.nn.functional.normalize(h.detach().to(torch.float64), dim=-1)  # (B, N, C), zero rows stay 0
    theta = torch.rad2deg(torch.arccos((unit @ unit.mT).clamp(-1.0, 1.0)))  # (B, N, N) degrees
    bin_idx = (theta / bin_degrees).floor().clamp(0, n_bins - 1).long()  # (B, N, N)
    off_diag = ~torch.eye(tokens, dtype=torch.bool, device=attn.device).expand(batch, tokens, tokens)  # (B, N, N)

    a = attn.detach().to(torch.float64).transpose(0, 1)  # (H, B, N, N)
    a_off = a[:, off_diag]  # (H, P) P = off-diagonal pairs over the batch
    bins_off = bin_idx[off_diag]  # (P,)
    theta_off = theta[off_diag]  # (P,)
    sums = torch.zeros(heads, n_bins, dtype=torch.float64, device=attn.device)
    sums.index_add_(1, bins_off, a_off)  # (H, n_bins)
    counts = torch.bincount(bins_off, minlength=n_bins)  # (n_bins,)
    total = a_off.sum(1)  # (H,)
    return AngleStats(
        bin_edges=edges,
        bin_counts=counts,
        mean_attention=sums / counts.to(torch.float64),  # empty bin: 0/0 -> NaN
        self_attention=a.diagonal(dim1=-2, dim2=-1).mean((1, 2)),
        mass_below_90=(a_off * (theta_off < 90.0)).sum(1) / total,
        mass_above_90=(a_off * (theta_off > 90.0)).sum(1) / total,
    )
