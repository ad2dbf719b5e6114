"""MI vs distance on N-D token grids with a token size per axis (volumes: mm), against brute-force loops over tokens."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from vitlab.analysis.mi import binned_mi, centre_token, distance_classes, gaussian_copula_mi, mi_vs_distance, token_size_mm


def brute_distances(grid, token_size=None):
    """Distance of every token (row-major) from the centre token (g // 2 per axis), by a loop over the tokens."""
    size = token_size or [1.0] * len(grid)
    out = []
    for position in itertools.product(*[range(g) for g in grid]):
        out.append(math.sqrt(sum((s * (p - g // 2)) ** 2 for s, p, g in zip(size, position, grid))))
    return out


def brute_classes(dist):
    """Distinct distances (equal to 1e-9) and the tokens at each, by sorting a list."""
    levels: list[float] = []
    for d in sorted(dist):
        if not levels or d - levels[-1] > 1e-9 * max(d, 1.0):
            levels.append(d)
    members = [[t for t, d in enumerate(dist) if abs(d - level) <= 1e-9 * max(level, 1.0)] for level in levels]
    return levels, members


@pytest.mark.parametrize("seed", range(4))
def test_distance_classes_match_brute_force(seed):
    rng = random.Random(seed)
    grid = tuple(rng.randint(1, 6) for _ in range(3))
    cases = [None, tuple(rng.uniform(0.5, 20.0) for _ in range(3))]  # tokens; anisotropic mm
    s = rng.uniform(1.0, 5.0)
    cases.append((s, 2 * s, s))  # commensurable: 2 tokens along i or k = 1 token along j, one class
    cases.append((s, s, s))
    for size in cases:
        distances, index, counts = distance_classes(grid, size)
        levels, members = brute_classes(brute_distances(grid, size))
        np.testing.assert_allclose(distances.numpy(), levels, rtol=1e-12, atol=0)
        assert counts.tolist() == [len(m) for m in members] and counts.sum() == math.prod(grid)
        for c, tokens in enumerate(members):
            assert (index[tokens] == c).all(), (grid, size, c)
    # 2-D without a size: the integer classes of before (t0 = (H//2)*W + W//2)
    distances, index, _ = distance_classes((5, 4))
    assert centre_token((5, 4)) == 2 * 4 + 2 and distances[index[centre_token((5, 4))]] == 0
    # (torch's vectorised float64 sqrt may differ from the correctly rounded one in the last bit: seen on AVX-512)
    np.testing.assert_allclose(distances.numpy(), sorted({math.hypot(r - 2, c - 2) for r in range(5) for c in range(4)}),
                               rtol=1e-15, atol=0)


def test_token_size_mm():
    rng = random.Random(7)
    grid = tuple(rng.choice([2, 4, 8]) for _ in range(3))
    volume = tuple(g * rng.randint(1, 8) for g in grid)
    spacing = tuple(rng.uniform(0.3, 3.0) for _ in range(3))
    assert token_size_mm(volume, spacing, grid) == pytest.approx([v * s / g for v, s, g in zip(volume, spacing, grid)], rel=1e-12)
    with pytest.raises(ValueError, match="one entry per axis"):
        token_size_mm(volume, spacing[:2], grid)
    with pytest.raises(ValueError, match="positive size per axis"):
        mi_vs_distance(torch.randn(10, math.prod(grid), 2), grid, token_size=(1.0, 1.0))


def smooth_volume_acts(n, grid, channels, g):
    """Random fields on a 3-D token grid, smoothed along each axis (neighbours dependent), plus noise."""
    field = torch.randn(n, channels, *grid, generator=g, dtype=torch.float64)
    for axis in range(2, 5):
        field = field + 0.8 * field.roll(1, axis)
    field = field + 0.3 * torch.randn(field.shape, generator=g, dtype=torch.float64)
    return field.flatten(2).transpose(1, 2)  # (N, T, C), tokens row-major over the grid


@pytest.mark.parametrize("estimator", ["copula", "binned"])
@pytest.mark.parametrize("shape", ["anisotropic", "isotropic"])
def test_mi_vs_distance_on_a_volume_grid_equals_per_pair_loop(estimator, shape):
    seed = random.Random(estimator + shape).randint(0, 10_000)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    grid = (rng.randint(2, 4), rng.randint(2, 4), rng.randint(2, 3))
    size = tuple(rng.uniform(1.0, 12.0) for _ in range(3))  # mm per token
    size = size if shape == "anisotropic" else size[:1] * 3
    n, channels = 120, 5
    acts = smooth_volume_acts(n, grid, channels, g).float()
    curves = mi_vs_distance(acts, grid, centre_channels=3, cross_channels=3, estimator=estimator,
                            generator=torch.Generator().manual_seed(seed), bins=6, token_size=size)
    assert curves.token_size == pytest.approx(size)
    pair_mi = gaussian_copula_mi if estimator == "copula" else (lambda a, b: binned_mi(a, b, bins=6))
    dist = brute_distances(grid, size)
    levels, members = brute_classes(dist)
    t0 = dist.index(0.0)
    np.testing.assert_allclose(curves.distances.numpy(), levels, rtol=1e-12)
    same = np.zeros((3, len(levels)))
    cross = np.zeros((3, len(levels)))
    for i, c0 in enumerate(curves.centre_channels.tolist()):
        centre = acts[:, t0, c0]
        others = [c for c in curves.cross_channels.tolist() if c != c0]
        for j, tokens in enumerate(members):
            same_vals = [pair_mi(centre, acts[:, t, c0]).item() for t in tokens if t != t0]
            same[i, j] = np.mean(same_vals) if same_vals else np.nan
            cross[i, j] = np.mean([np.mean([pair_mi(centre, acts[:, t, c]).item() for c in others]) for t in tokens])
    np.testing.assert_allclose(curves.mi_same_per_channel.numpy(), same, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(curves.mi_cross.numpy(), cross.mean(0), rtol=1e-5, atol=1e-6)
    assert np.nanmax(same) > 0.1  # neighbours really depend on the centre: the comparison is not of noise


def test_isotropic_token_size_scales_the_token_curve():
    """Same data: an isotropic token size s gives the curves in tokens with distances multiplied by s."""
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    grid = (rng.randint(3, 5), rng.randint(3, 5), rng.randint(2, 4))
    s = rng.uniform(0.5, 8.0)
    acts = smooth_volume_acts(80, grid, 4, g).half()
    tokens = mi_vs_distance(acts, grid, 2, generator=torch.Generator().manual_seed(1), cross_channels=2)
    mm = mi_vs_distance(acts, grid, 2, generator=torch.Generator().manual_seed(1), cross_channels=2, token_size=(s, s, s))
    torch.testing.assert_close(mm.distances, tokens.distances * s, rtol=1e-12, atol=0)
    for key in ("mi_same", "mi_cross", "counts", "mi_same_per_channel"):
        torch.testing.assert_close(getattr(mm, key), getattr(tokens, key), rtol=0, atol=0, equal_nan=True)
    levels, _ = brute_classes(brute_distances(grid))
    np.testing.assert_allclose(tokens.distances.numpy(), levels, rtol=1e-12)
    # an anisotropic size splits classes the isotropic one merges
    stretched = mi_vs_distance(acts, grid, 2, generator=torch.Generator().manual_seed(1), cross_channels=2, token_size=(s, s, 1.7 * s))
    assert stretched.distances.numel() > tokens.distances.numel() and stretched.counts.sum() == tokens.counts.sum()


def test_constant_neurons_give_the_bias_term_not_nan():
    """Tokens over a volume's padding are constant over the images: r = 0 (MI = the bias), as gaussian_copula_mi."""
    g = torch.Generator().manual_seed(3)
    acts = torch.randn(40, 27, 3, generator=g)
    bias = float(gaussian_copula_mi(acts[:, 0, 0], torch.ones(40)))  # r = 0
    acts[:, ::2] = 1.5  # every other token constant, not the centre (13)
    curves = mi_vs_distance(acts, (3, 3, 3), 3, cross_channels=3, token_size=(1.0, 1.0, 2.0))
    assert torch.isfinite(curves.mi_same[1:]).all() and torch.isfinite(curves.mi_cross).all()
    assert (curves.mi_same_per_channel[:, 1:] != bias).any()  # the varying tokens are not flattened
    acts[:, 13] = -0.5  # a constant centre: every pair has r = 0
    curves = mi_vs_distance(acts, (3, 3, 3), 3, cross_channels=3, token_size=(1.0, 1.0, 2.0))
    torch.testing.assert_close(curves.mi_same[1:], torch.full_like(curves.mi_same[1:], bias))
    torch.testing.assert_close(curves.mi_cross, torch.full_like(curves.mi_cross, bias))
