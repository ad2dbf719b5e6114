"""Tests for vitlab.analysis.stats: kurtosis vs scipy, CKA invariances, attention-vs-angle vs a brute-force loop."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from vitlab.analysis.stats import attention_vs_angle, excess_kurtosis, linear_cka


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_excess_kurtosis_equals_scipy(dim):
    g = torch.Generator().manual_seed(dim + 5)
    x = torch.randn(30, 40, 3, generator=g).pow(3)  # heavy-tailed
    got = excess_kurtosis(x.half().float(), dim=dim)
    expected = scipy.stats.kurtosis(x.half().float().double().numpy(), axis=dim)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-12)
    assert torch.isnan(excess_kurtosis(torch.ones(5, 2))).all()


def _cka_reference(x, y):
    x = x.double().numpy()
    y = y.double().numpy()
    x, y = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


@pytest.mark.parametrize("n,d1,d2", [(200, 10, 7), (12, 40, 30)])  # feature-space and Gram paths
def test_linear_cka_identities(n, d1, d2):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, d1, generator=g) * torch.rand(d1, generator=g) + torch.randn(d1, generator=g)
    y = torch.tanh(x @ torch.randn(d1, d2, generator=g)) + 0.3 * torch.randn(n, d2, generator=g)
    torch.testing.assert_close(linear_cka(x, x), torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)
    assert linear_cka(x, y).item() == pytest.approx(_cka_reference(x, y), rel=1e-10)
    q, _ = torch.linalg.qr(torch.randn(d2, d2, generator=g, dtype=torch.float64))
    torch.testing.assert_close(linear_cka(x, 3.7 * y.double() @ q), linear_cka(x, y), rtol=1e-10, atol=0)


def test_linear_cka_is_small_for_independent_data_and_checks_n():
    g = torch.Generator().manual_seed(1)
    cka = linear_cka(torch.randn(2000, 5, generator=g), torch.randn(2000, 5, generator=g))
    assert cka < 0.05
    with pytest.raises(ValueError, match=r"\(10, 3\).*\(11, 3\)"):
        linear_cka(torch.zeros(10, 3), torch.zeros(11, 3))


def test_attention_vs_angle_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    batch, heads, tokens, width, bin_deg = 2, 3, 7, 4, 20.0
    h = torch.randn(batch, tokens, width, generator=g, dtype=torch.float64)
    h[0, 1] = 2.5 * h[0, 0]  # angle 0
    h[1, 2] = -h[1, 3]  # angle 180
    h[1, 5] = 0.0  # zero vector: angle 90 with everything
    attn = torch.softmax(3 * torch.randn(batch, heads, tokens, tokens, generator=g, dtype=torch.float64), -1)
    stats = attention_vs_angle(attn, h, bin_degrees=bin_deg)

    n_bins = 9
    sums, counts = np.zeros((heads, n_bins)), np.zeros(n_bins, dtype=np.int64)
    below, above, total = np.zeros(heads), np.zeros(heads), np.zeros(heads)
    hv, av = h.numpy(), attn.numpy()
    for b in range(batch):
        for i in range(tokens):
            for j in range(tokens):
                if i == j:
                    continue
                ni, nj = np.linalg.norm(hv[b, i]), np.linalg.norm(hv[b, j])
                cos = 0.0 if ni == 0 or nj == 0 else float(np.dot(hv[b, i], hv[b, j]) / (ni * nj))
                theta = math.degrees(math.acos(max(-1.0, min(1.0, cos))))
                k = min(int(theta // bin_deg), n_bins - 1)
                counts[k] += 1
                sums[:, k] += av[b, :, i, j]
                total += av[b, :, i, j]
                below += av[b, :, i, j] * (theta < 90)
                above += av[b, :, i, j] * (theta > 90)
    np.testing.assert_array_equal(stats.bin_counts.numpy(), counts)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(stats.mean_attention.numpy(), sums / counts, rtol=1e-10, equal_nan=True)
    np.testing.assert_allclose(stats.mass_below_90.numpy(), below / total, rtol=1e-10)
    np.testing.assert_allclose(stats.mass_above_90.numpy(), above / total, rtol=1e-10)
    diag = np.mean([[av[b, hh].diagonal().mean() for b in range(batch)] for hh in range(heads)], axis=1)
    np.testing.assert_allclose(stats.self_attention.numpy(), diag, rtol=1e-10)
    np.testing.assert_allclose(stats.bin_edges.numpy(), np.arange(0, 181, 20.0))
    assert counts[0] >= 2 and counts[-1] >= 2  # the planted 0 and 180 degree pairs were exercised


def test_attention_vs_angle_rejects_mismatched_tokens():
    with pytest.raises(ValueError, match="prefix"):
        attention_vs_angle(torch.zeros(1, 2, 5, 5), torch.zeros(1, 4, 3))
