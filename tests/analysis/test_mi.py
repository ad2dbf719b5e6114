"""Tests for vitlab.analysis.mi: estimators against Gaussian ground truth, invariances, and loops."""

import math

import numpy as np
import pytest
import torch
from scipy.special import digamma, ndtri
from scipy.stats import rankdata

from vitlab.analysis.mi import (
    average_ranks,
    binned_mi,
    copula_normalize,
    gaussian_copula_mi,
    ksg_mi,
    mi_vs_distance,
)


def _gaussian_pair(n, rho, g):
    x = torch.randn(n, generator=g, dtype=torch.float64)
    y = rho * x + math.sqrt(1 - rho * rho) * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8])
def test_copula_mi_matches_gaussian_truth(rho):
    g = torch.Generator().manual_seed(int(rho * 10))
    estimates = [gaussian_copula_mi(*_gaussian_pair(2000, rho, g)).item() for _ in range(20)]
    assert abs(np.mean(estimates) - (-0.5 * math.log(1 - rho * rho))) < 0.02


def test_copula_mi_of_independent_columns_is_near_zero_and_reported_raw():
    g = torch.Generator().manual_seed(0)
    mi = gaussian_copula_mi(torch.randn(2000, generator=g), torch.randn(2000, 50, generator=g))
    assert mi.shape == (50,) and mi.dtype == torch.float64
    assert abs(mi.mean().item()) < 0.002 and mi.abs().max() < 0.01
    assert (mi < 0).any()  # the bias correction is not clamped away


def test_copula_mi_equals_the_formula_computed_with_scipy():
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 9, (30,), generator=g).double()  # ties
    y = x.unsqueeze(1) * torch.rand(30, 3, generator=g, dtype=torch.float64) + torch.randn(30, 3, generator=g)
    n = 30
    zx = ndtri(rankdata(x.numpy()) / (n + 1))
    expected = []
    for col in y.T.numpy():
        r = np.corrcoef(zx, ndtri(rankdata(col) / (n + 1)))[0, 1]
        expected.append(-0.5 * np.log(1 - r * r) + 0.5 * (digamma((n - 2) / 2) - digamma((n - 1) / 2)))
    np.testing.assert_allclose(gaussian_copula_mi(x, y).numpy(), expected, rtol=1e-10, atol=1e-12)


def test_bias_correction_removes_small_sample_bias():
    g = torch.Generator().manual_seed(9)
    mi = gaussian_copula_mi(torch.randn(50, generator=g), torch.randn(50, 4000, generator=g))  # independent
    assert abs(mi.mean().item()) < 0.002  # uncorrected, the mean would be about 1/(2N) = 0.01


def test_copula_mi_is_exactly_invariant_under_monotone_maps():
    g = torch.Generator().manual_seed(1)
    x, y = _gaussian_pair(500, 0.6, g)
    y2 = torch.stack([y, -y], 1)  # (N, 2): a decreasing map flips r's sign only
    base = gaussian_copula_mi(x, y2)
    mapped = gaussian_copula_mi(torch.exp(x), torch.stack([y**3 + 2.0, torch.atan(-y)], 1))
    torch.testing.assert_close(mapped, base, rtol=0, atol=1e-12)
    torch.testing.assert_close(base[0], base[1], rtol=0, atol=1e-12)


def test_ranks_and_copula_scores_match_scipy_with_ties():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 6, (40, 3, 2), generator=g).to(torch.float64)  # many ties
    expected_ranks = rankdata(x.numpy(), axis=0)
    torch.testing.assert_close(average_ranks(x), torch.from_numpy(expected_ranks), rtol=0, atol=0)
    z = copula_normalize(x, chunk=1)  # one column per block
    torch.testing.assert_close(z, torch.from_numpy(ndtri(expected_ranks / 41)), rtol=1e-12, atol=1e-12)
    z1 = copula_normalize(x.transpose(0, 2), dim=2)
    torch.testing.assert_close(z1, z.transpose(0, 2), rtol=0, atol=0)
    half = torch.randn(300, 7, generator=g).half()
    out = copula_normalize(half)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, copula_normalize(half.float()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="NaN"):
        copula_normalize(torch.tensor([1.0, float("nan"), 2.0]))


def _binned_reference(x, y, bins):
    """Plug-in MI + Miller-Madow from numpy histograms of scipy rank bins (independent of torch)."""
    n = len(x)
    bx = np.minimum(np.floor((rankdata(x) - 1) * bins / n), bins - 1)
    by = np.minimum(np.floor((rankdata(y) - 1) * bins / n), bins - 1)
    joint, _, _ = np.histogram2d(bx, by, bins=bins, range=[[0, bins], [0, bins]])
    p = joint / n
    px, py = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    plugin = np.sum(p[nz] * np.log(p[nz] / (px @ py)[nz]))
    return plugin - ((joint > 0).sum() - (px > 0).sum() - (py > 0).sum() + 1) / (2 * n)


def test_binned_mi_flags_non_monotone_dependence_and_matches_numpy():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2000, generator=g, dtype=torch.float64)
    y = x**2 + 0.5 * torch.randn(2000, generator=g, dtype=torch.float64)
    assert abs(gaussian_copula_mi(x, y).item()) < 0.02
    binned = binned_mi(x, y, bins=16)
    assert binned.item() > 0.3
    assert binned.item() == pytest.approx(_binned_reference(x.numpy(), y.numpy(), 16), abs=1e-12)
    indep = binned_mi(x, torch.randn(2000, 3, generator=g), bins=16)
    assert indep.shape == (3,) and indep.abs().max() < 0.03
    with pytest.raises(ValueError, match="bins"):
        binned_mi(x, y, bins=1)
    with pytest.raises(ValueError, match=r"\(N,\) or \(N, D\)"):
        binned_mi(x, y[:10])


def test_ksg_wrapper_agrees_with_truth():
    g = torch.Generator().manual_seed(4)
    x, y = _gaussian_pair(1000, 0.7, g)
    assert ksg_mi(x, y).item() == pytest.approx(-0.5 * math.log(1 - 0.49), abs=0.06)


def _planted_acts(n, grid, channels, length, g):
    """Gaussian fields on the token grid with corr exp(-d / length) per channel, independent channels."""
    rows, cols = grid
    pos = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    dist = torch.cdist(pos.double(), pos.double())
    chol = torch.linalg.cholesky(torch.exp(-dist / length))  # (T, T)
    field = torch.randn(n, channels, rows * cols, generator=g, dtype=torch.float64) @ chol.T  # (N, C, T)
    return field.transpose(1, 2)  # (N, T, C)


def test_mi_vs_distance_decreases_for_planted_decay():
    g = torch.Generator().manual_seed(5)
    acts = _planted_acts(600, (7, 7), 6, length=1.5, g=g).half()  # fp16 storage
    curves = mi_vs_distance(acts, (7, 7), centre_channels=4, cross_channels=4, generator=g)
    assert curves.distances[0] == 0 and torch.isnan(curves.mi_same[0]) and curves.counts.sum() == 49
    same = curves.mi_same[1:]
    rho = np.corrcoef(np.argsort(np.argsort(same.numpy())), curves.distances[1:].numpy())[0, 1]
    assert rho < -0.9
    truth = -0.5 * torch.log1p(-torch.exp(-2 * curves.distances[1:] / 1.5))  # corr exp(-d / 1.5)
    assert (same - truth).abs().max() < 0.03
    assert curves.mi_cross.abs().max() < 0.03  # channels are independent
    assert curves.mi_same_per_channel.shape == (4, curves.distances.numel())
    for estimator in ("copula", "binned"):  # no cross channels: the cross curve is NaN, the rest unchanged
        alone = mi_vs_distance(acts[:200], (7, 7), centre_channels=2, cross_channels=0, estimator=estimator)
        assert alone.cross_channels.numel() == 0 and torch.isnan(alone.mi_cross).all()
        assert torch.isfinite(alone.mi_same[1:]).all()


@pytest.mark.parametrize("estimator", ["copula", "binned"])
def test_mi_vs_distance_equals_per_pair_loop(estimator):
    g = torch.Generator().manual_seed(6)
    grid, n = (3, 4), 200
    acts = _planted_acts(n, grid, 5, length=2.0, g=g).float()
    curves = mi_vs_distance(acts, grid, centre_channels=3, cross_channels=3, estimator=estimator,
                            generator=torch.Generator().manual_seed(7), bins=8)
    pair_mi = gaussian_copula_mi if estimator == "copula" else (lambda a, b: binned_mi(a, b, bins=8))
    t0 = (grid[0] // 2) * grid[1] + grid[1] // 2
    dist = [math.hypot(t // grid[1] - grid[0] // 2, t % grid[1] - grid[1] // 2) for t in range(12)]
    levels = sorted(set(dist))
    torch.testing.assert_close(curves.distances, torch.tensor(levels, dtype=torch.float64))
    same = np.zeros((3, len(levels)))
    cross = np.zeros((3, len(levels)))
    for i, c0 in enumerate(curves.centre_channels.tolist()):
        centre = acts[:, t0, c0]
        others = [c for c in curves.cross_channels.tolist() if c != c0]
        for j, level in enumerate(levels):
            toks = [t for t in range(12) if dist[t] == level]
            same_vals = [pair_mi(centre, acts[:, t, c0]).item() for t in toks if t != t0]
            same[i, j] = np.mean(same_vals) if same_vals else np.nan
            cross[i, j] = np.mean([np.mean([pair_mi(centre, acts[:, t, c]).item() for c in others]) for t in toks])
    np.testing.assert_allclose(curves.mi_same_per_channel.numpy(), same, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(curves.mi_same.numpy(), same.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(curves.mi_cross.numpy(), cross.mean(0), rtol=1e-5, atol=1e-6)


def test_mi_vs_distance_rejects_bad_grid():
    with pytest.raises(ValueError, match=r"grid \(4, 4\).*T = 12"):
        mi_vs_distance(torch.zeros(10, 12, 3), (4, 4))
    with pytest.raises(ValueError, match="estimator"):
        mi_vs_distance(torch.zeros(10, 12, 3), (3, 4), estimator="ksg")
