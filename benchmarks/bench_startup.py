"""Benchmark: probe.py start-up against ``python -c "import torch"``, measured side by side.

Goals: ``probe.py --help`` <= 2x and ``probe.py spectra --checkpoint <tiny.ckpt>`` (the whole run: the spectra
of a 2-block model are instant, so this is start-up: imports, checkpoint, model, TensorBoard writer, figures)
<= 3x the wall time of ``python -c "import torch"``. The commands run interleaved, ``--repeats`` rounds; the
median of each is reported (the machine is shared). ``--reference-tree DIR`` also times the same commands in
another checkout (e.g. ``git worktree add /tmp/old 598c802``) for a before/after figure.
Run: ``python benchmarks/bench_startup.py [--repeats 5] [--reference-tree DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def tiny_checkpoint(folder: Path) -> Path:
    """A vitlab-style training checkpoint of a 2-block ViT (hyperparameters + ``model.``-prefixed state)."""
    sys.path.insert(0, str(ROOT))
    from vitlab.models import build_model

    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
    model = build_model("vit_tiny_patch16_224", 2, in_chans=1, **kwargs)
    path = folder / "last.ckpt"
    torch.save({"hyper_parameters": {"model_name": "vit_tiny_patch16_224", "num_classes": 2, "in_chans": 1, "model_kwargs": kwargs},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    return path


def wall(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(cwd), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{done.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-tree", type=Path, default=None, help="another checkout to time the same probe commands in")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    ckpt = tiny_checkpoint(tmp)
    trees = {"this tree": ROOT, **({"reference tree": args.reference_tree.resolve()} if args.reference_tree else {})}
    commands: dict[str, tuple[list[str], Path]] = {"import torch": ([sys.executable, "-c", "import torch"], ROOT)}
    for label, tree in trees.items():
        commands[f"probe.py --help ({label})"] = ([sys.executable, "probe.py", "--help"], tree)
        commands[f"probe.py spectra ({label})"] = ([sys.executable, "probe.py", "spectra", "--checkpoint", str(ckpt), "--out", str(tmp / "out"), "--overwrite"], tree)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, (cmd, cwd) in commands.items():
            times[name].append(wall(cmd, cwd))
    shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(times["import torch"])
    print(f"median of {args.repeats} interleaved runs (wall seconds; ratio to `python -c \"import torch\"`)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<40s} {median:6.2f} s   {median / base:5.2f}x   (min {min(values):.2f}, max {max(values):.2f})")
    help_ratio = statistics.median(times["probe.py --help (this tree)"]) / base
    spectra_ratio = statistics.median(times["probe.py spectra (this tree)"]) / base
    print(f"goal: --help <= 2x: {'met' if help_ratio <= 2 else 'NOT met'} ({help_ratio:.2f}x); "
          f"spectra start-up <= 3x: {'met' if spectra_ratio <= 3 else 'NOT met'} ({spectra_ratio:.2f}x)")


if __name__ == "__main__":
    main()
