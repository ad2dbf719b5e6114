"""Statistics of a study on planted per-seed values: intervals against scipy computed directly, coverage, and the
verdict oracles (a planted effect of 5 standard errors holds, a null is inconclusive, the wrong side does not hold)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import bootstrap, norm, t

from vitlab.analysis.studies import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    TOO_FEW,
    UNTESTABLE,
    block_interval,
    expanded_level,
    interval_verdict,
    paired_difference,
    satisfies,
    seed_estimate,
    study_claim,
)


def test_seed_estimate_is_scipy_expanded_percentile_bootstrap():
    rng = np.random.default_rng(0)
    for n in (3, 4, 5, 8):
        values = rng.normal(rng.uniform(-2, 2), rng.uniform(0.1, 3), n)
        state = int(rng.integers(1000))
        est = seed_estimate({s: v for s, v in enumerate(values)}, random_state=state)
        level = 1 - 2 * norm.sf(math.sqrt(n / (n - 1)) * t.ppf(0.975, n - 1))
        direct = bootstrap((values,), np.mean, n_resamples=9999, confidence_level=level, method="percentile",
                           random_state=state).confidence_interval
        assert est.mean == pytest.approx(values.mean(), rel=1e-12)
        assert (est.interval.low, est.interval.high) == pytest.approx((direct.low, direct.high), rel=1e-12)
        assert est.interval.resamples == 9999 and est.interval.level == 0.95 and est.interval.unit == "seeds"
        assert f"n = {n}" in est.interval.method and "expanded percentile" in est.interval.method


def test_expanded_level_widens_small_samples_and_tends_to_the_nominal_level():
    levels = [expanded_level(n) for n in (2, 3, 5, 10, 30, 1000)]
    assert all(a > b for a, b in zip(levels, levels[1:]))
    assert levels[2] == pytest.approx(0.99809, abs=1e-5)  # n = 5: z = sqrt(5/4) * 2.776 = 3.104
    assert 0.95 < levels[-1] < 0.951
    with pytest.raises(ValueError):
        expanded_level(1)


@pytest.mark.parametrize("n", [5, 8])
def test_interval_covers_the_planted_mean_in_at_least_90_percent_of_200_studies(n):
    rng = np.random.default_rng(10 + n)
    mean, sd = rng.uniform(0.3, 0.9), rng.uniform(0.01, 0.1)
    covered = 0
    for study in range(200):
        est = seed_estimate(dict(enumerate(rng.normal(mean, sd, n))), random_state=study)
        covered += est.interval.low <= mean <= est.interval.high
    assert covered / 200 >= 0.90, covered


def _verdicts(shift_in_se: float, holds_when: str, studies: int = 100, n: int = 5) -> dict[str, int]:
    rng = np.random.default_rng(int(abs(shift_in_se) * 7) + len(holds_when))
    threshold, sd = rng.uniform(-1, 1), rng.uniform(0.05, 0.5)
    counts = {HOLDS: 0, FAILS: 0, INCONCLUSIVE: 0}
    for study in range(studies):
        values = rng.normal(threshold + shift_in_se * sd / math.sqrt(n), sd, n)
        claim = study_claim("x", "planted", "v", "T", threshold, holds_when, dict(enumerate(values)), random_state=study)
        counts[claim.verdict] += 1
    return counts


@pytest.mark.parametrize("holds_when", [">", ">="])
def test_oracles_planted_effect_null_and_wrong_side(holds_when):
    effect = _verdicts(5.0, holds_when)
    assert effect[HOLDS] >= 95 and effect[FAILS] == 0, effect
    null = _verdicts(0.0, holds_when)
    assert null[INCONCLUSIVE] >= 85, null
    wrong = _verdicts(-5.0, holds_when)
    assert wrong[FAILS] >= 95 and wrong[HOLDS] == 0, wrong


def test_oracles_for_claims_that_hold_below_their_threshold():
    assert _verdicts(-5.0, "<")[HOLDS] >= 95
    assert _verdicts(5.0, "<=")[FAILS] >= 95
    assert _verdicts(0.0, "<")[INCONCLUSIVE] >= 85


def test_verdict_names_the_interval_and_the_threshold():
    claim = study_claim("003-b", "still trains", "ablate=attention", "gain", 0.1, ">=", {0: 0.3, 1: 0.32, 2: 0.35, 3: 0.31})
    assert claim.verdict == HOLDS and claim.runs_holding == 4 and claim.runs == 4
    lo, hi = claim.estimate.interval.low, claim.estimate.interval.high
    assert f"[{lo:.4g}, {hi:.4g}]" in claim.reason and "0.1" in claim.reason and "95%" in claim.reason
    mixed = study_claim("003-b", "still trains", "v", "gain", 0.1, ">=", {0: 0.05, 1: 0.3, 2: 0.02, 3: 0.4})
    assert mixed.verdict == INCONCLUSIVE and mixed.runs_holding == 2 and "contains the threshold 0.1" in mixed.reason


def test_too_few_seeds_and_missing_values():
    claim = study_claim("000-a", "c", "v", "T", 1.0, "<", {0: 0.5, 1: 0.6})
    assert claim.verdict == TOO_FEW and claim.estimate.interval is None and "2 < 3" in claim.reason
    nan = study_claim("000-a", "c", "v", "T", 1.0, "<", {0: 0.5, 1: float("nan"), 2: 0.6})
    assert nan.verdict == TOO_FEW and nan.runs == 2 and set(nan.estimate.values) == {"0", "2"}
    assert study_claim("000-a", "c", "v", "T", 1.0, "<", {}).verdict == UNTESTABLE


def test_identical_values_give_a_point_interval():
    est = seed_estimate({0: 0.7, 1: 0.7, 2: 0.7})
    assert est.interval.low == est.interval.high == pytest.approx(0.7)
    assert interval_verdict(est, 0.7, ">=")[0] == HOLDS and interval_verdict(est, 0.7, ">")[0] == FAILS


def test_satisfies():
    assert satisfies(1.0, "<=", 1.0) and not satisfies(1.0, "<", 1.0)
    assert satisfies(2.0, ">", 1.0) and satisfies(1.0, ">=", 1.0) and not satisfies(0.5, ">=", 1.0)
    assert not satisfies(float("nan"), "<", 1.0) and satisfies(float("-inf"), "<", 1.0)
    with pytest.raises(ValueError, match="holds_when"):
        satisfies(1.0, "=<", 1.0)


def test_paired_differences_are_per_seed_variant_minus_baseline():
    rng = np.random.default_rng(3)
    base = {s: rng.uniform(0.6, 0.9) for s in range(6)}
    variant = {s: base.get(s, 0.7) - 0.2 + rng.normal(0, 0.01) for s in range(1, 7)}  # seed 0 only in the baseline, 6 only here
    diff = paired_difference("best val balanced accuracy", "ablate=mlp", "ablate=none", variant, base)
    shared = range(1, 6)
    assert diff.estimate.values == pytest.approx({str(s): variant[s] - base[s] for s in shared})
    direct = seed_estimate({s: variant[s] - base[s] for s in shared})
    assert (diff.estimate.interval.low, diff.estimate.interval.high) == (direct.interval.low, direct.interval.high)
    assert diff.differs is True and diff.seeds_left_out == ["0", "6"] and diff.estimate.interval.unit == "seeds (paired)"
    same = paired_difference("m", "v", "b", {s: base[s] + rng.normal(0, 0.01) for s in base}, base)
    assert same.differs is False


def test_block_interval_matches_scipy_on_the_stratified_blocks():
    rng = np.random.default_rng(4)
    values = rng.normal(size=7)  # blocks 0-2: stage 0, blocks 3-6: stage 1

    def statistic(*parts):
        return values[np.concatenate(parts, axis=-1)].mean(axis=-1)

    got = block_interval(statistic, [3, 4], random_state=5)

    def direct_statistic(a, b, axis=-1):
        return np.concatenate([a, b], axis=-1).mean(axis=-1)

    direct = bootstrap((values[:3], values[3:]), direct_statistic, n_resamples=9999, method="BCa", random_state=5,
                       vectorized=True).confidence_interval
    assert (got.low, got.high) == pytest.approx((direct.low, direct.high), rel=1e-12)
    assert got.method == "BCa" and "stage" in got.unit
    # a stage of one block stays as it is: the interval is that of the other stage shifted by the fixed block
    fixed = block_interval(statistic, [1, 6], random_state=5)
    def with_block_0(a, axis=-1):  # (the same sums in the same order: BCa counts resamples equal to the estimate)
        return np.concatenate([np.broadcast_to(values[:1], (*a.shape[:-1], 1)), a], axis=-1).mean(axis=-1)

    alone = bootstrap((values[1:],), with_block_0, n_resamples=9999, method="BCa", random_state=5,
                      vectorized=True).confidence_interval
    assert (fixed.low, fixed.high) == pytest.approx((alone.low, alone.high), rel=1e-12)
    assert block_interval(statistic, [1, 1]) is None
