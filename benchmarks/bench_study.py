"""The Attentionless study on the embedded data: one run at a time against one run per core, side by side.

    python benchmarks/bench_study.py [--seeds 0,1,2,3,4] [--parallel 2] [--out runs]

Runs ``python train.py --config configs/quickstart.yaml --study configs/study_ablation.yaml`` (the quickstart
Swin intact and without residuals, LayerNorms, attention or MLPs; ``--seeds`` replaces the study file's seeds)
twice, one after the other: as ``<out>/attentionless`` one run at a time (each run takes every core), then as
``<out>/attentionless-parallel`` with ``--study.parallel N`` (N runs at once, each on its share of the cores,
``runtime.threads`` 1 on a 2-core machine). It prints both wall times, the CPU seconds of their runs (each cell's
training process and its children, from ``wait4``: what the machine's other jobs do not change much) and the
load average around each, and the ratios; then it runs ``probe.py claims --study`` on the first study and prints
its claims and the Attentionless table.

Both studies are resumable: rerunning the script after an interruption finishes them, but a resumed study's
wall time is not the study's (the script says so). Remove the two folders for a fresh measurement.

Goal: the study as one command; one run per core no slower than one run at a time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").is_file() else "?"


def cpu_seconds(folder: Path) -> float:
    """The study's cells' own CPU time (each cell's training process and its children, as the study recorded it)."""
    states = [json.loads(p.read_text()) for p in (folder / "cells").glob("*.json")]
    return sum(s.get("cpu_s") or 0.0 for s in states)


def study(out: Path, name: str, seeds: str, extra: list[str]) -> float:
    """Run the study ``name`` (train.py --study) and return its wall time in seconds."""
    folder = out / name
    resumed = (folder / "study.json").is_file()
    command = [sys.executable, "train.py", "--config", "configs/quickstart.yaml", "--trainer.logger.init_args.save_dir",
               str(out), "--study", "configs/study_ablation.yaml",
               f"seeds={seeds}", "--study.name", name, *extra]
    print("$", " ".join(command), f"   (load average before: {load()})", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.perf_counter() - start
    print(f"{name}: {wall:.0f} s wall, {cpu_seconds(folder):.0f} CPU s in its runs (load average after: {load()})", flush=True)
    if resumed:
        print(f"note: {folder} existed before: {wall:.0f} s is what was left of it, not the study's wall time")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the study (default 0,1,2,3,4)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once in the second study (default 2: one per core here)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs", help="where the two study folders go")
    args = parser.parse_args()
    sequential = study(args.out, "attentionless", args.seeds, [])
    parallel = study(args.out, "attentionless-parallel", args.seeds, ["--study.parallel", str(args.parallel)])
    cells = len(json.loads((args.out / "attentionless" / "study.json").read_text())["cells"])
    cpu = cpu_seconds(args.out / "attentionless"), cpu_seconds(args.out / "attentionless-parallel")
    print(f"\n{cells} runs: one at a time {sequential:.0f} s wall ({sequential / cells:.1f} s a run, {cpu[0]:.0f} CPU s), "
          f"{args.parallel} at once {parallel:.0f} s wall ({cpu[1]:.0f} CPU s); wall ratio {parallel / sequential:.2f}, "
          f"CPU ratio {cpu[1] / max(cpu[0], 1e-9):.2f}")
    subprocess.run([sys.executable, "probe.py", "claims", "--study", str(args.out / "attentionless"), "--overwrite"],
                   cwd=ROOT, check=True)
    print((args.out / "attentionless" / "claims" / "claims.md").read_text())


if __name__ == "__main__":
    main()
