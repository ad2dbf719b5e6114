"""The Attentionless study on the embedded data: one run at a time against one run per core, side by side.

    python benchmarks/bench_study.py [--seeds 0,1,2,3,4] [--parallel 2] [--out runs]

Runs ``python train.py --config configs/quickstart.yaml --study configs/study_ablation.yaml`` (the quickstart
Swin intact and without residuals, LayerNorms, attention or MLPs; ``--seeds`` replaces the study file's seeds)
twice, one after the other: as ``<out>/attentionless`` one run at a time (each run takes every core), then as
``<out>/attentionless-parallel`` with ``--study.parallel N`` (N runs at once, each on its share of the cores,
``runtime.threads`` 1 on a 2-core machine). It prints both wall times and their ratio, then runs
``probe.py claims --study`` on the first study and prints its claims and the Attentionless table.

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


def study(out: Path, name: str, seeds: str, extra: list[str]) -> float:
    """Run the study ``name`` (train.py --study) and return its wall time in seconds."""
    folder = out / name
    resumed = (folder / "study.json").is_file()
    command = [sys.executable, "train.py", "--config", "configs/quickstart.yaml", "--trainer.logger.init_args.save_dir",
               str(out), "--study", "configs/study_ablation.yaml",
               f"seeds={seeds}", "--study.name", name, *extra]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    wall = time.perf_counter() - start
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
    print(f"\n{cells} runs: one at a time {sequential:.0f} s ({sequential / cells:.1f} s a run), "
          f"{args.parallel} at once {parallel:.0f} s; ratio {parallel / sequential:.2f}")
    subprocess.run([sys.executable, "probe.py", "claims", "--study", str(args.out / "attentionless"), "--overwrite"],
                   cwd=ROOT, check=True)
    print((args.out / "attentionless" / "claims" / "claims.md").read_text())


if __name__ == "__main__":
    main()
