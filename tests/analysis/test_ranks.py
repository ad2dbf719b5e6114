"""Tests for vitlab.analysis.ranks: radix-sorted average ranks against scipy for every float width."""

import numpy as np
import pytest
import torch
from scipy.special import ndtri
from scipy.stats import rankdata

from vitlab.analysis import ranks
from vitlab.analysis.ranks import average_ranks, column_scores, copula_normalize, equal_frequency_bins


def _tricky(dtype, seed):
    """Signed values spanning many exponents, with ties, -0.0 and +0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 4, generator=g) * torch.exp(2 * torch.randn(300, 4, generator=g))  # fits fp16
    x[::7] = x[::7].round()  # ties
    x[3, :], x[5, :], x[11, :] = 0.0, -0.0, -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32])
def test_average_ranks_equal_scipy(dtype):
    x = _tricky(torch.float64, seed=1).to(dtype) if dtype != torch.int32 else torch.randint(-5, 5, (300, 4))
    expected = rankdata(x.double().numpy(), axis=0)  # exact: every dtype converts to float64 exactly
    got = average_ranks(x, chunk=3)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    np.testing.assert_array_equal(got.double().numpy(), expected)
    bins = equal_frequency_bins(x, 7)
    np.testing.assert_array_equal(bins.numpy(), np.floor((expected - 1) * 7 / 300).astype(np.int64))


def test_scores_are_phi_inverse_of_ranks_along_any_dim():
    x = _tricky(torch.float32, seed=2)
    expected = ndtri(rankdata(x.numpy(), axis=0) / 301)
    np.testing.assert_allclose(copula_normalize(x).numpy(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(copula_normalize(x.T.contiguous(), dim=1).T.numpy(), expected, rtol=1e-6, atol=1e-6)
    flat = column_scores(x)  # (cols, N) layout
    assert flat.shape == (4, 300)
    torch.testing.assert_close(flat.T, copula_normalize(x))


def test_device_sort_branch_gives_the_same_ranks(monkeypatch):
    """The GPU branch (torch.sort) and the CPU radix sort must agree; exercise torch.sort on CPU."""
    x = _tricky(torch.float16, seed=3)
    radix = average_ranks(x)
    monkeypatch.setattr(ranks, "_radix_argsort", lambda block: torch.sort(block, dim=-1, stable=True).indices)
    torch.testing.assert_close(average_ranks(x), radix, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_non_finite_samples_are_rejected(bad, dtype):
    x = torch.randn(50, 3)
    x[17, 1] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        copula_normalize(x.to(dtype))
