"""The papers' claims (the Drotos poster, Philip et al., the Attentionless article; docs/probes.md) as statistics
with verdict rules: numbers in, :class:`Claim` out.

Every function is pure: it takes per-row drift tensors (``row_drift`` outputs keyed by (block, matrix)),
per-block spectral scalars or accuracies, and returns the measured value, the comparison the claim makes,
its threshold and a verdict ``holds`` / ``does not hold`` / ``not testable`` (with the reason). Each claim is
also one number T with a rule ``T < c`` (or ``<=``, ``>``, ``>=``), the verdict being that rule applied to T:
a study averages T over seeds and puts an interval on it (:mod:`vitlab.analysis.studies`). The drift claims
pool many blocks and also carry a within-run interval of T, blocks resampled within each stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from vitlab.analysis.studies import FAILS, HOLDS, UNTESTABLE, block_interval, satisfies

MATRICES = ("q", "k", "v")
Rows = Mapping[tuple[str, str], Mapping[str, Tensor]]  # (block, "q"|"k"|"v") -> row_drift(...) output


@dataclass
class Claim:
    """One claim's verdict: ``id`` (e.g. ``000-a``), the claim, the statistic measured, its value(s),
    the comparison / threshold the verdict applies, the verdict and why.

    ``score`` is the claim as one number T with the rule ``T <holds_when> threshold`` (the verdict is that rule
    applied to it), so that a study can average T over seeds and put an interval on it
    (:mod:`vitlab.analysis.studies`). ``interval``: a within-run bootstrap interval of T over blocks, when the
    claim pools many blocks (the drift claims).
    """

    id: str
    claim: str
    statistic: str
    comparison: str
    verdict: str
    value: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    score: float | None = None
    threshold: float | None = None
    holds_when: str | None = None
    interval: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def untestable(id: str, claim: str, reason: str) -> Claim:
    return Claim(id, claim, "-", "-", UNTESTABLE, {}, reason)


def _scored(id: str, claim: str, statistic: str, comparison: str, value: dict[str, Any], score: float, threshold: float,
            holds_when: str, reason: str = "", interval: dict[str, Any] | None = None) -> Claim:
    """A claim whose verdict is its rule applied to ``score``."""
    verdict = HOLDS if satisfies(score, holds_when, threshold) else FAILS
    return Claim(id, claim, statistic, comparison, verdict, value, reason, float(score), float(threshold), holds_when, interval)


def _stage(block: str) -> str:
    return block.split(".", 1)[0]


def _check_rows(rows: Rows) -> None:
    if not rows:
        raise ValueError("claims: no per-row drift given (need (block, q|k|v) -> row_drift output)")
    for (block, m), r in rows.items():
        if m not in MATRICES:
            raise ValueError(f"claims: matrix {m!r} of block {block!r} is not one of q, k, v")


def weights_unchanged(rows: Rows) -> bool:
    """Whether no Q/K/V row moved at all (an ablated branch gets no gradient): drift claims have nothing to compare."""
    moved = [float(r["euclidean"].abs().max()) for r in rows.values() if "euclidean" in r]
    return bool(moved) and max(moved) == 0.0


NO_DRIFT = "no Q/K/V row moved (the weights did not change, e.g. an ablated branch gets no gradient)"


def _block_means(rows: Rows, metrics: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """(blocks in order, (blocks, 3, metrics) float64 array of each block's mean over rows per Q/K/V and metric)."""
    blocks = list(dict.fromkeys(b for b, _ in rows))
    missing = [f"{b}.{m}" for b in blocks for m in MATRICES if (b, m) not in rows]
    if missing:
        raise ValueError(f"claims: per-row drift missing for {', '.join(missing[:4])}")
    means = np.array([[[float(rows[(b, m)][metric].double().mean()) for metric in metrics] for m in MATRICES] for b in blocks])
    return blocks, means  # (B, 3, M)


def _strata(blocks: Sequence[str]) -> list[np.ndarray]:
    """Block indices of each stage, stages in order of first appearance."""
    stages = list(dict.fromkeys(_stage(b) for b in blocks))
    return [np.array([i for i, b in enumerate(blocks) if _stage(b) == s]) for s in stages]


def _pooled(means: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over the blocks of all ``parts`` (indices, (..., n_s) each) -> (..., 3, M)."""
    return means[np.concatenate(parts, axis=-1)].mean(axis=-3)


def _within_run(statistic, strata: Sequence[np.ndarray], seed: int) -> dict[str, Any] | None:
    """The block bootstrap interval of a drift claim's statistic (None: no stage has two blocks)."""
    interval = block_interval(statistic, [len(s) for s in strata], random_state=seed)
    return interval.to_dict() if interval else None


def _ratio_v_to_qk(means: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """000-a's T for blocks ``parts`` (one index array per stage): max over stages and metrics of V / min(Q, K)."""
    ratios = []
    for idx in parts:
        m = means[idx].mean(axis=-3)  # (..., 3, M)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios.append(m[..., 2, :] / np.minimum(m[..., 0, :], m[..., 1, :]))  # (..., M)
    return np.max(np.stack(ratios, axis=-1), axis=(-2, -1))


def claim_000a(rows: Rows, seed: int = 0) -> Claim:
    """000-a: in every stage, mean MSE drift and mean Euclidean drift are lower for V than for Q and for K.

    T = max over stages and the two metrics of mean(V) / min(mean(Q), mean(K)); holds when T < 1.
    """
    _check_rows(rows)
    text = "MSE and Euclidean drift are smallest in V, in every stage"
    if weights_unchanged(rows):
        return untestable("000-a", text, NO_DRIFT)
    metrics = ("mse", "euclidean")
    blocks, means = _block_means(rows, metrics)
    strata = _strata(blocks)
    value = {}
    for stage, idx in zip(dict.fromkeys(_stage(b) for b in blocks), strata):
        for j, metric in enumerate(metrics):
            value[f"{stage}.{metric}"] = dict(zip(MATRICES, means[idx, :, j].mean(axis=0).tolist()))
    score = float(_ratio_v_to_qk(means, strata))
    if np.isnan(score):
        return untestable("000-a", text, "no drift in V, nor in the smaller of Q and K")
    return _scored("000-a", text, "max over stages and MSE / Euclidean of mean V drift / min(mean Q, mean K drift)",
                   "V < Q and V < K for both metrics in every stage (T < 1)", value, score, 1.0, "<",
                   f"{len(strata)} stage(s)", _within_run(lambda *p: _ratio_v_to_qk(means, p), strata, seed))


def claim_000b(rows: Rows, seed: int = 0) -> Claim:
    """000-b: the mean dot product reference·current row is lower for V than for Q and K (‖v‖ shown beside).

    T = dot(V) - min(dot(Q), dot(K)) (means over blocks and rows); holds when T < 0.
    """
    _check_rows(rows)
    if weights_unchanged(rows):
        return untestable("000-b", "dot product (reference row . current row) decreases in V", NO_DRIFT)
    blocks, means = _block_means(rows, ("dot", "cur_norm"))
    strata = _strata(blocks)
    dots, norms = means[..., 0].mean(axis=0), means[..., 1].mean(axis=0)  # (3,)

    def statistic(*parts: np.ndarray) -> np.ndarray:
        d = _pooled(means, parts)[..., 0]  # (..., 3)
        return d[..., 2] - np.minimum(d[..., 0], d[..., 1])

    return _scored("000-b", "dot product (reference row . current row) decreases in V",
                   "mean over blocks and rows of the dot product, V minus the smaller of Q and K (current row norm shown)",
                   "dot(V) < dot(Q) and dot(V) < dot(K) (T < 0)", {"dot": dict(zip(MATRICES, dots.tolist())),
                   "row_norm": dict(zip(MATRICES, norms.tolist()))}, float(statistic(*strata)), 0.0, "<",
                   interval=_within_run(statistic, strata, seed))


def _spread(a: np.ndarray) -> np.ndarray:
    """Population standard deviation over the last axis / |mean| (0 when all equal; inf when the mean is 0)."""
    mean, std = a.mean(axis=-1), a.std(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean != 0, std / np.abs(mean), np.where(std == 0, 0.0, np.inf))


def relative_spread(values: Sequence[float]) -> float:
    """Population standard deviation of ``values`` over their mean (0 when all equal; inf when the mean is 0)."""
    return float(_spread(np.asarray(list(values), dtype=np.float64)))


def claim_000c(rows: Rows, seed: int = 0) -> Claim:
    """000-c: cosine drift changes least: its Q/K/V spread relative to its mean is below Euclidean's and MSE's.

    T = spread(cosine) - min(spread(Euclidean), spread(MSE)); holds when T < 0.
    """
    _check_rows(rows)
    if weights_unchanged(rows):
        return untestable("000-c", "cosine drift changes least globally", NO_DRIFT)
    metrics = ("cosine_distance", "euclidean", "mse")
    blocks, means = _block_means(rows, metrics)
    strata = _strata(blocks)

    def statistic(*parts: np.ndarray) -> np.ndarray:
        s = _spread(np.swapaxes(_pooled(means, parts), -1, -2))  # (..., M) over Q, K, V
        return s[..., 0] - np.minimum(s[..., 1], s[..., 2])

    spreads = _spread(means.mean(axis=0).T)  # (M,)
    return _scored("000-c", "cosine drift changes least globally",
                   "std/mean over Q, K, V of each metric's global mean drift: cosine minus the smaller of Euclidean and MSE",
                   "spread(cosine) < spread(Euclidean) and < spread(MSE) (T < 0)",
                   {"relative_spread": dict(zip(metrics, spreads.tolist()))}, float(statistic(*strata)), 0.0, "<",
                   interval=_within_run(statistic, strata, seed))


def between_head_share(values: Tensor, num_heads: int) -> float:
    """Share of the variance of per-row ``values`` (rows ordered head by head) that lies between heads."""
    v = values.double().reshape(num_heads, -1)
    total = float(((v - v.mean()) ** 2).sum())
    between = float(v.shape[1] * ((v.mean(dim=1) - v.mean()) ** 2).sum())
    return between / total if total > 0 else 0.0


def head_cluster_test(values: Tensor, num_heads: int, permutations: int = 999, generator: torch.Generator | None = None) -> tuple[float, float]:
    """(between-head variance share, permutation p-value) with rows shuffled across heads as the null.

    p = (1 + #{null share >= observed}) / (1 + permutations).
    """
    if values.ndim != 1 or values.numel() % num_heads:
        raise ValueError(f"head_cluster_test: {values.numel()} rows do not split into {num_heads} heads")
    observed = between_head_share(values, num_heads)
    v = values.double()
    perms = torch.argsort(torch.rand(permutations, v.numel(), generator=generator), dim=1)  # (P, R)
    shuffled = v[perms].reshape(permutations, num_heads, -1)  # (P, H, R/H)
    grand = v.mean()
    total = float(((v - grand) ** 2).sum())
    between = shuffled.shape[2] * ((shuffled.mean(dim=2) - grand) ** 2).sum(dim=1)  # (P,)
    null = between / total if total > 0 else torch.zeros(permutations, dtype=torch.float64)
    p = (1 + int((null >= observed - 1e-12).sum())) / (1 + permutations)
    return observed, p


def claim_000d(rows: Rows, heads: Mapping[str, int], metric: str = "euclidean", alpha: float = 0.01,
               permutations: int = 999, seed: int = 0) -> Claim:
    """000-d: per-row drift clusters by head: between-head variance share beats its permutation null at p < alpha
    in at least half of the (block, matrix) pairs (each pair reported)."""
    _check_rows(rows)
    text = "local clusters within sub-matrices (drift differs between heads)"
    if all(heads.get(b, 1) < 2 for b, _ in rows):
        return untestable("000-d", text, "every block has one head: no between-head structure to test")
    if weights_unchanged(rows):
        return untestable("000-d", text, NO_DRIFT)
    gen = torch.Generator().manual_seed(seed)
    per_pair, significant, tested = {}, 0, 0
    for (block, m), r in rows.items():
        h = heads.get(block, 1)
        if h < 2:
            continue
        share, p = head_cluster_test(r[metric], h, permutations, gen)
        per_pair[f"{block}.{m}"] = {"between_head_share": share, "p": p}
        tested += 1
        significant += p < alpha
    return _scored("000-d", text, f"share of (block, matrix) pairs whose between-head share of per-row {metric} drift "
                   f"variance beats rows shuffled across heads ({permutations} permutations) at p < {alpha}",
                   f"p < {alpha} in at least half of the (block, matrix) pairs (T >= 0.5)",
                   {"significant": significant, "tested": tested, "pairs": per_pair}, significant / tested, 0.5, ">=")


def claim_002a(positive_mass_summed: Mapping[str, float], positive_mass_head_mean: Mapping[str, float], threshold: float = 0.5) -> Claim:
    """002-a: positive mass of M_sym (head-summed M of each block) > 0.5 in every block; per-head mean shown.

    T = the smallest block's positive mass; holds when T > 0.5.
    """
    if not positive_mass_summed:
        return untestable("002-a", "M_sym is largely positive definite in every layer", "no blocks")
    return _scored("002-a", "M_sym is largely positive definite in every layer",
                   "smallest over blocks of the positive mass rho+ of the symmetric part's eigenvalues, head-summed M "
                   "(per-head mean shown)", f"rho+ > {threshold} in every block (T > {threshold})",
                   {"head_summed": dict(positive_mass_summed), "head_mean": dict(positive_mass_head_mean)},
                   min(positive_mass_summed.values()), threshold, ">")


def claim_002b(symmetry: Mapping[str, float]) -> Claim:
    """002-b: symmetry score (blocks in depth order) of the last third < first third, and < 0 in the last block.

    T = max(last third - first third, last block); holds when T < 0.
    """
    text = "the antisymmetric part dominates in later layers"
    blocks = list(symmetry)
    if len(blocks) < 3:
        return untestable("002-b", text, f"{len(blocks)} block(s): first and last thirds need at least 3")
    third = len(blocks) // 3
    first = sum(symmetry[b] for b in blocks[:third]) / third
    last = sum(symmetry[b] for b in blocks[-third:]) / third
    final = symmetry[blocks[-1]]
    return _scored("002-b", text, "symmetry score of the head-summed M: the larger of (last third - first third of "
                   "blocks, means) and the last block's", "last third < first third and last block < 0 (T < 0)",
                   {"first_third": first, "last_third": last, "last_block": final, "per_block": dict(symmetry)},
                   max(last - first, final), 0.0, "<")


def claim_002c(effective_rank: Mapping[str, float], widths: Mapping[str, int] | None = None) -> Claim:
    """002-c: the last block's effective rank of M is below the median of the other blocks.

    ``widths`` (block -> embedding width): when blocks differ in width (Swin stages), each effective rank is
    divided by its block's width, so wider stages are not penalised for having more dimensions.
    T = last block - median of the others; holds when T < 0.
    """
    text = "the last layer has dominating principal singular values"
    blocks = list(effective_rank)
    if len(blocks) < 2:
        return untestable("002-c", text, "one block: nothing to compare the last block with")
    statistic = "effective rank of the head-summed M per block"
    if widths and len({widths[b] for b in blocks}) > 1:
        effective_rank = {b: effective_rank[b] / widths[b] for b in blocks}
        statistic += " / block width (blocks differ in width)"
    others = median(effective_rank[b] for b in blocks[:-1])
    last = effective_rank[blocks[-1]]
    return _scored("002-c", text, statistic + ": last block minus the median of the others",
                   "last block < median of the other blocks (T < 0)",
                   {"last_block": last, "median_others": others, "per_block": dict(effective_rank)}, last - others, 0.0, "<")


def _ablation_claim(id: str, text: str, removed: str, runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float, trains: bool) -> Claim:
    matching = [(name, acc, n) for name, removes, acc, n in runs if removed in removes]
    if not matching:
        return untestable(id, text, f"no ablation run without {removed} given (train configs/ablation_{removed}.yaml, pass --ablation-run)")
    value = {name: {"best_val_balanced_acc": acc, "chance": 1.0 / n} for name, acc, n in matching}
    gains = [round(acc - 1.0 / n, 12) for _, acc, n in matching]  # 0.55 - 0.5 is 0.050000000000000044 unrounded
    holds_when = ">=" if trains else "<="
    return _scored(id, text, f"best validation balanced accuracy minus chance (1 / classes) of the run(s) without {removed}"
                   f" ({'the smallest' if trains else 'the largest'} when several)",
                   f"best {holds_when} chance + {margin} (T {holds_when} {margin})", value,
                   min(gains) if trains else max(gains), margin, holds_when)


def claim_003a(runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float = 0.05) -> Claim:
    """003-a: without residuals the model does not train: best val balanced accuracy <= chance + 0.05.

    ``runs``: (name, removed components, best val balanced accuracy, number of classes) per ablation run.
    """
    return _ablation_claim("003-a", "no residual connections => the model does not train", "residual", runs, margin, trains=False)


def claim_003b(runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float = 0.10) -> Claim:
    """003-b: without attention it still trains: best val balanced accuracy >= chance + 0.10."""
    return _ablation_claim("003-b", "no attention => the model still trains", "attention", runs, margin, trains=True)
