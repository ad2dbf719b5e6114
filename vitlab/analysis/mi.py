"""Mutual information between neurons and its decay with spatial distance (Philip et al., Fig. 4; docs/analyses.md).

A neuron is one (token, channel) entry of a sublayer output, observed over N images. Estimators (nats):

- Gaussian copula (Ince et al. 2017): rank each variable, map to standard normal scores, take the Gaussian MI
  of the Pearson correlation, minus the analytic small-sample bias. Exact for Gaussians up to O(1/N),
  exactly invariant under monotone maps, blind to non-monotone dependence; one matrix product serves
  thousands of pairs, which is why :func:`mi_vs_distance` uses it by default.
- Plug-in on equal-frequency bins with the Miller-Madow correction: catches non-monotone dependence.
- KSG (sklearn ``mutual_info_regression``): accurate but ~10 ms per pair; for validation only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vitlab.analysis.ranks import average_ranks, column_scores, copula_normalize, equal_frequency_bins

__all__ = [
    "copula_normalize",
    "gaussian_copula_mi",
    "binned_mi",
    "ksg_mi",
    "mi_vs_distance",
    "MIDistanceCurves",
    "distance_classes",
    "centre_token",
    "token_offsets",
    "token_size_mm",
    "average_ranks",
    "equal_frequency_bins",
    "binned_mi_from_bins",
    "mi_from_correlation",
    "gaussian_mi_bias",
]

_PAIR_CHUNK_ELEMENTS = 1 << 22  # binned MI: pairs x samples handled at once
_SAME_DISTANCE_RTOL = 1e-9  # token-size distances closer than this (relative) are one distance class


def _check_xy(x: Tensor, y: Tensor, fn: str, min_n: int = 3) -> tuple[Tensor, Tensor, bool]:
    """Validate x (N,), y (N,) or (N, D); return y as (N, D) and whether it was 1-D."""
    if x.ndim != 1:
        raise ValueError(f"{fn}: x must be 1-D (N,), got shape {tuple(x.shape)}")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: y must be (N,) or (N, D) with N = {x.shape[0]} like x, got shape {tuple(y.shape)}")
    if x.shape[0] < min_n:
        raise ValueError(f"{fn}: need at least {min_n} samples, got N = {x.shape[0]}")
    return x, (y.unsqueeze(1) if y.ndim == 1 else y), y.ndim == 1


def gaussian_mi_bias(n: int) -> float:
    """Analytic bias term 1/2[psi((N-2)/2) - psi((N-1)/2)] (< 0) added to the Gaussian MI of two variables."""
    psi = torch.special.digamma(torch.tensor([(n - 2) / 2, (n - 1) / 2], dtype=torch.float64))
    return 0.5 * (psi[0] - psi[1]).item()


def mi_from_correlation(r: Tensor, n: int) -> Tensor:
    """Bias-corrected Gaussian MI -1/2 ln(1 - r^2) + bias(N) (nats) of Pearson correlations ``r``."""
    r = r.clamp(-1.0, 1.0)
    return -0.5 * torch.log1p(-r * r) + gaussian_mi_bias(n)


def _standardize(z: Tensor, dim: int = 0) -> Tensor:
    """Centre and scale to unit norm along ``dim`` so that dot products are Pearson correlations."""
    z = z - z.mean(dim, keepdim=True)
    return z / torch.linalg.vector_norm(z, dim=dim, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)


def gaussian_copula_mi(x: Tensor, y: Tensor) -> Tensor:
    """Gaussian-copula MI (Ince et al. 2017) between x and each column of y, in nats.

    I = -1/2 ln(1 - r^2) + 1/2[psi((N-2)/2) - psi((N-1)/2)] with r the Pearson correlation of the copula
    normal scores. The bias term is negative, so independent data give values scattered around 0,
    including small negative ones: they are reported raw (clamping would bias averages upwards).
    A constant column has r = 0 (its MI is the bias term).

    Args:
        x: (N,) samples.
        y: (N,) or (N, D) samples.

    Returns:
        float64 scalar for 1-D y, else (D,).
    """
    x, y2, scalar = _check_xy(x, y, "gaussian_copula_mi")
    zx = _standardize(copula_normalize(x.to(torch.float64)))  # (N,)
    zy = _standardize(copula_normalize(y2.to(torch.float64, copy=False)))  # (N, D)
    mi = mi_from_correlation(zx @ zy, x.shape[0])  # (D,)
    return mi[0] if scalar else mi


def binned_mi_from_bins(bx: Tensor, by: Tensor, bins: int) -> Tensor:
    """Plug-in MI with the Miller-Madow correction from bin indices of P pairs of variables.

    Args:
        bx: (P, N) int64 bin indices in [0, bins) of the first variable of each pair.
        by: (P, N) bin indices of the second variable.
        bins: number of bins per variable.

    Returns:
        (P,) float64 MI in nats: I_plugin - (B_xy - B_x - B_y + 1) / (2N), B_* = occupied cells.
    """
    pairs, n = bx.shape
    cells = bins * bins
    flat = bx * bins + by + torch.arange(pairs, device=bx.device).unsqueeze(1) * cells  # (P, N)
    joint = torch.zeros(pairs * cells, dtype=torch.float64, device=bx.device)
    joint.scatter_add_(0, flat.reshape(-1), torch.ones(1, dtype=torch.float64, device=bx.device).expand(flat.numel()))
    joint = joint.reshape(pairs, bins, bins)  # (P, Bx, By) counts
    px, py = joint.sum(2), joint.sum(1)  # (P, B) marginal counts

    def sum_xlogx(counts: Tensor) -> Tensor:
        return torch.special.xlogy(counts, counts).flatten(1).sum(1)  # (P,)

    plugin = (sum_xlogx(joint) - sum_xlogx(px) - sum_xlogx(py)) / n + math.log(n)
    occupied = (joint > 0).flatten(1).sum(1) - (px > 0).sum(1) - (py > 0).sum(1) + 1  # (P,)
    return plugin - occupied.to(torch.float64) / (2 * n)


def binned_mi(x: Tensor, y: Tensor, bins: int = 16) -> Tensor:
    """Plug-in MI on equal-frequency bins with the Miller-Madow correction, in nats.

    Unlike the copula estimator this sees non-monotone dependence (y = x^2 + noise). It is biased low for
    strong dependence (coarse bins) and its correction can leave small negative values: reported raw.

    Args:
        x: (N,) samples.
        y: (N,) or (N, D) samples.
        bins: bins per variable (about 16 at N = 2000).

    Returns:
        float64 scalar for 1-D y, else (D,).
    """
    x, y2, scalar = _check_xy(x, y, "binned_mi", min_n=2)
    if bins < 2 or bins > x.shape[0]:
        raise ValueError(f"binned_mi: bins must be in [2, N={x.shape[0]}], got {bins}")
    bx = equal_frequency_bins(x, bins)  # (N,)
    by = equal_frequency_bins(y2, bins).T  # (D, N)
    mi = binned_mi_from_bins(bx.expand_as(by), by, bins)  # (D,)
    return mi[0] if scalar else mi


def ksg_mi(x: Tensor, y: Tensor, k: int = 3, random_state: int = 0) -> Tensor:
    """Kraskov-Stoegbauer-Grassberger MI via sklearn ``mutual_info_regression`` (validation only: slow).

    Args:
        x: (N,) samples (the regression target).
        y: (N,) or (N, D) samples (one feature per column).
        k: neighbours (sklearn's ``n_neighbors``).
        random_state: seed of the tiny noise sklearn adds to break ties.

    Returns:
        float64 scalar for 1-D y, else (D,), in nats (sklearn clips at 0).
    """
    from sklearn.feature_selection import mutual_info_regression

    x, y2, scalar = _check_xy(x, y, "ksg_mi", min_n=k + 2)
    mi = mutual_info_regression(
        y2.detach().to(torch.float64).cpu().numpy(),
        x.detach().to(torch.float64).cpu().numpy(),
        n_neighbors=k,
        random_state=random_state,
    )
    out = torch.as_tensor(mi, dtype=torch.float64)
    return out[0] if scalar else out


@dataclass(frozen=True)
class MIDistanceCurves:
    """MI between a centre neuron and the others, against the spatial distance from the centre token.

    Attributes:
        distances: (D,) float64 sorted distinct distances from the centre token: sqrt(sum of squared offsets) in
            tokens, or in the unit of ``token_size`` (millimetres for volumes) when one was given.
        mi_same: (D,) mean MI with the same channel at that distance, averaged over the centre channels
            (NaN at distance 0: that pair is the neuron itself).
        mi_cross: (D,) the same for the other channels (NaN when no other channel was sampled).
        counts: (D,) int64 number of tokens at each distance.
        mi_same_per_channel: (K, D) the same-channel curve of every centre channel.
        centre_channels: (K,) int64 channels used as centres.
        cross_channels: (C',) int64 channels the cross curve draws from (a centre is never paired with itself).
        token_size: size of a token along each grid axis (e.g. mm), or None: distances in tokens.
    """

    distances: Tensor
    mi_same: Tensor
    mi_cross: Tensor
    counts: Tensor
    mi_same_per_channel: Tensor
    centre_channels: Tensor
    cross_channels: Tensor
    token_size: tuple[float, ...] | None = None


def token_size_mm(input_size: tuple[int, ...], spacing: tuple[float, ...], grid: tuple[int, ...]) -> tuple[float, ...]:
    """Size of one token in mm along each axis: input voxels x voxel size (mm) / tokens along that axis.

    Args:
        input_size: voxels of the model input along i, j, k.
        spacing: voxel size in mm along i, j, k.
        grid: tokens along i, j, k (the block's token grid).
    """
    if not len(input_size) == len(spacing) == len(grid):
        raise ValueError(f"token_size_mm: input size {tuple(input_size)}, spacing {tuple(spacing)} and grid {tuple(grid)} need one entry per axis")
    return tuple(float(size) * float(mm) / int(g) for size, mm, g in zip(input_size, spacing, grid))


def centre_token(grid: tuple[int, ...]) -> int:
    """Row-major index of the centre token (g // 2 along every axis): (H//2)*W + W//2 in 2-D."""
    index = 0
    for g in grid:
        index = index * g + g // 2
    return index


def token_offsets(grid: tuple[int, ...], device: torch.device | str | None = None) -> Tensor:
    """(T, A) int64 offsets of every token (row-major over ``grid``) from the centre token, per axis."""
    axes = [torch.arange(g, device=device) - g // 2 for g in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(grid))


def distance_classes(
    grid: tuple[int, ...], token_size: tuple[float, ...] | None = None, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens of an N-D grid grouped by their distance from the centre token.

    Without ``token_size`` the classes are those of the integer squared distance sum(offset^2) (exact), as in
    2-D. With one, the distance is sqrt(sum_a (size_a * offset_a)^2): tokens are grouped exactly on the integer
    squared offsets summed over the axes of equal size (the classes of an isotropic grid are those of the integer
    distance), then classes whose distances agree to 1e-9 (relative) are merged (commensurable sizes such as
    1 mm x 2 offsets and 2 mm x 1 offset give one distance).

    Returns:
        distances (D,) float64 sorted, index (T,) int64 class of every token, counts (D,) int64.
    """
    offsets = token_offsets(grid, device)  # (T, A)
    if token_size is None:
        squared, scale = (offsets**2).sum(1, keepdim=True), torch.ones(1, dtype=torch.float64, device=offsets.device)
    else:
        if len(token_size) != len(grid) or min(token_size) <= 0:
            raise ValueError(f"token size {tuple(token_size)} must be one positive size per axis of the grid {tuple(grid)}")
        sizes = sorted(set(float(s) for s in token_size))
        group = torch.tensor([sizes.index(float(s)) for s in token_size], device=offsets.device)  # (A,) axis -> size group
        squared = torch.zeros(offsets.shape[0], len(sizes), dtype=torch.int64, device=offsets.device)
        squared.index_add_(1, group, offsets**2)  # (T, G) integer squared offsets per size group
        scale = torch.tensor(sizes, dtype=torch.float64, device=offsets.device) ** 2  # (G,)
    keys, index = torch.unique(squared, dim=0, return_inverse=True)  # exact classes
    dist_sq = (keys.to(torch.float64) * scale).sum(1)  # (D0,)
    order = torch.argsort(dist_sq)
    sorted_sq = dist_sq[order]
    new = torch.ones_like(sorted_sq, dtype=torch.bool)
    new[1:] = (sorted_sq[1:] - sorted_sq[:-1]) > _SAME_DISTANCE_RTOL * sorted_sq[1:]  # merge equal distances
    merged = torch.cumsum(new.long(), 0) - 1  # (D0,) sorted key -> merged class
    key_class = torch.empty_like(merged)
    key_class[order] = merged
    index = key_class[index]
    first = sorted_sq[new]  # the smallest squared distance of each merged class
    counts = torch.bincount(index, minlength=first.numel())
    return first.sqrt(), index, counts


def _pick(total: int, count: int, generator: torch.Generator | None) -> Tensor:
    """``count`` distinct sorted indices of ``range(total)`` drawn at random (all when count >= total)."""
    if count >= total:
        return torch.arange(total)
    return torch.randperm(total, generator=generator)[:count].sort().values


def _binned_pairs(bx: Tensor, by: Tensor, bins: int) -> Tensor:
    """Miller-Madow MI of P pairs given (P, N) small-int bin indices, a block of pairs at a time."""
    pairs, n = by.shape
    step = max(1, _PAIR_CHUNK_ELEMENTS // n)
    out = torch.empty(pairs, dtype=torch.float64, device=by.device)
    for start in range(0, pairs, step):
        sl = slice(start, start + step)
        out[sl] = binned_mi_from_bins(bx[sl].long(), by[sl].long(), bins)
    return out


def _distance_means(values: Tensor, index: Tensor, counts: Tensor) -> Tensor:
    """Mean over tokens of (K, T) ``values`` for each distance class (``index`` (T,) -> 0..D-1)."""
    sums = torch.zeros(values.shape[0], counts.numel(), dtype=values.dtype, device=values.device)
    sums.index_add_(1, index, values)  # (K, D)
    return sums / counts  # 0/0 -> NaN for an empty class


def _copula_correlations(
    sub: Tensor, t0: int, centre_pos: Tensor, cross_pos: Tensor, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """Pearson correlations of normal scores: centre neurons with their own channel and with cross channels.

    Args:
        sub: (N, T, U) activations of the channels in use.
        t0: centre token.
        centre_pos: (K,) positions of the centre channels in U.
        cross_pos: (C',) positions of the cross channels in U.
        chunk: columns per ranking block.

    Returns:
        r_same (K, T) and r_cross (K, T*C'), float64.
    """
    n, tokens = sub.shape[:2]
    z = column_scores(sub, dim=0, chunk=chunk).reshape(tokens, -1, n)  # (T, U, N) normal scores, rows = neurons
    mean = z.mean(-1).double()  # (T, U); ~0 (exactly 0 without ties)
    norm_sq = torch.linalg.vector_norm(z, dim=-1).double().square()  # (T, U)
    spread = (norm_sq - n * mean.square()).clamp_min(0).sqrt()  # (T, U) |z - mean|
    z_centre = z[t0, centre_pos]  # (K, N)
    z_same = z if centre_pos.numel() == z.shape[1] else z.index_select(1, centre_pos)  # (T, K, N)
    dot_same = torch.bmm(z_same.transpose(0, 1), z_centre.unsqueeze(-1)).squeeze(-1)  # (K, T)
    dot_cross = z_centre @ z.index_select(1, cross_pos).reshape(-1, n).T  # (K, T*C'): one matrix product
    # r = (a.b - N mean_a mean_b) / (|a - mean_a| |b - mean_b|): no centred copy of z is needed.
    mean_c, spread_c = mean[t0, centre_pos].unsqueeze(1), spread[t0, centre_pos].unsqueeze(1)  # (K, 1)
    # a constant neuron (a token over a volume's padding; bf16 steps at N = 10) gets r = 0, not 0/0, as in gaussian_copula_mi
    tiny = torch.finfo(torch.float64).tiny
    r_same = (dot_same.double() - n * mean_c * mean[:, centre_pos].T) / (spread_c * spread[:, centre_pos].T).clamp_min(tiny)
    mean_x, spread_x = mean[:, cross_pos].reshape(1, -1), spread[:, cross_pos].reshape(1, -1)  # (1, T*C')
    r_cross = (dot_cross.double() - n * mean_c * mean_x) / (spread_c * spread_x).clamp_min(tiny)
    return r_same, r_cross


def mi_vs_distance(
    acts: Tensor,
    grid: tuple[int, ...],
    centre_channels: int = 64,
    estimator: Literal["copula", "binned"] = "copula",
    generator: torch.Generator | None = None,
    cross_channels: int = 16,
    bins: int = 16,
    chunk: int | None = None,
    token_size: tuple[float, ...] | None = None,
) -> MIDistanceCurves:
    """Mean MI between the centre token's neurons and all others, as a function of distance (Philip et al., Fig. 4).

    For each centre channel c0 (K of them, a random subset when C is larger), the centre neuron
    (c0, t0), t0 = (H//2)*W + W//2 (in N-D: g//2 along every axis, row-major), is paired with (c0, t) for every token t (same-channel curve) and with
    (c, t) for every c != c0 in a random subset of ``cross_channels`` channels (cross-channel curve; a subset
    keeps the cost at K x T x C' pairs, and the mean over channels converges fast). Values are averaged over
    the tokens at each distance, then over the centre channels.

    Vectorised: every column is rank-transformed once (in blocks), then the copula estimator needs one
    matrix product for all centre x neuron correlations; the binned one builds all joint histograms with
    ``scatter_add_`` (it is ~100x slower; prefer few cross channels with it).

    Args:
        acts: (N, T, C) activations of one sublayer over N images, prefix tokens already dropped; any float
            dtype (fp16 storage is fine: it is ranked in fp32).
        grid: token grid with prod(grid) == T, tokens in row-major order: (H, W) for images, (I, J, K) for
            volumes (any number of axes).
        centre_channels: K, the number of centre channels.
        estimator: "copula" (Gaussian copula) or "binned" (equal-frequency bins + Miller-Madow).
        generator: random source for the channel subsets (CPU generator).
        cross_channels: C', the number of channels sampled for the cross curve (0 disables it).
        bins: bins per variable for the binned estimator.
        chunk: columns per block when ranking (default: about 4M elements per block).
        token_size: size of a token along each grid axis (for volumes: mm, :func:`token_size_mm`; may differ per
            axis); distances are then sqrt(sum (size * offset)^2) in that unit (:func:`distance_classes`).
            None: in tokens.

    Returns:
        :class:`MIDistanceCurves` (float64 curves, on ``acts``'s device).
    """
    if acts.ndim != 3:
        raise ValueError(f"mi_vs_distance: acts must be (N, T, C), got shape {tuple(acts.shape)}")
    n, tokens, channels = acts.shape
    if len(grid) < 1 or math.prod(grid) != tokens:
        raise ValueError(f"mi_vs_distance: grid {tuple(grid)} must be (H, W) or (I, J, K) with product T = {tokens} tokens")
    if estimator not in ("copula", "binned"):
        raise ValueError(f"mi_vs_distance: estimator must be 'copula' or 'binned', got {estimator!r}")
    if centre_channels < 1 or cross_channels < 0 or n < 3:
        raise ValueError(
            f"mi_vs_distance: need centre_channels >= 1, cross_channels >= 0 and N >= 3 samples, got "
            f"{centre_channels}, {cross_channels}, N = {n}"
        )
    dev = acts.device
    t0 = centre_token(grid)
    distances, index, counts = distance_classes(grid, token_size, dev)  # fails early on a bad token size
    centres, cross = _pick(channels, centre_channels, generator), _pick(channels, cross_channels, generator)
    used, where = torch.unique(torch.cat([centres, cross]), return_inverse=True)  # union of channels
    centre_pos, cross_pos = where[: centres.numel()].to(dev), where[centres.numel() :].to(dev)
    centres, cross = centres.to(dev), cross.to(dev)
    sub = acts.detach() if used.numel() == channels else acts.detach()[:, :, used.to(dev)]  # (N, T, U)
    k, n_cross = centres.numel(), cross.numel()

    if estimator == "copula":
        r_same, r_cross = _copula_correlations(sub, t0, centre_pos, cross_pos, chunk)
        mi_same_kt = mi_from_correlation(r_same, n)  # (K, T)
        mi_cross_ktc = mi_from_correlation(r_cross, n).reshape(k, tokens, n_cross)  # (K, T, C')
    else:
        if bins < 2 or bins > n:
            raise ValueError(f"mi_vs_distance: bins must be in [2, N={n}], got {bins}")
        small = torch.int16 if bins <= torch.iinfo(torch.int16).max else torch.int64
        b = equal_frequency_bins(sub, bins, dim=0, chunk=chunk).permute(1, 2, 0).to(small)  # (T, U, N)
        b_centre = b[t0, centre_pos]  # (K, N)
        by_same = b[:, centre_pos].transpose(0, 1).reshape(k * tokens, n)  # (K*T, N)
        mi_same_kt = _binned_pairs(b_centre.repeat_interleave(tokens, 0), by_same, bins).reshape(k, tokens)
        by_cross = b[:, cross_pos].reshape(-1, n)  # (T*C', N)
        mi_cross_ktc = torch.stack(
            [_binned_pairs(b_centre[i].expand_as(by_cross), by_cross, bins) for i in range(k)]
        ).reshape(k, tokens, n_cross)  # (K, T, C')

    same_counts = counts.clone().to(torch.float64)
    same_counts[index[t0]] -= 1  # the centre is not paired with itself
    mi_same_kt = mi_same_kt.clone()
    mi_same_kt[:, t0] = 0.0
    same_per_channel = _distance_means(mi_same_kt, index, same_counts)  # (K, D)

    valid = cross.unsqueeze(0) != centres.unsqueeze(1)  # (K, C')
    # where, not a product: a centre's pair with itself at t0 can have r = 1 exactly, MI = inf, and inf * 0 is NaN
    cross_kt = torch.where(valid.unsqueeze(1), mi_cross_ktc, 0.0).sum(-1) / valid.sum(-1, keepdim=True)  # (K, T)
    cross_per_channel = _distance_means(cross_kt, index, counts.to(torch.float64))  # (K, D)
    return MIDistanceCurves(
        distances=distances,
        mi_same=same_per_channel.mean(0),
        mi_cross=cross_per_channel.nanmean(0),
        counts=counts,
        mi_same_per_channel=same_per_channel,
        centre_channels=centres,
        cross_channels=cross,
        token_size=None if token_size is None else tuple(float(v) for v in token_size),
    )
