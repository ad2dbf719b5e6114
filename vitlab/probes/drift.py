"""probe.py drift: the Drotos poster's Q/K/V comparison of two weight sets, without re-training."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from vitlab.qkv.state import MATRICES, block_stage, head_counts, load_snapshot, qkv_state
from vitlab.qkv.drift import drift_layout, report_drift
from vitlab.qkv.spectra import block_spectra, report_spectra, spectra_layout
from vitlab.probes.common import add_model_arguments
from vitlab.probes.loading import load_model
from vitlab.runs import newest_checkpoint, run_folder, run_label
from vitlab.outputs.files import write_csv
from vitlab.solver_pool import SolverPool

HELP = """Compare the Q/K/V weights of two checkpoints (Drotos poster): per-row cosine distance, Euclidean, MSE, dot.

Each of --reference / --finetuned is a vitlab checkpoint (.ckpt), a Q/K/V snapshot (runs/.../qkv/epoch_000.safetensors)
or a weights file of the --model architecture. Writes TensorBoard scalars, heatmaps, histograms, spectra and drift.csv.

example:
  python probe.py drift --reference runs/quickstart/version_0/qkv/epoch_000.safetensors \\
                        --finetuned runs/quickstart/version_0/checkpoints/last.ckpt
"""
LOADS_MODEL = False
SUMMARY_METRICS = ("cosine_distance", "euclidean", "mse", "dot", "rel_frobenius")  # columns of the printed table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference", type=Path, default=None, help="the weights before fine-tuning (default: the --finetuned run's qkv/epoch_000.safetensors)")
    parser.add_argument("--finetuned", type=Path, default=None, help="the weights after fine-tuning (default: the newest runs/**/checkpoints/last.ckpt)")
    group = parser.add_argument_group("architecture, for plain weight files")
    add_model_arguments(group)
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="output folder (default runs/probe-drift-<finetuned name>/)")
    out.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--device", default="cpu")


def fill_defaults(args: argparse.Namespace) -> None:
    """No --finetuned: the newest run's last.ckpt; no --reference: that run's epoch-0 Q/K/V snapshot."""
    if args.finetuned is None:
        args.finetuned = newest_checkpoint()
        print(f"probe.py drift: no --finetuned given, using the newest run's checkpoint {args.finetuned}", file=sys.stderr)
    if args.reference is None:
        folder = run_folder(args.finetuned)
        snapshot = folder / "qkv" / "epoch_000.safetensors" if folder is not None else None
        if snapshot is None or not snapshot.is_file():
            raise ValueError(f"--reference missing: {args.finetuned} has no run folder with qkv/epoch_000.safetensors; "
                             "give the weights before fine-tuning with --reference")
        args.reference = snapshot
        print(f"probe.py drift: reference = the run's epoch-0 snapshot {snapshot}", file=sys.stderr)


def out_name(args: argparse.Namespace, loaded) -> str:
    return run_label(run_folder(args.finetuned)) or Path(args.finetuned).stem


def read_qkv(path: Path, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Flat Q/K/V state + heads per block from a snapshot, a vitlab checkpoint or a weights file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a .ckpt, a Q/K/V snapshot or a weights file)")
    if path.suffix == ".safetensors":
        tensors, meta = load_snapshot(path)
        if "heads" in meta:  # a vitlab Q/K/V snapshot
            return tensors, {str(k): int(v) for k, v in meta["heads"].items()}
    if path.suffix == ".ckpt" and args.model is None:
        loaded = load_model(argparse.Namespace(checkpoint=path, config=None, model=None))
    else:
        if args.model is None:
            raise ValueError(f"{path} is a plain weights file: say its architecture with --model NAME (and --model-kwargs)")
        ns = argparse.Namespace(**{**vars(args), "checkpoint": None, "config": None, "weights": path, "pretrained": False})
        loaded = load_model(ns)
    return qkv_state(loaded.model), head_counts(loaded.model)


def run(ctx) -> None:
    ref, heads = read_qkv(ctx.args.reference, ctx.args)
    cur, heads_cur = read_qkv(ctx.args.finetuned, ctx.args)
    if ref.keys() != cur.keys() or heads != heads_cur:
        missing = sorted(set(ref) ^ set(cur))[:4]
        raise ValueError(f"--reference and --finetuned are different architectures (keys only in one: {missing}, heads {heads} vs {heads_cur})")
    bad = [k for k in ref if ref[k].shape != cur[k].shape][:4]
    if bad:
        raise ValueError(f"--reference and --finetuned differ in shape at {[(k, tuple(ref[k].shape), tuple(cur[k].shape)) for k in bad]}")
    summary = report_drift(ctx.writer, ref, cur, None, heads, step=1, table_path=ctx.out / "drift.csv", epoch=1)
    ctx.writer.add_custom_scalars({**drift_layout(), **spectra_layout()})
    with SolverPool() as solvers:
        for step, state in ((0, ref), (1, cur)):
            report_spectra(ctx.writer, block_spectra(state, heads, executor=solvers), step,
                           ctx.out / f"spectra_{'reference' if step == 0 else 'finetuned'}.csv")
    rows = stage_table(summary)
    write_csv(ctx.out / "drift_summary.csv", rows)
    print_table(rows, ctx.args.reference, ctx.args.finetuned)


def stage_table(summary: dict[tuple[str, str], dict[str, float]]) -> list[dict[str, object]]:
    """Mean of each metric per (stage, Q|K|V)."""
    groups: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for (block, m), values in summary.items():
        groups[(block_stage(block), m)].append(values)
    rows = []
    for (stage, m) in sorted(groups, key=lambda k: (k[0], MATRICES.index(k[1]))):
        vals = groups[(stage, m)]
        rows.append({"stage": stage, "matrix": m.upper(), "blocks": len(vals), **{k: sum(v[k] for v in vals) / len(vals) for k in SUMMARY_METRICS}})
    return rows


def print_table(rows: list[dict[str, object]], reference: Path, finetuned: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Q/K/V drift: {finetuned} vs {reference} (mean over rows and blocks)")
    for col in ("stage", "matrix", "blocks", *SUMMARY_METRICS):
        table.add_column(col, justify="right" if col not in ("stage", "matrix") else "left")
    for row in rows:
        table.add_row(*(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in ("stage", "matrix", "blocks", *SUMMARY_METRICS)))
    Console(width=max(Console().width, 120)).print(table)
