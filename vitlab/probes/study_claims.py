"""``probe.py claims --study FOLDER``: the claims over a study's seeds and variants, the Attentionless table and the
study figures. Thin glue: runs are read through :class:`vitlab.study.runfolder.RunFolder`, each run's claims come
from ``probe.py claims``'s own per-run evaluation, the statistics from :mod:`vitlab.analysis.studies`, the figures
from :mod:`vitlab.outputs.study_figures`.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitlab.analysis import claims as C
from vitlab.analysis import studies as S
from vitlab.outputs.files import atomic_path, write_json
from vitlab.study.record import DONE, StudyFolder
from vitlab.study.runfolder import RunFolder

RUN_CLAIMS = ("000-a", "000-b", "000-c", "000-d", "002-a", "002-b", "002-c")  # statistics of one run's weights
ABLATION_CLAIMS = {"003-a": ("residual", C.claim_003a), "003-b": ("attention", C.claim_003b)}
ACC, AUROC = "best val balanced accuracy", "val AUROC at that epoch"
RunClaims = Callable[[Path], list[C.Claim]]  # a run folder -> its per-run claims (probe.py claims' own evaluation)


@dataclass
class CellResult:
    """What one finished cell contributes: its metrics, its curves and its own claims."""

    name: str
    seed: str
    variant: str
    run: Path
    removed: list[str]
    classes: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    best_epoch: int | None = None
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    claims: dict[str, C.Claim] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"cell": self.name, "seed": self.seed, "variant": self.variant, "run": str(self.run), "removed": self.removed,
                "classes": self.classes, "best_epoch": self.best_epoch, "metrics": self.metrics,
                "claims": {k: {"score": c.score, "threshold": c.threshold, "holds_when": c.holds_when, "verdict": c.verdict,
                               "interval": c.interval, "reason": c.reason} for k, c in self.claims.items()}}


def read_cell(folder: StudyFolder, cell: dict[str, Any], run_claims: RunClaims) -> CellResult:
    """A finished cell's metrics (best validation balanced accuracy, the AUROC of that epoch), curves and claims."""
    run = RunFolder(folder.path / cell["run"])
    result = CellResult(cell["name"], str(cell.get("seed")), cell["variant"], run.path, run.removed(), run.num_classes())
    for tag in run.scalar_tags():
        if tag.startswith("val/"):
            result.curves[tag] = run.epoch_curve(tag)
    accuracy = result.curves.get("val/balanced_acc", [])
    if accuracy:
        best = max(range(len(accuracy)), key=lambda i: (accuracy[i][1], -i))  # the first best epoch (as the checkpoint)
        result.best_epoch = accuracy[best][0]
        result.metrics[ACC] = accuracy[best][1]
        auroc = dict(result.curves.get("val/auroc", []))
        if result.best_epoch in auroc:
            result.metrics[AUROC] = auroc[result.best_epoch]
    try:
        result.claims = {c.id: c for c in run_claims(run.path) if c.id in RUN_CLAIMS}
    except (FileNotFoundError, ValueError) as err:
        result.claims = {k: C.untestable(k, "", str(err)) for k in RUN_CLAIMS}
    for claim_id, (component, claim_of) in ABLATION_CLAIMS.items():
        if component in result.removed and ACC in result.metrics and result.classes:
            result.claims[claim_id] = claim_of([(result.name, result.removed, result.metrics[ACC], result.classes)])
    return result


def _variants(cells: list[CellResult], record: dict[str, Any]) -> list[str]:
    order = list(dict.fromkeys(c["variant"] for c in record["cells"]))
    return [v for v in order if any(c.variant == v for c in cells)]


def aggregate(cells: list[CellResult], record: dict[str, Any], random_state: int = 0) -> dict[str, Any]:
    """Claims per variant over the seeds, paired differences against the baseline, and the Attentionless table."""
    variants = _variants(cells, record)
    claims: list[S.StudyClaim] = []
    untestable: list[dict[str, str]] = []
    for claim_id in (*RUN_CLAIMS, *ABLATION_CLAIMS):
        found = False
        for variant in variants:
            runs = [c.claims[claim_id] for c in cells if c.variant == variant and claim_id in c.claims]
            scored = [(c.seed, c.claims[claim_id]) for c in cells if c.variant == variant and claim_id in c.claims
                      and c.claims[claim_id].score is not None]
            if scored:
                first = scored[0][1]
                claims.append(S.study_claim(claim_id, first.claim, variant, first.statistic, first.threshold, first.holds_when,
                                            {seed: claim.score for seed, claim in scored}, random_state))
            elif runs:  # every run of this variant: not testable
                untestable.append({"id": claim_id, "variant": variant, "verdict": S.UNTESTABLE,
                                   "reason": "; ".join(sorted({r.reason for r in runs}))[:300]})
            found |= bool(runs)
        if not found:
            component = ABLATION_CLAIMS.get(claim_id, ("",))[0]
            reason = f"no variant removes {component} (add ablate={component} to the grid)" if component else "no finished run"
            untestable.append({"id": claim_id, "variant": "-", "verdict": S.UNTESTABLE, "reason": reason})
    baseline = record.get("baseline", variants[0] if variants else "-")
    table, differences = [], []
    for variant in variants:
        row = {"variant": variant}
        for metric in (ACC, AUROC):
            values = {c.seed: c.metrics[metric] for c in cells if c.variant == variant and metric in c.metrics}
            row[metric] = S.seed_estimate(values, random_state=random_state)
            if variant != baseline:
                base = {c.seed: c.metrics[metric] for c in cells if c.variant == baseline and metric in c.metrics}
                if base and values:
                    differences.append(S.paired_difference(metric, variant, baseline, values, base, random_state))
        table.append(row)
    return {"claims": claims, "untestable": untestable, "table": table, "differences": differences, "baseline": baseline}


# ---------------------------------------------------------------------------------------------------- report


def _interval(est: S.Estimate) -> str:
    return f"[{est.interval.low:.3g}, {est.interval.high:.3g}]" if est.interval else est.note or "-"


def _values(est: S.Estimate) -> str:
    return ", ".join(f"{v:.3g}" for v in est.values.values())


def markdown(header: dict[str, Any], report: dict[str, Any], cells: list[CellResult]) -> str:
    lines = ["# Claims over a study", ""] + [f"- **{k}**: {v}" for k, v in header.items()]
    lines += ["", "## Claims", "", "T is each run's statistic; the verdict applies the claim's rule to the interval of T's mean "
              "over the seeds (holds: the whole interval on the claim's side; does not hold: wholly on the other; "
              "inconclusive: it contains the threshold).", "",
              "| claim | variant | rule | T per seed | mean | 95 % interval | runs holding | verdict | why |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["claims"]:
        lines.append(f"| {c.id} | {c.variant} | T {c.holds_when} {c.threshold:g} | {_values(c.estimate)} | {c.estimate.mean:.4g} | "
                     f"{_interval(c.estimate)} | {c.runs_holding}/{c.runs} | **{c.verdict}** | {c.reason} |")
    for u in report["untestable"]:
        lines.append(f"| {u['id']} | {u['variant']} | - | - | - | - | - | **{u['verdict']}** | {u['reason']} |")
    lines += ["", "## The Attentionless table", "", "Best validation balanced accuracy and the validation AUROC of that "
              "epoch, per variant: mean [95 % interval] over the seeds (values per seed in claims.json).", "",
              f"| variant | seeds | {ACC} | {AUROC} |", "|---|---|---|---|"]
    for row in report["table"]:
        acc, auroc = row[ACC], row[AUROC]
        lines.append(f"| {row['variant']} | {len(acc.values)} | {acc.mean:.3f} {_interval(acc)} | {auroc.mean:.3f} {_interval(auroc)} |")
    lines += ["", f"## Paired differences (variant - {report['baseline']}, same seed)", "",
              "| variant | metric | difference per seed | mean | 95 % interval | differs from 0 |", "|---|---|---|---|---|---|"]
    for d in report["differences"]:
        differs = "-" if d.differs is None else ("yes" if d.differs else "no")
        lines.append(f"| {d.variant} | {d.metric} | {_values(d.estimate)} | {d.estimate.mean:+.3f} | {_interval(d.estimate)} | {differs} |")
    drift = [k for k in ("000-a", "000-b", "000-c") if any(k in c.claims and c.claims[k].interval for c in cells)]
    if drift:
        lines += ["", "## Within each run", "", "The drift claims pool many blocks: their T with a 95 % bootstrap interval "
                  "over blocks (resampled within each stage, rows kept whole; BCa where defined, else percentile).", "",
                  "| cell | " + " | ".join(drift) + " |", "|---|" + "---|" * len(drift)]
        for c in cells:
            parts = []
            for k in drift:
                claim = c.claims.get(k)
                iv = claim.interval if claim else None
                parts.append(f"{claim.score:.3g} [{iv['low']:.3g}, {iv['high']:.3g}]" if iv else (f"{claim.score:.3g}" if claim and claim.score is not None else "-"))
            lines.append(f"| {c.name} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def _save(ctx, fig, name: str, tag: str) -> Path:
    """A figure as ``<out>/<name>.png`` and as the TensorBoard image ``tag``."""
    from vitlab.outputs.tensorboard import write_png

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    png = buffer.getvalue()
    path = ctx.out / f"{name}.png"
    with atomic_path(path) as tmp:
        tmp.write_bytes(png)
    write_png(ctx.writer, tag, png, 0)
    return path


def figures(ctx, report: dict[str, Any], cells: list[CellResult], title: str) -> list[Path]:
    from vitlab.outputs.study_figures import Row, curves_figure, forest_figure, table_figure

    written = []
    by_id: dict[str, dict[str, Any]] = {}
    for c in report["claims"]:
        entry = by_id.setdefault(c.id, {"id": c.id, "claim": c.claim, "statistic": c.statistic, "threshold": c.threshold,
                                        "holds_when": c.holds_when, "rows": []})
        iv = c.estimate.interval
        entry["rows"].append(Row(c.variant, list(c.estimate.values.values()), c.estimate.mean, iv.low if iv else None,
                                 iv.high if iv else None, c.verdict, f"{c.runs_holding}/{c.runs} runs"))
    if by_id:
        written.append(_save(ctx, forest_figure(list(by_id.values()), title), "forest", "study/claims_forest"))
    rows = {}
    for metric in (ACC, AUROC):
        rows[metric] = [Row(r["variant"], list(r[metric].values.values()), r[metric].mean,
                            r[metric].interval.low if r[metric].interval else None,
                            r[metric].interval.high if r[metric].interval else None) for r in report["table"] if r[metric].values]
    classes = {c.classes for c in cells if c.classes}
    references = {ACC: 1.0 / classes.pop(), AUROC: 0.5} if len(classes) == 1 else {AUROC: 0.5}
    if any(rows.values()):
        seeds = len({c.seed for c in cells})
        written.append(_save(ctx, table_figure({k: v for k, v in rows.items() if v}, references, seeds,
                                               f"{title}: the Attentionless table"), "attentionless_table", "study/attentionless_table"))
    metrics = sorted({tag for c in cells for tag in c.curves})
    for metric in metrics:
        curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
        for c in cells:
            if c.curves.get(metric):
                curves.setdefault(c.variant, {})[c.seed] = c.curves[metric]
        safe = metric.replace("/", "_")
        written.append(_save(ctx, curves_figure(metric, curves, title), f"curves_{safe}", f"study/curves/{metric}"))
    return written


def run(ctx, run_claims: RunClaims) -> None:
    """Read every finished cell of ``ctx.args.study``, aggregate, write claims.md / claims.json and the figures."""
    folder = StudyFolder(ctx.args.study)
    record = folder.load()
    finished = [c for c in record["cells"] if folder.status(c["name"]) == DONE]
    if not finished:
        raise ValueError(f"{folder.path}: no finished cell yet (rerun the study command to run them)")
    unfinished = [c["name"] for c in record["cells"] if c not in finished]
    cells = []
    for i, cell in enumerate(finished):
        print(f"probe.py claims: [{i + 1}/{len(finished)}] {cell['name']}", file=sys.stderr)
        cells.append(read_cell(folder, cell, run_claims))
    report = aggregate(cells, record, ctx.args.seed)
    grid = " x ".join(f"{a['key']}={','.join(a['values'])}" for a in record["grid"])
    header = {"study": str(folder.path), "grid": grid, "baseline": report["baseline"],
              "finished cells": f"{len(finished)}/{len(record['cells'])}" + (f" (not finished: {', '.join(unfinished)})" if unfinished else ""),
              "intervals over seeds": f"expanded percentile bootstrap of the mean (scipy.stats.bootstrap, {S.RESAMPLES} resamples, "
                                      f"random_state {ctx.args.seed}; fewer than {S.MIN_SEEDS} seeds: no interval)"}
    (ctx.out / "claims.md").write_text(markdown(header, report, cells))
    write_json(ctx.out / "claims.json", {
        "header": header, "cells": [c.to_dict() for c in cells], "claims": [c.to_dict() for c in report["claims"]],
        "untestable": report["untestable"], "differences": [d.to_dict() for d in report["differences"]],
        "table": [{"variant": r["variant"], **{m: r[m].to_dict() for m in (ACC, AUROC)}} for r in report["table"]]})
    figures(ctx, report, cells, f"study {folder.path.name}")
    for c in report["claims"]:
        print(f"{c.id:6s} {c.variant:24s} {c.verdict:14s} {c.reason}")
    for u in report["untestable"]:
        print(f"{u['id']:6s} {u['variant']:24s} {u['verdict']:14s} {u['reason']}")
