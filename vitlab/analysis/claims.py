"""The papers' claims (docs/probes.md) as statistics with verdict rules: numbers in, :class:`Claim` out.

Every function is pure: it takes per-row drift tensors (``row_drift`` outputs keyed by (block, matrix)),
per-block spectral scalars or accuracies, and returns the measured value, the comparison the claim makes,
its threshold and a verdict ``holds`` / ``does not hold`` / ``not testable`` (with the reason).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

HOLDS, FAILS, UNTESTABLE = "holds", "does not hold", "not testable"
MATRICES = ("q", "k", "v")
Rows = Mapping[tuple[str, str], Mapping[str, Tensor]]  # (block, "q"|"k"|"v") -> row_drift(...) output


@dataclass
class Claim:
    """One claim's verdict: ``id`` (e.g. ``000-a``), the claim, the statistic measured, its value(s),
    the comparison / threshold the verdict applies, the verdict and why."""

    id: str
    claim: str
    statistic: str
    comparison: str
    verdict: str
    value: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def untestable(id: str, claim: str, reason: str) -> Claim:
    return Claim(id, claim, "-", "-", UNTESTABLE, {}, reason)


def _stage(block: str) -> str:
    return block.split(".", 1)[0]


def _matrix_means(rows: Rows, metric: str, blocks: Sequence[str] | None = None) -> dict[str, float]:
    """Mean over the given blocks (default all) and their rows of ``metric``, per matrix (mean of block means)."""
    out = {}
    for m in MATRICES:
        vals = [float(r[metric].double().mean()) for (b, mm), r in rows.items() if mm == m and (blocks is None or b in blocks)]
        out[m] = sum(vals) / len(vals)
    return out


def _check_rows(rows: Rows) -> None:
    if not rows:
        raise ValueError("claims: no per-row drift given (need (block, q|k|v) -> row_drift output)")
    for (block, m), r in rows.items():
        if m not in MATRICES:
            raise ValueError(f"claims: matrix {m!r} of block {block!r} is not one of q, k, v")


def claim_000a(rows: Rows) -> Claim:
    """000-a: in every stage, mean MSE drift and mean Euclidean drift are lower for V than for Q and for K."""
    _check_rows(rows)
    text = "MSE and Euclidean drift are smallest in V, in every stage"
    stages = sorted({_stage(b) for b, _ in rows})
    value, ok = {}, True
    for stage in stages:
        blocks = [b for b, _ in rows if _stage(b) == stage]
        for metric in ("mse", "euclidean"):
            means = _matrix_means(rows, metric, blocks)
            value[f"{stage}.{metric}"] = means
            ok &= means["v"] < means["q"] and means["v"] < means["k"]
    return Claim("000-a", text, "mean over blocks and rows of MSE / Euclidean drift, per stage and Q/K/V",
                 "V < Q and V < K for both metrics in every stage", HOLDS if ok else FAILS, value,
                 f"{len(stages)} stage(s)")


def claim_000b(rows: Rows) -> Claim:
    """000-b: the mean dot product reference·current row is lower for V than for Q and K (‖v‖ shown beside)."""
    _check_rows(rows)
    dots = _matrix_means(rows, "dot")
    norms = _matrix_means(rows, "cur_norm")
    ok = dots["v"] < dots["q"] and dots["v"] < dots["k"]
    return Claim("000-b", "dot product (reference row . current row) decreases in V",
                 "mean over blocks and rows of the dot product, per Q/K/V (current row norm shown)",
                 "dot(V) < dot(Q) and dot(V) < dot(K)", HOLDS if ok else FAILS,
                 {"dot": dots, "row_norm": norms})


def relative_spread(values: Sequence[float]) -> float:
    """Population standard deviation of ``values`` over their mean (0 when all equal; inf when the mean is 0)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    mean = float(t.mean())
    std = float(t.std(unbiased=False))
    return std / abs(mean) if mean != 0 else (0.0 if std == 0 else float("inf"))


def claim_000c(rows: Rows) -> Claim:
    """000-c: cosine drift changes least: its Q/K/V spread relative to its mean is below Euclidean's and MSE's."""
    _check_rows(rows)
    spreads = {metric: relative_spread(list(_matrix_means(rows, metric).values())) for metric in ("cosine_distance", "euclidean", "mse")}
    ok = spreads["cosine_distance"] < spreads["euclidean"] and spreads["cosine_distance"] < spreads["mse"]
    return Claim("000-c", "cosine drift changes least globally",
                 "std/mean over Q, K, V of each metric's global mean drift",
                 "spread(cosine) < spread(Euclidean) and < spread(MSE)", HOLDS if ok else FAILS,
                 {"relative_spread": spreads})


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
    ok = significant >= tested / 2
    return Claim("000-d", text, f"between-head share of per-row {metric} drift variance vs rows shuffled across heads ({permutations} permutations)",
                 f"p < {alpha} in at least half of the (block, matrix) pairs", HOLDS if ok else FAILS,
                 {"significant": significant, "tested": tested, "pairs": per_pair})


def claim_002a(positive_mass_summed: Mapping[str, float], positive_mass_head_mean: Mapping[str, float], threshold: float = 0.5) -> Claim:
    """002-a: positive mass of M_sym (head-summed M of each block) > 0.5 in every block; per-head mean shown."""
    if not positive_mass_summed:
        return untestable("002-a", "M_sym is largely positive definite in every layer", "no blocks")
    ok = all(v > threshold for v in positive_mass_summed.values())
    return Claim("002-a", "M_sym is largely positive definite in every layer",
                 "positive mass rho+ of the symmetric part's eigenvalues, head-summed M per block (per-head mean shown)",
                 f"rho+ > {threshold} in every block", HOLDS if ok else FAILS,
                 {"head_summed": dict(positive_mass_summed), "head_mean": dict(positive_mass_head_mean)})


def claim_002b(symmetry: Mapping[str, float]) -> Claim:
    """002-b: symmetry score (blocks in depth order) of the last third < first third, and < 0 in the last block."""
    text = "the antisymmetric part dominates in later layers"
    blocks = list(symmetry)
    if len(blocks) < 3:
        return untestable("002-b", text, f"{len(blocks)} block(s): first and last thirds need at least 3")
    third = len(blocks) // 3
    first = sum(symmetry[b] for b in blocks[:third]) / third
    last = sum(symmetry[b] for b in blocks[-third:]) / third
    final = symmetry[blocks[-1]]
    ok = last < first and final < 0
    return Claim("002-b", text, "symmetry score of the head-summed M, mean over the first / last third of blocks",
                 "last third < first third and last block < 0", HOLDS if ok else FAILS,
                 {"first_third": first, "last_third": last, "last_block": final, "per_block": dict(symmetry)})


def claim_002c(effective_rank: Mapping[str, float], widths: Mapping[str, int] | None = None) -> Claim:
    """002-c: the last block's effective rank of M is below the median of the other blocks.

    ``widths`` (block -> embedding width): when blocks differ in width (Swin stages), each effective rank is
    divided by its block's width, so wider stages are not penalised for having more dimensions.
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
    return Claim("002-c", text, statistic,
                 "last block < median of the other blocks", HOLDS if last < others else FAILS,
                 {"last_block": last, "median_others": others, "per_block": dict(effective_rank)})


def _ablation_claim(id: str, text: str, removed: str, runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float, trains: bool) -> Claim:
    matching = [(name, acc, n) for name, removes, acc, n in runs if removed in removes]
    if not matching:
        return untestable(id, text, f"no ablation run without {removed} given (train configs/ablation_{removed}.yaml, pass --ablation-run)")
    value, ok = {}, True
    for name, acc, n_classes in matching:
        chance = 1.0 / n_classes
        value[name] = {"best_val_balanced_acc": acc, "chance": chance}
        ok &= acc >= chance + margin if trains else acc <= chance + margin
    cmp = f">= chance + {margin}" if trains else f"<= chance + {margin}"
    return Claim(id, text, f"best validation balanced accuracy of the run(s) without {removed}", f"best {cmp}", HOLDS if ok else FAILS, value)


def claim_003a(runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float = 0.05) -> Claim:
    """003-a: without residuals the model does not train: best val balanced accuracy <= chance + 0.05.

    ``runs``: (name, removed components, best val balanced accuracy, number of classes) per ablation run.
    """
    return _ablation_claim("003-a", "no residual connections => the model does not train", "residual", runs, margin, trains=False)


def claim_003b(runs: Sequence[tuple[str, Sequence[str], float, int]], margin: float = 0.10) -> Claim:
    """003-b: without attention it still trains: best val balanced accuracy >= chance + 0.10."""
    return _ablation_claim("003-b", "no attention => the model still trains", "attention", runs, margin, trains=True)
