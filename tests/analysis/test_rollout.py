"""Tests for vitlab.analysis.rollout: closed form for uniform attention, an explicit loop, pooling."""

import numpy as np
import pytest
import torch

from vitlab.analysis.rollout import attention_rollout, pool_tokens, rollout_map


def _random_attention(batch, heads, tokens, layers, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(2 * torch.randn(batch, heads, tokens, tokens, generator=g, dtype=torch.float64), -1)
            for _ in range(layers)]


@pytest.mark.parametrize("weight", [0.5, 0.2])
def test_uniform_attention_closed_form(weight):
    batch, heads, tokens, layers = 2, 3, 5, 4
    uniform = torch.full((batch, heads, tokens, tokens), 1.0 / tokens, dtype=torch.float64)
    got = attention_rollout([uniform] * layers, residual_weight=weight)
    eye = torch.eye(tokens, dtype=torch.float64)
    ones = torch.full((tokens, tokens), 1.0 / tokens, dtype=torch.float64)  # 11^T / N
    expected = weight**layers * eye + (1 - weight**layers) * ones
    torch.testing.assert_close(got, expected.expand(batch, -1, -1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_equals_explicit_loop_and_rows_sum_to_one(fusion):
    attns = _random_attention(2, 4, 6, 3, seed=1)
    got = attention_rollout(attns, head_fusion=fusion)
    reduce = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    for b in range(2):
        r = np.eye(6)
        for a in attns:
            a_hat = 0.5 * reduce(a[b].numpy(), axis=0) + 0.5 * np.eye(6)
            a_hat = a_hat / a_hat.sum(axis=1)[:, None]  # each row by its own sum
            r = a_hat @ r
        np.testing.assert_allclose(got[b].numpy(), r, rtol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 6, dtype=torch.float64), rtol=0, atol=1e-12)


def test_rollout_map_with_and_without_prefix():
    rollout = attention_rollout(_random_attention(2, 2, 1 + 6, 2, seed=2))  # CLS + 2x3 grid
    torch.testing.assert_close(rollout_map(rollout, 1, (2, 3)), rollout[:, 0, 1:].reshape(2, 2, 3))
    no_prefix = attention_rollout(_random_attention(2, 2, 6, 2, seed=3))
    torch.testing.assert_close(rollout_map(no_prefix, 0, (3, 2)), no_prefix.mean(1).reshape(2, 3, 2))
    with pytest.raises(ValueError, match="grid"):
        rollout_map(rollout, 0, (2, 3))


def test_pool_tokens_equals_merge_matrices_and_keeps_rows_stochastic():
    rows, cols, f = 4, 6, 2
    attn = _random_attention(2, 3, rows * cols, 1, seed=4)[0]  # (B, H, N, N)
    pooled = pool_tokens(attn, (rows, cols), factor=f)
    assert pooled.shape == (2, 3, 6, 6)
    merge = torch.zeros(6, rows * cols, dtype=torch.float64)  # coarse token <- its 4 fine tokens
    for t in range(rows * cols):
        merge[(t // cols) // f * (cols // f) + (t % cols) // f, t] = 1.0
    expected = (merge / f**2) @ attn @ merge.T  # queries averaged, keys summed
    torch.testing.assert_close(pooled, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pooled.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(pool_tokens(attn, (rows, cols), factor=1), attn)
    rolled = attention_rollout([pooled, pool_tokens(attn, (rows, cols), 2)])
    assert rolled.shape == (2, 6, 6)
    with pytest.raises(ValueError, match="divide"):
        pool_tokens(attn, (rows, cols), factor=4)


def test_rollout_rejects_mixed_resolutions():
    attns = _random_attention(1, 2, 4, 1, seed=5) + _random_attention(1, 2, 16, 1, seed=6)
    with pytest.raises(ValueError, match="pool_tokens"):
        attention_rollout(attns)
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout(attns[:1], head_fusion="sum")


@pytest.mark.parametrize("grid,f", [((4, 6, 2), 2), ((4, 4, 4), 4), ((2, 4, 6), 2)])
def test_pool_tokens_3d_equals_merge_matrices(grid, f):
    """3-D grids (SwinUNETR stages): each coarse token merges f^3 fine ones; an independent merge-matrix form."""
    n = grid[0] * grid[1] * grid[2]
    attn = _random_attention(2, 2, n, 1, seed=7 + f)[0]
    coarse = tuple(g // f for g in grid)
    merge = torch.zeros(n // f**3, n, dtype=torch.float64)
    for t in range(n):
        i, rest = divmod(t, grid[1] * grid[2])
        j, k = divmod(rest, grid[2])
        merge[((i // f) * coarse[1] + j // f) * coarse[2] + k // f, t] = 1.0
    pooled = pool_tokens(attn, grid, factor=f)
    torch.testing.assert_close(pooled, (merge / f**3) @ attn @ merge.T, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pooled.sum(-1), torch.ones(2, 2, n // f**3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert rollout_map(attention_rollout([pooled]), 0, coarse).shape == (2, *coarse)


@pytest.mark.parametrize("grid,window,shift,factor", [((8, 8, 8), (4, 4, 4), (2, 2, 2), 4), ((4, 4, 4), (4, 4, 4), (0, 0, 0), 2),
                                                      ((8, 12), (4, 4), (2, 2), 2), ((7, 7), (4, 4), (2, 2), 7)])
def test_window_forms_equal_the_dense_form(grid, window, shift, factor):
    """Pooling and query rows straight from Swin windows = the same from the dense token x token matrix."""
    from vitlab.models.adapter import window_slot_tokens
    from vitlab.models.attention import dense_window_attention
    from vitlab.analysis.rollout import pool_window_attention, window_query_rows

    slots = window_slot_tokens(grid, window, shift, False)
    n = 1
    for side in grid:
        n *= side
    g = torch.Generator().manual_seed(sum(grid))
    probs = torch.softmax(torch.randn(2 * slots.shape[0], 3, slots.shape[1], slots.shape[1], generator=g, dtype=torch.float64), -1)
    dense = dense_window_attention(probs, slots, n)  # (2, 3, N, N)
    torch.testing.assert_close(pool_window_attention(probs, slots, grid, factor), pool_tokens(dense, grid, factor), rtol=1e-12, atol=1e-14)
    for token in (0, n // 2, n - 1):
        assert torch.equal(window_query_rows(probs, slots, n, token), dense[:, :, token])
