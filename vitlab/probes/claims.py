"""probe.py claims: which of the papers' claims hold on a finished run, or over a study's seeds and variants.

Thin glue over :mod:`vitlab.analysis.claims` (one run) and :mod:`vitlab.probes.study_claims` (a study)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from vitlab.analysis import claims as C
from vitlab.qkv.state import load_snapshot
from vitlab.analysis import drift_tables
from vitlab.analysis import block_spectra
from vitlab.outputs.files import write_json
from vitlab.probes import study_claims
from vitlab.solver_pool import SolverPool
from vitlab.study.runfolder import RunFolder

HELP = """Report which claims of the Drotos poster, Philip et al. and the Attentionless article hold on a finished run: claims.md + claims.json.

Reads the run's Q/K/V snapshots (qkv/epoch_*.safetensors: the first vs the last epoch for drift, the last one for
the QK spectra), and for the Attentionless article the best val/balanced_acc of ablation runs (their event files and config.yaml).
With --reference RUN_A --finetuned RUN_B it compares RUN_A's last snapshot (e.g. a DINO pretraining) with RUN_B's
last snapshot; each of them may also be a snapshot file. With --study (a folder of train.py --study) each claim is
taken over the seeds of every variant: the mean, a 95 % bootstrap interval and a verdict on the interval, with the
Attentionless table, paired differences against the baseline and figures (default output: STUDY/claims).

example:
  python probe.py claims --run runs/quickstart/version_0
  python probe.py claims --run runs/quickstart/version_0 --ablation-run runs/ablation_attention/version_0
  python probe.py claims --study runs/attentionless
"""
LOADS_MODEL = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("runs")
    src.add_argument("--run", type=Path, default=None, help="a run folder runs/<name>/<version> (its first vs last snapshot)")
    src.add_argument("--reference", type=Path, default=None, help="with --finetuned: the run (or snapshot) before fine-tuning")
    src.add_argument("--finetuned", type=Path, default=None, help="with --reference: the run (or snapshot) after fine-tuning")
    src.add_argument("--ablation-run", type=Path, action="append", default=[], help="an ablation run folder (repeatable) for the Attentionless article claims")
    src.add_argument("--study", type=Path, default=None, help="a study folder (train.py --study): the claims over its seeds and variants")
    src.add_argument("--permutations", type=int, default=999, help="permutations of the 000-d head-cluster null (default 999)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="output folder (default runs/probe-claims-<run name>/)")
    out.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    out.add_argument("--seed", type=int, default=0, help="seed of the permutation nulls and random_state of the bootstrap intervals")
    out.add_argument("--device", default="cpu")


def fill_defaults(args: argparse.Namespace) -> None:
    """--study: the report goes into STUDY/claims unless --out says otherwise."""
    if args.study is not None:
        if args.run or args.reference or args.finetuned or args.ablation_run:
            raise ValueError("probe.py claims: --study reads the runs of the study; give it alone (no --run, --reference, "
                             "--finetuned, --ablation-run)")
        if not (args.study / "study.json").is_file():
            raise FileNotFoundError(f"--study {args.study}: no study.json (a study folder is made by train.py --config CONFIG "
                                    "--study KEY=V1,V2 ...)")
        if args.out is None:
            args.out = args.study / "claims"


def out_name(args: argparse.Namespace, loaded) -> str:
    if args.study is not None:
        return Path(args.study).name
    path = args.run or args.finetuned
    if path is None:
        raise ValueError("probe.py claims: give --run RUN, or --reference RUN_A --finetuned RUN_B")
    path = Path(path)
    return f"{path.parent.name}-{path.name}" if path.is_dir() else path.stem


def snapshots(run: Path) -> list[Path]:
    """The run's snapshots in epoch order; a clear error naming what is needed when there are none."""
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder (expected runs/<name>/<version> with qkv/epoch_*.safetensors)")
    found = sorted((run / "qkv").glob("epoch_*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{run}: no Q/K/V snapshots; claims need {run}/qkv/epoch_000.safetensors and a later "
                                "qkv/epoch_NNN.safetensors (train with the vitlab.callbacks.QKVSnapshot callback)")
    return found


def _read(path: Path, last: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """(tensors, metadata, label) of a snapshot file, or of a run's first / last snapshot."""
    if path.is_dir():
        found = snapshots(path)
        path = found[-1] if last else found[0]
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such run folder or snapshot file")
    tensors, meta = load_snapshot(path)
    if "heads" not in meta:
        raise ValueError(f"{path}: not a vitlab Q/K/V snapshot (no 'heads' metadata)")
    return tensors, meta, str(path)


def weights_pair(args: argparse.Namespace) -> tuple[tuple, tuple]:
    if args.run is not None:
        if args.reference or args.finetuned:
            raise ValueError("probe.py claims: give either --run, or --reference and --finetuned, not both")
        found = snapshots(args.run)
        if len(found) < 2:
            raise ValueError(f"{args.run}: only {found[0].name}; claims compare two epochs and need qkv/epoch_000.safetensors "
                             "and a later qkv/epoch_NNN.safetensors (train at least one epoch with QKVSnapshot)")
        return _read(found[0], last=False), _read(found[-1], last=True)
    if args.reference is None or args.finetuned is None:
        raise ValueError("probe.py claims: give --run RUN, or both --reference RUN_A and --finetuned RUN_B")
    return _read(args.reference, last=True), _read(args.finetuned, last=True)


def ablation_result(run: Path) -> tuple[str, list[str], float, int]:
    """(name, removed components, best val/balanced_acc, number of classes) of an ablation run folder."""
    folder = RunFolder(run)
    if not folder.config:
        raise FileNotFoundError(f"--ablation-run {run}: no config.yaml (expected a train.py run folder runs/<name>/<version>)")
    removed = folder.removed()
    if not removed:
        raise ValueError(f"--ablation-run {run}: config.yaml has no model.ablate.remove (not an ablation run)")
    accuracy = folder.scalars("val/balanced_acc")
    if not accuracy:
        raise ValueError(f"--ablation-run {run}: its event files have no val/balanced_acc scalar (did it validate?)")
    classes = folder.num_classes()
    if not classes:
        raise ValueError(f"--ablation-run {run}: number of classes unknown (no model.num_classes in config.yaml, no checkpoints/last.ckpt)")
    return f"{run.parent.name}/{run.name}", removed, max(v for _, v in accuracy), classes


def evaluate(ref: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], heads: dict[str, int], ablations, permutations: int, seed: int) -> list[C.Claim]:
    """All claims of one weight pair (+ ablation results)."""
    rows, _ = drift_tables(ref, cur, list(heads))
    with SolverPool() as solvers:  # (the claims read scalars only: no antisymmetric parts)
        spectra = block_spectra(cur, heads, antisymmetric=False, executor=solvers)
    summed = {b: {k: float(getattr(s.summed, k)[0]) for k in ("positive_mass", "symmetry_score", "effective_rank")} for b, s in spectra.items()}
    head_mean = {b: float(s.positive_mass.float().mean()) for b, s in spectra.items()}
    spectral = [
        C.claim_002a({b: v["positive_mass"] for b, v in summed.items()}, head_mean),
        C.claim_002b({b: v["symmetry_score"] for b, v in summed.items()}),
        C.claim_002c({b: v["effective_rank"] for b, v in summed.items()}, {b: int(cur[f"{b}.q.weight"].shape[1]) for b in heads}),
    ]
    if C.weights_unchanged(rows):  # W_Q W_K^T never trained (e.g. attention removed): the spectra are the initial weights'
        spectral = [C.untestable(c.id, c.claim, f"{C.NO_DRIFT}: the spectra are those of the initial weights") for c in spectral]
    return [
        C.claim_000a(rows, seed),
        C.claim_000b(rows, seed),
        C.claim_000c(rows, seed),
        C.claim_000d(rows, heads, permutations=permutations, seed=seed),
        *spectral,
        C.claim_003a(ablations),
        C.claim_003b(ablations),
    ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        if "pairs" in value:  # 000-d: the count, the pairs are in claims.json
            return f"{value['significant']}/{value['tested']} (block, matrix) pairs significant"
        inner = {k: v for k, v in value.items() if k != "per_block"}
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in inner.items())
    return str(value)


def markdown(header: dict[str, Any], results: list[C.Claim]) -> str:
    lines = ["# The papers' claims on this run", ""]
    lines += [f"- **{k}**: {v}" for k, v in header.items()]
    lines += ["", "| claim | statement | measured | comparison | T | verdict | note |", "|---|---|---|---|---|---|---|"]
    for c in results:
        score = "-" if c.score is None else f"{c.score:.4g}"
        if c.interval:
            score += f" (95 % CI [{c.interval['low']:.4g}, {c.interval['high']:.4g}], {c.interval['unit']}, {c.interval['method']})"
        lines.append(f"| {c.id} | {c.claim} | {c.statistic}: {_fmt(c.value) if c.value else '-'} | {c.comparison} | {score} | "
                     f"**{c.verdict}** | {c.reason} |")
    return "\n".join(lines) + "\n"


def claims_of_run(run: Path, permutations: int, seed: int) -> list[C.Claim]:
    """The claims of one run folder's own weights, its first vs last snapshot (000-*, 002-*)."""
    found = snapshots(run)
    if len(found) < 2:
        raise ValueError(f"{run}: only {found[0].name}; the drift claims need a later snapshot")
    (ref, _, _), (cur, meta, _) = _read(found[0], last=False), _read(found[-1], last=True)
    heads = {str(k): int(v) for k, v in meta["heads"].items()}
    return evaluate(ref, cur, heads, [], permutations, seed)[:7]


def run(ctx) -> None:
    args = ctx.args
    if args.study is not None:
        study_claims.run(ctx, lambda path: claims_of_run(path, args.permutations, args.seed))
        return
    (ref, ref_meta, ref_label), (cur, cur_meta, cur_label) = weights_pair(args)
    heads = {str(k): int(v) for k, v in cur_meta["heads"].items()}
    if ref.keys() != cur.keys() or {str(k): int(v) for k, v in ref_meta["heads"].items()} != heads:
        only = sorted(set(ref) ^ set(cur))[:4]
        raise ValueError(f"{ref_label} and {cur_label} are different architectures (keys only in one: {only})")
    ablations = [ablation_result(Path(r)) for r in args.ablation_run]
    results = evaluate(ref, cur, heads, ablations, args.permutations, args.seed)
    header = {
        "run": str(args.run) if args.run else f"{args.reference} -> {args.finetuned}",
        "model": cur_meta.get("model", "?"),
        "reference weights": f"{ref_label} (epoch {ref_meta.get('epoch', '?')})",
        "compared weights": f"{cur_label} (epoch {cur_meta.get('epoch', '?')})",
        "blocks": len(heads),
        "ablation runs": ", ".join(a[0] for a in ablations) or "none",
    }
    (ctx.out / "claims.md").write_text(markdown(header, results))
    write_json(ctx.out / "claims.json", {"header": header, "claims": [c.to_dict() for c in results]})
    for c in results:
        print(f"{c.id:6s} {c.verdict:14s} {c.claim}")
