"""Attention vs query-key distance in mm and the orthogonal planes of a 3-D token map, against brute-force loops."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.models import shifted_window_partners
from vitlab.analysis import attention_geometry
from vitlab.analysis.attention_geometry import (attention_vs_distance, merge_distance_stats, orthogonal_planes, query_token,
                                                token_centres, window_pairs)
from vitlab.models.adapter import window_slot_tokens


def brute_force(probs, coords, edges, valid, pairs=None):
    """Loop over every (sample, head, query, key) pair."""
    groups, tokens = valid.shape
    heads, n_bins = probs.shape[1], len(edges) - 1
    sums = torch.zeros(heads, n_bins, dtype=torch.float64)
    counts = torch.zeros(n_bins, dtype=torch.float64)
    weighted = torch.zeros(heads, dtype=torch.float64)
    mass = torch.zeros(heads, dtype=torch.float64)
    for b in range(probs.shape[0]):
        g = b % groups
        for q in range(tokens):
            for k in range(tokens):
                if not (valid[g, q] and valid[g, k]) or (pairs is not None and not pairs[g, q, k]):
                    continue
                d = math.dist(coords[g, q].tolist(), coords[g, k].tolist())
                hit = [i for i in range(n_bins) if edges[i] <= d < edges[i + 1] or (i == n_bins - 1 and d == edges[-1])]
                if hit:
                    counts[hit[0]] += 1
                for h in range(heads):
                    p = float(probs[b, h, q, k])
                    weighted[h] += p * d
                    mass[h] += p
                    if hit:
                        sums[h, hit[0]] += p
    return sums, counts, weighted, mass


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_vs_distance_equals_brute_force(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    groups, tokens, heads, samples = 3, 6, 2, 2
    probs = torch.softmax(3 * torch.randn(samples * groups, heads, tokens, tokens, generator=g, dtype=torch.float64), -1)
    coords = torch.rand(groups, tokens, 3, generator=g, dtype=torch.float64) * torch.tensor([10.0, 14.0, 25.0], dtype=torch.float64)
    valid = torch.rand(groups, tokens, generator=g) > 0.2
    edges = torch.arange(0.0, 20.0, float(torch.rand(1, generator=g)) * 4 + 1, dtype=torch.float64)  # some pairs overflow
    pairs = torch.rand(groups, tokens, tokens, generator=g) > 0.3 if seed else None
    if seed == 2:  # a group or two at a time, as for big windows
        monkeypatch.setattr(attention_geometry, "_CHUNK", 2 * tokens * tokens)
    stats = attention_vs_distance(probs, coords, edges, valid, pairs)
    sums, counts, weighted, mass = brute_force(probs, coords, edges, valid, pairs)
    torch.testing.assert_close(stats.attention_sums, sums, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.pair_counts, counts, rtol=0, atol=0)
    torch.testing.assert_close(stats.weighted_distance, weighted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.mass, mass, rtol=1e-10, atol=1e-12)
    # batches merge exactly: samples split in two parts give the stats of all of them
    halves = [attention_vs_distance(probs[i * groups:(i + 1) * groups], coords, edges, valid, pairs) for i in range(samples)]
    merged = merge_distance_stats(halves)
    torch.testing.assert_close(merged.attention_sums, stats.attention_sums, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(merged.mean_distance, stats.mean_distance, rtol=1e-12, atol=1e-14)


def test_token_centres_and_uniform_attention_distance():
    centres = token_centres((2, 3, 4), (1.5, 2.0, 5.0))
    assert centres.shape == (24, 3)
    torch.testing.assert_close(centres[1 * 12 + 2 * 4 + 3], torch.tensor([2.25, 5.0, 17.5], dtype=torch.float64))
    # uniform attention over a 1-D line of 3 tokens 2 mm apart: distances 0, 2, 4 -> mean (0*3 + 2*4 + 4*2) / 9
    probs = torch.full((1, 1, 3, 3), 1 / 3, dtype=torch.float64)
    stats = attention_vs_distance(probs, token_centres((3,), (2.0,)), torch.tensor([0.0, 1.0, 3.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(stats.mean_distance, torch.tensor([16 / 9], dtype=torch.float64))
    torch.testing.assert_close(stats.pair_counts, torch.tensor([3.0, 4.0, 2.0], dtype=torch.float64))


def test_orthogonal_planes_and_query_token():
    grid = (3, 4, 5)
    values = torch.randn(2, math.prod(grid))
    axial, coronal, sagittal = orthogonal_planes(values, grid, (1, 2, 3))
    for i in range(3):
        for j in range(4):
            for k in range(5):
                t = (i * 4 + j) * 5 + k
                if k == 3:
                    assert torch.equal(axial[:, i, j], values[:, t])
                if j == 2:
                    assert torch.equal(coronal[:, i, k], values[:, t])
                if i == 1:
                    assert torch.equal(sagittal[:, j, k], values[:, t])
    assert query_token((31, 0, 15), (32, 32, 16), (4, 4, 2)) == (3, 0, 1)
    with pytest.raises(ValueError, match="outside"):
        query_token((32, 0, 0), (32, 32, 16), (4, 4, 2))
    with pytest.raises(ValueError, match="outside the grid"):
        orthogonal_planes(values, grid, (3, 0, 0))


@pytest.mark.parametrize("grid,window,shift", [((8, 8, 8), (4, 4, 4), (2, 2, 2)), ((8, 8, 8), (4, 4, 4), (0, 0, 0)),
                                               ((6, 9), (3, 3), (1, 1)), ((4, 4, 4), (4, 4, 4), (0, 0, 0))])
def test_window_pairs_are_the_unmasked_pairs(grid, window, shift):
    slots = window_slot_tokens(grid, window, shift, False)  # (G, T)
    pairs = window_pairs(slots, grid, window)
    partners = shifted_window_partners(grid, window, shift)
    for g in range(slots.shape[0]):
        assert torch.equal(pairs[g], partners[slots[g]][:, slots[g]])
    if any(shift):
        assert not bool(pairs.all())  # some pairs of a shifted window are masked apart
    # attention_vs_distance's reach (what the probe passes) keeps exactly these pairs
    token_size = [1.4, 2.5, 0.7][: len(grid)]
    centres = token_centres(grid, token_size)
    centres = torch.cat([centres, centres.new_zeros(1, len(grid))])[slots]
    probs = torch.softmax(torch.randn(2 * slots.shape[0], 2, slots.shape[1], slots.shape[1], dtype=torch.float64), -1)
    edges = torch.arange(0.0, 40.0, 3.0, dtype=torch.float64)
    valid = slots < math.prod(grid)
    by_mask = attention_vs_distance(probs, centres, edges, valid, pairs=pairs)
    by_reach = attention_vs_distance(probs, centres, edges, valid, reach=[(w - 0.5) * t for w, t in zip(window, token_size)])
    for field in ("pair_counts", "attention_sums", "weighted_distance", "mass"):
        torch.testing.assert_close(getattr(by_reach, field), getattr(by_mask, field), rtol=0, atol=0)
