"""Quickstart overhead: end-to-end training step of ``configs/quickstart.yaml`` against a bare timm loop.

    python benchmarks/bench_quickstart.py [--epochs 30] [--bare-steps 40] [--repeats 2] [--no-load]

Runs, each in its own process and one after the other (side by side, so the ratios hold on a shared,
noisy machine where absolute times do not):

1. a bare loop: the quickstart's timm Swin, batch 32 at 64 px, AdamW, forward + backward + step on
   random tensors, nothing else; with torch's own OpenMP settings on 1 thread and one per core, and with
   vitlab's (imported first) on one per core, before and after 2.: the fastest is the wall-time floor, the
   least CPU per step at the quickstart's thread count the CPU-time floor;
2. the quickstart itself (``python train.py --config configs/quickstart.yaml``, its first ``--epochs`` epochs;
   ``--repeats`` times, each followed by the bare loops again, the fastest reported as the bare loop's is):
   data loading, validation, metrics, the Q/K/V callbacks' tables and figures (drawn by vitlab's figure process
   beside it), checkpoints; its step time is the wall time of ``Trainer.fit`` divided by the optimizer steps;
3. the quickstart again while one busy process per core competes for the CPU: its CPU time (the process,
   its data workers and its figure process) against the quiet run's shows whether threads spin when they
   cannot run.

It prints both step times and CPU-seconds side by side with their ratios (wall, and CPU of the training process:
the steadier figure when other jobs share the cores), then where the quickstart's fit time goes: train steps,
validation, the Q/K/V callbacks (tables, scalars, figures), checkpoints, waiting for training batches, start-up
inside ``fit`` (data setup and header pass) and the rest (Lightning's loop and logging).

Goal: quickstart step <= 1.5x the bare step; CPU time under load about the quiet one (not a multiple).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE = r"""
import json, sys, time
if sys.argv[3] == "vitlab":
    from vitlab.runtime import prepare_process  # (first: vitlab's OpenMP spin policy, as train.py sets it)
    prepare_process()
import torch  # else torch's own OpenMP settings
torch.set_num_threads(int(sys.argv[2]))
import yaml
from vitlab.models import build_model, parameter_groups
cfg = yaml.safe_load(open("configs/quickstart.yaml"))["model"]
torch.manual_seed(0)
model = build_model(cfg["model_name"], num_classes=2, in_chans=1, **cfg["model_kwargs"])
opt = torch.optim.AdamW(parameter_groups(model, weight_decay=cfg["weight_decay"]), lr=cfg["lr"])
x = torch.randn(32, 1, 64, 64)
y = torch.randint(0, 2, (32,))
def step():
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range(3):
    step()
n = int(sys.argv[1])
start, cpu = time.perf_counter(), time.process_time()
for _ in range(n):
    step()
out = {"step_s": (time.perf_counter() - start) / n, "cpu_step_s": (time.process_time() - cpu) / n}
print("RESULT " + json.dumps({**out, "threads": torch.get_num_threads(), "openmp": sys.argv[3]}))
"""

QUICKSTART = r"""
import collections, functools, json, sys, time
from vitlab.runtime import prepare_process
prepare_process()  # (first, as train.py does: its OpenMP spin policy precedes torch)
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loops import evaluation_loop, fetchers, fit_loop
from vitlab.callbacks import QKSpectra, QKVDrift, QKVSnapshot
from vitlab.training import ClassificationModule
timing = {}
parts = collections.defaultdict(lambda: [0.0, 0.0])  # part -> [wall s, CPU s] of this process
inside = collections.Counter()
def timed(owner, name, part):
    method = getattr(owner, name)
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if part == "batch fetch" and inside["validation"]:  # counted in validation
            return method(*args, **kwargs)
        start, cpu = time.perf_counter(), time.process_time()
        inside[part] += 1
        try:
            return method(*args, **kwargs)
        finally:
            inside[part] -= 1
            parts[part][0] += time.perf_counter() - start
            parts[part][1] += time.process_time() - cpu
    setattr(owner, name, wrapper)
timed(pl.Trainer, "fit", "fit")
timed(fit_loop._FitLoop, "run", "fit loop")  # fit - fit loop = start-up inside fit (data setup, header pass)
timed(pl.LightningModule, "optimizer_step", "train steps")  # forward, backward, AdamW, per-step logging
timed(fetchers._PrefetchDataFetcher, "__next__", "batch fetch")
timed(evaluation_loop._EvaluationLoop, "run", "validation")  # with its batch fetches and epoch-end metrics
timed(ModelCheckpoint, "_save_checkpoint", "checkpoints")
for callback in (QKVSnapshot, QKVDrift, QKSpectra):
    timed(callback, "on_fit_start", "Q/K/V at fit start")  # reference snapshot, epoch-0 spectra (inside start-up)
    timed(callback, "on_train_epoch_end", "Q/K/V callbacks")
timed(ClassificationModule, "on_train_epoch_end", "epoch metrics")
from vitlab.cli import fit
import torch
cli = fit(sys.argv[1:])
timing["steps"] = cli.trainer.global_step
timing["fit_s"], timing["fit_cpu_s"] = parts.pop("fit")
timing["threads"] = torch.get_num_threads()
timing["parts"] = dict(parts)
print("RESULT " + json.dumps(timing))
"""


def run_child(code: str, args: list[str]) -> tuple[dict, float, float]:
    """Run ``code`` in a fresh Python; return its RESULT line, wall seconds and CPU seconds (with its workers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(line[len("RESULT "):]), wall, cpu


def steps_per_epoch() -> int:
    """Training batches per epoch of the quickstart's data (generated into the cache on first use)."""
    import yaml

    from vitlab.data import MedicalDataModule

    data = MedicalDataModule(**yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["data"])
    data.setup("fit")
    return len(data.train_dataloader())


def quickstart_args(save_dir: str, steps: int) -> list[str]:
    """The quickstart's 30-epoch schedule (LR, figure frequency) cut short after ``steps`` steps."""
    return [
        "--config", "configs/quickstart.yaml",
        "--trainer.max_steps", str(steps),
        "--trainer.logger.init_args.save_dir", save_dir,
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
    ]


def report(bare_runs: list[dict], quick: dict, quick_wall: float, quick_cpu: float) -> None:
    """Step times and CPU-seconds of both side by side, their ratios, and where the quickstart's time goes.

    Wall: against the fastest bare run (1 thread or one per core: the best a bare loop gets here). CPU: against
    the bare runs at the quickstart's thread count (more threads cost more CPU-seconds for the same step)."""
    bare = min(bare_runs, key=lambda r: r["step_s"])
    same = [r for r in bare_runs if r["threads"] == quick["threads"]] or bare_runs
    bare_cpu_run = min(same, key=lambda r: r["cpu_step_s"])
    steps, bare_s, bare_cpu = quick["steps"], bare["step_s"], bare_cpu_run["cpu_step_s"]
    step_s, cpu_step = quick["fit_s"] / steps, quick["fit_cpu_s"] / steps
    for run in bare_runs:
        print(f"  bare loop, {run['openmp']:6s} OpenMP settings, {run['threads']} threads: {run['step_s'] * 1e3:6.1f} ms/step, "
              f"{run['cpu_step_s'] * 1e3:6.1f} CPU-ms/step")
    print(f"bare timm loop      : {bare_s * 1e3:7.1f} ms/step ({bare['threads']} torch threads), {bare_cpu * 1e3:6.1f} CPU-ms/step "
          f"({bare_cpu_run['threads']} threads); {steps} steps = {bare_s * steps:5.1f} s, {bare_cpu * steps:5.1f} CPU-s")
    print(f"quickstart (fit)    : {step_s * 1e3:7.1f} ms/step ({quick['threads']} torch threads), {cpu_step * 1e3:6.1f} CPU-ms/step; "
          f"{steps} steps = {quick['fit_s']:5.1f} s, {quick['fit_cpu_s']:5.1f} CPU-s")
    print(f"ratio (wall)        : {step_s / bare_s:7.2f}x  (goal <= 1.5x)")
    print(f"ratio (CPU)         : {cpu_step / bare_cpu:7.2f}x  (CPU of the training process; steadier than wall time when the machine is shared)")
    print(f"quickstart process  : {quick_wall:6.1f} s wall, {quick_cpu:6.1f} CPU-s (with start-up, data workers and the figure process)")
    parts = quick["parts"]
    loop_wall, loop_cpu = parts.pop("fit loop")
    first = parts.pop("Q/K/V at fit start")
    parts["Q/K/V callbacks"] = [a + b for a, b in zip(parts["Q/K/V callbacks"], first)]
    parts["start-up in fit"] = [quick["fit_s"] - loop_wall - first[0], quick["fit_cpu_s"] - loop_cpu - first[1]]
    parts["training batches fetched"] = parts.pop("batch fetch")  # mostly waiting on the loader worker
    named_wall, named_cpu = (sum(v[i] for v in parts.values()) for i in (0, 1))
    parts["other (logging, LR, loop)"] = [quick["fit_s"] - named_wall, quick["fit_cpu_s"] - named_cpu]
    print("where the quickstart's fit time goes (this process; data workers apart):")
    for part, (wall, cpu) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
        print(f"  {part:26s} {wall:6.1f} s  {cpu:6.1f} CPU-s  ({cpu / quick['fit_cpu_s']:4.0%} of its CPU)")


def competing_load(processes: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30, help="quickstart epochs per run, of its 30 (default: all)")
    parser.add_argument("--bare-steps", type=int, default=40, help="timed steps of the bare loop (default 40)")
    parser.add_argument("--repeats", type=int, default=2, help="quiet quickstart runs; the fastest is compared with the "
                        "fastest bare loop (default 2: other jobs on a shared machine slow single runs)")
    parser.add_argument("--no-load", action="store_true", help="skip the run under a competing load")
    parser.add_argument("--inline-figures", action="store_true", help="also run the quickstart with runtime.figures inline "
                        "(figures drawn in the training process) and off, side by side: what the figure worker saves")
    opts = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {cores} usable cores, load average {os.getloadavg()[0]:.1f} (shared machines: compare ratios, not seconds)")

    def bare_runs() -> list[dict]:  # torch's OpenMP settings on 1 thread and one per core, vitlab's on one per core
        runs = [(1, "torch"), (cores, "torch"), (cores, "vitlab")]
        return [run_child(BARE, [str(opts.bare_steps), str(t), policy])[0] for t, policy in dict.fromkeys(runs)]

    bare = bare_runs()
    steps = opts.epochs * steps_per_epoch()
    with tempfile.TemporaryDirectory(prefix="vitlab-bench-qs-") as tmp:
        runs = []
        for i in range(opts.repeats):  # each bracketed by bare loops: the floor drifts with the machine's load
            runs.append(run_child(QUICKSTART, quickstart_args(str(Path(tmp) / f"quiet{i}"), steps)))
            bare += bare_runs()
        if opts.repeats > 1:
            print("quickstart fits     : " + ", ".join(f"{q['fit_s']:.1f} s" for q, _, _ in runs) + " (the fastest is reported, as the fastest bare loop is)")
        quick, quick_wall, quick_cpu = min(runs, key=lambda run: run[0]["fit_s"])
        report(bare, quick, quick_wall, quick_cpu)
        if opts.inline_figures:
            for mode in ("inline", "off", "auto"):
                other = run_child(QUICKSTART, [*quickstart_args(str(Path(tmp) / mode), steps), "--runtime.figures", mode])[0]
                print(f"figures {mode:6s}      : fit {other['fit_s']:5.1f} s, {other['fit_cpu_s']:5.1f} CPU-s of the training process")
        if opts.no_load:
            return
        load = competing_load(cores)
        try:
            loaded, loaded_wall, loaded_cpu = run_child(QUICKSTART, quickstart_args(str(Path(tmp) / "loaded"), steps))
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
        print(f"under {cores} busy procs: {loaded_wall:6.1f} s wall, {loaded_cpu:6.1f} CPU-s -> CPU time {loaded_cpu / quick_cpu:.2f}x the quiet run's (goal ~1x; spinning threads make it a multiple)")


if __name__ == "__main__":
    main()
