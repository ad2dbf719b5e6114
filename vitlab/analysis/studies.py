"""Statistics of a study (a grid of runs over seeds and variants): intervals, verdicts, paired differences.

Pure functions: numbers in, dataclasses out. A claim's statistic T (:class:`vitlab.analysis.claims.Claim`'s
``score``) is measured once per run; over a study the point estimate is the mean over seeds and its 95 %
interval a bootstrap over seeds (``scipy.stats.bootstrap``, a fixed ``random_state``, 9,999 resamples). The
verdict applies the claim's rule to the interval: **holds** when every value of the interval satisfies it,
**does not hold** when none does, **inconclusive** otherwise; with fewer than three seeds there is no interval.

Which bootstrap interval. At the few seeds a study has, the usual percentile and BCa intervals of a mean are
too narrow: they resample the seeds' own spread (the plug-in variance, 1/n instead of 1/(n - 1)) and use
normal quantiles instead of Student's t. On normal data at n = 5 a nominal 95 % BCa interval covers the mean
about 82 % of the time, and so does the percentile interval (``benchmarks/bench_study_intervals.py``). The
seed intervals here are therefore Hesterberg's *expanded percentile* intervals (Hesterberg 2015, "What
teachers should know about the bootstrap", The American Statistician 69(4)): the percentile interval of
``scipy.stats.bootstrap`` taken at the wider level 1 - 2 Phi(-sqrt(n / (n - 1)) t_{n-1, 0.975}), which
corrects both (about 90 % at n = 5, 94 % at n = 10, on normal data). At n = 3 every percentile interval is
the seeds' range (covering about 75 % of the time): three seeds support little (``docs/studies.md``). Within one run, intervals over blocks (:func:`block_interval`) use BCa where it is
defined, else the percentile interval, at 95 %.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

HOLDS, FAILS, UNTESTABLE = "holds", "does not hold", "not testable"  # as vitlab.analysis.claims
INCONCLUSIVE, TOO_FEW = "inconclusive", "too few seeds"
LEVEL = 0.95
RESAMPLES = 9999
MIN_SEEDS = 3
COMPARISONS = ("<", "<=", ">", ">=")

__all__ = [
    "Interval", "Estimate", "StudyClaim", "Difference", "satisfies", "expanded_level", "seed_estimate",
    "interval_verdict", "study_claim", "paired_difference", "block_interval",
]


@dataclass(frozen=True)
class Interval:
    """A bootstrap confidence interval: its bounds, the nominal level, how it was made and what was resampled."""

    low: float
    high: float
    level: float
    method: str
    unit: str
    resamples: int
    random_state: int

    def describe(self) -> str:
        return f"{self.level:.0%} CI [{self.low:.4g}, {self.high:.4g}]"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Estimate:
    """Per-seed ``values`` (seed -> value), their mean and the interval of the mean (None: too few seeds, ``note``)."""

    values: dict[str, float]
    mean: float
    interval: Interval | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "mean": self.mean, "interval": self.interval.to_dict() if self.interval else None,
                "note": self.note}


@dataclass(frozen=True)
class StudyClaim:
    """A claim over the seeds of one variant: the per-seed statistic, its estimate, the rule and the verdict."""

    id: str
    claim: str
    variant: str
    statistic: str
    threshold: float
    holds_when: str
    estimate: Estimate
    runs_holding: int
    runs: int
    verdict: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["estimate"] = self.estimate.to_dict()
        return out


@dataclass(frozen=True)
class Difference:
    """Paired differences ``variant - baseline`` of one metric over the seeds both have."""

    metric: str
    variant: str
    baseline: str
    estimate: Estimate
    differs: bool | None  # the interval excludes 0 (None: no interval)
    seeds_left_out: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["estimate"] = self.estimate.to_dict()
        return out


def satisfies(value: float, holds_when: str, threshold: float) -> bool:
    """Whether ``value`` is on the claim's side: ``value <holds_when> threshold`` (NaN never is)."""
    if holds_when not in COMPARISONS:
        raise ValueError(f"holds_when must be one of {COMPARISONS}, got {holds_when!r}")
    if math.isnan(value):
        return False
    return {"<": value < threshold, "<=": value <= threshold, ">": value > threshold, ">=": value >= threshold}[holds_when]


def expanded_level(n: int, level: float = LEVEL) -> float:
    """Hesterberg's expanded percentile level for a mean of ``n`` values: 1 - 2 Phi(-sqrt(n/(n-1)) t_{n-1, (1+level)/2})."""
    from scipy.stats import norm, t

    if n < 2:
        raise ValueError(f"expanded_level: need at least 2 values, got {n}")
    z = math.sqrt(n / (n - 1)) * float(t.ppf((1 + level) / 2, n - 1))
    return float(1 - 2 * norm.sf(z))


def seed_estimate(values: Mapping[Any, float], level: float = LEVEL, resamples: int = RESAMPLES, random_state: int = 0,
                  unit: str = "seeds") -> Estimate:
    """Mean of per-seed ``values`` and its expanded percentile bootstrap interval (see the module docstring).

    Non-finite values are left out (a run whose statistic is undefined). With fewer than :data:`MIN_SEEDS`
    values the estimate has no interval and says "too few seeds".
    """
    from scipy.stats import bootstrap

    kept = {str(k): float(v) for k, v in values.items() if math.isfinite(float(v))}
    data = np.array(list(kept.values()), dtype=np.float64)
    mean = float(data.mean()) if len(data) else float("nan")
    if len(data) < MIN_SEEDS:
        return Estimate(kept, mean, None, f"{TOO_FEW}: {len(data)} < {MIN_SEEDS}, no interval")
    wide = expanded_level(len(data), level)
    if np.ptp(data) == 0:  # all values equal: every resample is that value (scipy warns of a degenerate distribution)
        low = high = mean = float(data[0])
    else:
        ci = bootstrap((data,), np.mean, n_resamples=resamples, confidence_level=wide, method="percentile",
                       random_state=random_state, vectorized=True).confidence_interval
        low, high = float(ci.low), float(ci.high)
    method = f"expanded percentile (level {wide:.4g} for n = {len(data)})"
    return Estimate(kept, mean, Interval(low, high, level, method, unit, resamples, random_state))


def interval_verdict(estimate: Estimate, threshold: float, holds_when: str) -> tuple[str, str]:
    """(verdict, reason) of a claim ``T <holds_when> threshold`` on the interval of T's mean."""
    if not estimate.values:
        return UNTESTABLE, "no run gives this statistic"
    if estimate.interval is None:
        return TOO_FEW, f"{estimate.note}; mean {estimate.mean:.4g} vs threshold {threshold:g}"
    lo, hi = estimate.interval.low, estimate.interval.high
    inside = satisfies(lo, holds_when, threshold), satisfies(hi, holds_when, threshold)
    side = "below" if holds_when.startswith("<") else "above"
    other = "above" if side == "below" else "below"
    text = estimate.interval.describe()
    if all(inside):
        return HOLDS, f"{text} wholly {side} the threshold {threshold:g} (T {holds_when} {threshold:g})"
    if not any(inside):
        return FAILS, f"{text} wholly {other} the threshold {threshold:g} (the claim needs T {holds_when} {threshold:g})"
    return INCONCLUSIVE, f"{text} contains the threshold {threshold:g}"


def study_claim(id: str, claim: str, variant: str, statistic: str, threshold: float, holds_when: str,
                values: Mapping[Any, float], random_state: int = 0) -> StudyClaim:
    """A claim's verdict over seeds: ``values`` maps each seed to its run's statistic T."""
    estimate = seed_estimate(values, random_state=random_state)
    verdict, reason = interval_verdict(estimate, threshold, holds_when)
    holding = sum(satisfies(v, holds_when, threshold) for v in estimate.values.values())
    return StudyClaim(id, claim, variant, statistic, float(threshold), holds_when, estimate, holding,
                      len(estimate.values), verdict, reason)


def paired_difference(metric: str, variant: str, baseline: str, variant_values: Mapping[Any, float],
                      baseline_values: Mapping[Any, float], random_state: int = 0) -> Difference:
    """Per-seed differences ``variant - baseline`` over the seeds both have, their mean and interval."""
    v = {str(k): float(x) for k, x in variant_values.items()}
    b = {str(k): float(x) for k, x in baseline_values.items()}
    shared = [s for s in v if s in b]
    estimate = seed_estimate({s: v[s] - b[s] for s in shared}, random_state=random_state, unit="seeds (paired)")
    differs = None if estimate.interval is None else not (estimate.interval.low <= 0.0 <= estimate.interval.high)
    return Difference(metric, variant, baseline, estimate, differs, sorted(set(v) ^ set(b)))


def block_interval(statistic: Callable[..., np.ndarray], strata: Sequence[int], level: float = LEVEL,
                   resamples: int = RESAMPLES, random_state: int = 0,
                   unit: str = "blocks, resampled within each stage (rows kept whole)") -> Interval | None:
    """Bootstrap interval of a within-run statistic over blocks, resampled within strata (stages).

    Args:
        statistic: ``statistic(*indices)`` -> the statistic for blocks ``indices[s]`` (block indices of stratum
            ``s``, with repeats; leading axes are resamples: vectorised, shape (..., n_s) -> (...)).
        strata: The number of blocks of each stratum; a stratum of one block stays as it is.
        level, resamples, random_state: As ``scipy.stats.bootstrap``.

    Returns:
        BCa where it is defined, else the percentile interval; None when no stratum has two blocks.
    """
    from scipy.stats import bootstrap

    starts = np.cumsum([0, *strata])[:-1]
    groups = [np.arange(s, s + n) for s, n in zip(starts, strata)]
    varied = [i for i, g in enumerate(groups) if len(g) >= 2]
    if not varied:
        return None

    def resampled(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        batch = np.broadcast_shapes(*(s.shape[:-1] for s in samples))
        parts = [np.broadcast_to(g, (*batch, len(g))) for g in groups]
        for i, sample in zip(varied, samples):
            parts[i] = np.broadcast_to(sample, (*batch, sample.shape[-1]))
        return statistic(*parts)

    data = tuple(groups[i] for i in varied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("BCa", "percentile"):
            ci = bootstrap(data, resampled, n_resamples=resamples, confidence_level=level, method=method,
                           random_state=random_state, vectorized=True).confidence_interval
            if math.isfinite(ci.low) and math.isfinite(ci.high):
                return Interval(float(ci.low), float(ci.high), level, method, unit, resamples, random_state)
    return None
