"""The papers' claims (docs/probes.md) on planted data: each must hold where planted and fail where the plant is reversed."""

import math

import pytest
import torch

from vitlab.analysis import row_drift
from vitlab.analysis.claims import (
    FAILS,
    HOLDS,
    UNTESTABLE,
    between_head_share,
    claim_000a,
    claim_000b,
    claim_000c,
    claim_000d,
    claim_002a,
    claim_002b,
    claim_002c,
    claim_003a,
    claim_003b,
    head_cluster_test,
    relative_spread,
)


def planted_rows(scale: dict[str, float], blocks=("stage0.block0", "stage0.block1", "stage1.block0"), rows=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in blocks:
        for m in "qkv":
            ref = torch.randn(rows, d, generator=g)
            out[(b, m)] = row_drift(ref, ref + scale[m] * torch.randn(rows, d, generator=g))
    return out


def test_000a_holds_when_v_moves_least_and_fails_otherwise():
    assert claim_000a(planted_rows({"q": 0.3, "k": 0.3, "v": 0.05})).verdict == HOLDS
    bad = claim_000a(planted_rows({"q": 0.3, "k": 0.02, "v": 0.05}))
    assert bad.verdict == FAILS
    assert set(bad.value) == {"stage0.mse", "stage0.euclidean", "stage1.mse", "stage1.euclidean"}


def test_000a_needs_every_stage():
    rows = planted_rows({"q": 0.3, "k": 0.3, "v": 0.05}, blocks=("stage0.block0",))
    rows.update(planted_rows({"q": 0.05, "k": 0.3, "v": 0.3}, blocks=("stage1.block0",), seed=1))
    assert claim_000a(rows).verdict == FAILS


def test_000b_dot_product_and_norms():
    g = torch.Generator().manual_seed(1)
    rows = {}
    for m, shrink in zip("qkv", (1.0, 1.0, 0.5)):
        ref = torch.randn(8, 8, generator=g)
        rows[("blocks.0", m)] = row_drift(ref, shrink * ref)
    c = claim_000b(rows)
    assert c.verdict == HOLDS
    expected = float((rows[("blocks.0", "v")]["ref_norm"] ** 2 * 0.5).mean())
    assert math.isclose(c.value["dot"]["v"], expected, rel_tol=1e-9)
    rows[("blocks.0", "v")], rows[("blocks.0", "q")] = rows[("blocks.0", "q")], rows[("blocks.0", "v")]
    assert claim_000b(rows).verdict == FAILS


def test_relative_spread_is_cv():
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0
    assert math.isclose(relative_spread([1.0, 2.0, 3.0]), math.sqrt(2 / 3) / 2.0)


def test_000c_cosine_spread_smallest_when_only_norms_differ():
    # scaling rows changes Euclidean/MSE drift but not the cosine distance: Q scaled by 10 keeps cosine equal
    g = torch.Generator().manual_seed(2)
    rows = {}
    for m, s in zip("qkv", (10.0, 1.0, 1.0)):
        ref = torch.randn(16, 8, generator=g)
        cur = ref + 0.1 * torch.randn(16, 8, generator=g)
        rows[("blocks.0", m)] = row_drift(s * ref, s * cur)
    assert claim_000c(rows).verdict == HOLDS
    # cosine drift differs across Q/K/V while Euclidean is identical (same perturbation, rescaled refs)
    rows = {}
    ref = torch.randn(16, 8, generator=g)
    delta = 0.3 * torch.randn(16, 8, generator=g)
    for m, s in zip("qkv", (0.5, 1.0, 4.0)):
        rows[("blocks.0", m)] = row_drift(s * ref, s * ref + delta)
    assert claim_000c(rows).verdict == FAILS


def test_between_head_share_identity():
    v = torch.tensor([1.0, 1.0, 3.0, 3.0])
    assert between_head_share(v, 2) == pytest.approx(1.0)
    v = torch.tensor([1.0, 3.0, 1.0, 3.0])
    assert between_head_share(v, 2) == pytest.approx(0.0)


def test_000d_planted_head_clusters_vs_none():
    g = torch.Generator().manual_seed(3)
    heads = {"blocks.0": 4, "blocks.1": 4}
    clustered, flat = {}, {}
    for b in heads:
        for m in "qkv":
            level = torch.arange(4.0).repeat_interleave(8)  # 4 heads x 8 rows, heads at different drift levels
            clustered[(b, m)] = {"euclidean": level + 0.2 * torch.randn(32, generator=g)}
            flat[(b, m)] = {"euclidean": torch.rand(32, generator=g)}
    c = claim_000d(clustered, heads, permutations=199)
    assert c.verdict == HOLDS and c.value["significant"] == 6
    f = claim_000d(flat, heads, permutations=199)
    assert f.verdict == FAILS and f.value["significant"] <= 1
    assert claim_000d(flat, {"blocks.0": 1, "blocks.1": 1}).verdict == UNTESTABLE


def test_head_cluster_p_value_bounds():
    share, p = head_cluster_test(torch.arange(8.0), 2, permutations=99, generator=torch.Generator().manual_seed(0))
    assert share > 0.7 and p == pytest.approx(1 / 100 * (1 + 0), abs=0.03)
    with pytest.raises(ValueError, match="heads"):
        head_cluster_test(torch.arange(7.0), 2)


def test_002_claims_thresholds():
    assert claim_002a({"a": 0.7, "b": 0.55}, {"a": 0.6, "b": 0.5}).verdict == HOLDS
    assert claim_002a({"a": 0.7, "b": 0.45}, {"a": 0.6, "b": 0.5}).verdict == FAILS
    sym = {f"b{i}": s for i, s in enumerate([0.5, 0.4, 0.2, 0.1, -0.1, -0.3])}
    assert claim_002b(sym).verdict == HOLDS
    assert claim_002b({k: -v for k, v in sym.items()}).verdict == FAILS
    assert claim_002b({"b0": 0.1, "b1": -0.2}).verdict == UNTESTABLE
    assert claim_002c({"b0": 5.0, "b1": 6.0, "b2": 4.0, "b3": 2.0}).verdict == HOLDS
    assert claim_002c({"b0": 5.0, "b1": 6.0, "b2": 4.0, "b3": 5.5}).verdict == FAILS
    assert claim_002c({"b0": 5.0}).verdict == UNTESTABLE
    # wider last stage: raw ranks say "does not hold", ranks per width say "holds"
    ranks, widths = {"s0.b0": 20.0, "s0.b1": 22.0, "s1.b0": 30.0}, {"s0.b0": 32, "s0.b1": 32, "s1.b0": 64}
    assert claim_002c(ranks).verdict == FAILS
    rel = claim_002c(ranks, widths)
    assert rel.verdict == HOLDS and rel.value["last_block"] == pytest.approx(30 / 64) and "width" in rel.statistic


def test_003_ablation_claims():
    runs = [("no_res", ["residual"], 0.52, 2), ("no_attn", ["attention"], 0.85, 2)]
    assert claim_003a(runs).verdict == HOLDS
    assert claim_003b(runs).verdict == HOLDS
    runs = [("no_res", ["residual"], 0.80, 2), ("no_attn", ["attention"], 0.55, 2)]
    assert claim_003a(runs).verdict == FAILS
    assert claim_003b(runs).verdict == FAILS
    none = claim_003a([])
    assert none.verdict == UNTESTABLE and "--ablation-run" in none.reason
