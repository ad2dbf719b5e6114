"""The papers' claims (docs/probes.md) on planted data: each must hold where planted and fail where the plant is reversed."""

import math

import numpy as np

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


# ------------------------------------------------------------------------------ each claim as one number T


def _random_rows(seed: int, blocks=("stage0.block0", "stage0.block1", "stage0.block2", "stage1.block0", "stage1.block1")):
    g = torch.Generator().manual_seed(seed)
    scales = {b: {m: float(torch.rand(1, generator=g)) * 0.5 + 0.01 for m in "qkv"} for b in blocks}
    out = {}
    for b in blocks:
        for m in "qkv":
            rows, d = 2 * int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
            ref = torch.randn(rows, d, generator=g)
            out[(b, m)] = row_drift(ref, ref * (1 + 0.3 * torch.randn(1, generator=g)) + scales[b][m] * torch.randn(rows, d, generator=g))
    return out


def _mean(rows, block, m, metric):
    return float(rows[(block, m)][metric].double().mean())


@pytest.mark.parametrize("seed", range(4))
def test_each_verdict_is_the_claims_rule_applied_to_its_score(seed):
    from vitlab.analysis.studies import satisfies

    rows = _random_rows(seed)
    g = torch.Generator().manual_seed(100 + seed)
    blocks = [f"b{i}" for i in range(6)]
    mass = {b: float(torch.rand(1, generator=g)) * 0.4 + 0.35 for b in blocks}
    sym = {b: float(torch.rand(1, generator=g)) * 2 - 1 for b in blocks}
    rank = {b: float(torch.rand(1, generator=g)) * 10 + 1 for b in blocks}
    acc = [("r", ["residual"], float(torch.rand(1, generator=g)) * 0.3 + 0.4, 2),
           ("a", ["attention"], float(torch.rand(1, generator=g)) * 0.5 + 0.4, 3)]
    claims = [claim_000a(rows), claim_000b(rows), claim_000c(rows), claim_000d(rows, {b: 2 for b, _ in rows}, permutations=19),
              claim_002a(mass, mass), claim_002b(sym), claim_002c(rank), claim_003a(acc), claim_003b(acc)]
    for c in claims:
        assert c.verdict == (HOLDS if satisfies(c.score, c.holds_when, c.threshold) else FAILS), c.id
        assert c.holds_when in c.comparison and f"{c.threshold:g}" in c.comparison, c.id
    stages = {"stage0": ["stage0.block0", "stage0.block1", "stage0.block2"], "stage1": ["stage1.block0", "stage1.block1"]}
    ratio = max(sum(_mean(rows, b, "v", metric) for b in bs) / min(sum(_mean(rows, b, "q", metric) for b in bs),
                                                                 sum(_mean(rows, b, "k", metric) for b in bs))
                for bs in stages.values() for metric in ("mse", "euclidean"))
    assert claims[0].score == pytest.approx(ratio, rel=1e-12)
    dots = {m: sum(_mean(rows, b, m, "dot") for bs in stages.values() for b in bs) / 5 for m in "qkv"}
    assert claims[1].score == pytest.approx(dots["v"] - min(dots["q"], dots["k"]), rel=1e-9, abs=1e-12)
    assert claims[4].score == min(mass.values()) and claims[6].score == pytest.approx(rank["b5"] - float(torch.tensor([rank[b] for b in blocks[:5]]).median()))
    assert claims[7].score == pytest.approx(acc[0][2] - 0.5) and claims[8].score == pytest.approx(acc[1][2] - 1 / 3)


def test_ablation_claim_at_its_boundary_holds():
    assert claim_003a([("r", ["residual"], 0.55, 2)]).verdict == HOLDS  # 0.55 - 0.5 <= 0.05 despite rounding
    assert claim_003b([("a", ["attention"], 0.6, 2)]).verdict == HOLDS


def test_drift_claims_carry_a_block_bootstrap_interval_within_stages():
    from scipy.stats import bootstrap

    rows = _random_rows(7)
    c = claim_000b(rows, seed=3)
    assert c.interval["unit"].startswith("blocks, resampled within each stage") and c.interval["resamples"] == 9999
    stage0, stage1 = ["stage0.block0", "stage0.block1", "stage0.block2"], ["stage1.block0", "stage1.block1"]
    names = stage0 + stage1
    dot = {m: np.array([_mean(rows, b, m, "dot") for b in names]) for m in "qkv"}

    def direct(a, b, axis=-1):  # blocks drawn with replacement within each stage, pooled, then the claim's T
        idx = np.concatenate([a, b], axis=-1)
        return dot["v"][idx].mean(-1) - np.minimum(dot["q"][idx].mean(-1), dot["k"][idx].mean(-1))

    ci = bootstrap((np.arange(3), np.arange(3, 5)), direct, n_resamples=9999, method="BCa", random_state=3,
                   vectorized=True).confidence_interval
    if not np.isfinite(ci.low):
        ci = bootstrap((np.arange(3), np.arange(3, 5)), direct, n_resamples=9999, method="percentile", random_state=3,
                       vectorized=True).confidence_interval
    assert (c.interval["low"], c.interval["high"]) == pytest.approx((ci.low, ci.high), rel=1e-9)
    single = {k: v for k, v in rows.items() if k[0] in ("stage0.block0", "stage1.block0")}
    assert claim_000a(single).interval is None  # one block per stage: nothing to resample


def test_unchanged_weights_make_000a_untestable():
    ref = torch.randn(4, 3)
    rows = {("stage0.block0", m): row_drift(ref, ref.clone()) for m in "qkv"}
    assert all(c.verdict == UNTESTABLE and "did not change" in c.reason for c in (claim_000a(rows), claim_000b(rows), claim_000c(rows), claim_000d(rows, {"stage0.block0": 2})))
