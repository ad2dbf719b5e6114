"""vitlab's host-side cost per training step: its classification fit against a bare loop of the same tiny model.

    python benchmarks/bench_step_overhead.py [--steps 200] [--repeats 3] [--threads 1] [--workers 0] [--depth 1]
                                             [--layer-decay F] [--profile]

The model is tiny (a one-block ViT, embed dim 16, 16 px, batch 2), so compute is close to zero and what remains
per step is what runs around it on the host. On a GPU that host time is what keeps the device waiting when it
exceeds the step's kernels, so this is the CPU-side check of GPU overhead that needs no GPU. Each side runs in its
own process, one after the other, ``--repeats`` times (the fastest of each reported):

1. a bare loop: ``vitlab.models.build_model`` of the same model, AdamW over the same parameter groups,
   cross-entropy, forward + backward + step on one random batch held in memory;
2. ``vitlab.cli.fit`` on the quickstart's embedded data (images prescaled to 16 px, ``augment: none``, decoded
   images cached in memory), with the quickstart's callbacks (Q/K/V snapshot, drift, spectra, learning-rate
   monitor), two checkpointers, the run-time callback, TensorBoard logging every 5 steps and the progress bar;
   ``--workers``: loader worker processes (0: batches made in the training process).

The fit's process also runs a bare step on a copy of its network (same parameter groups) just before each timed
step, and the benchmark reports the median of the paired differences: the figure to trust on a shared machine,
whose speed drifts by tens of percent from minute to minute, so that runs minutes apart differ more than the
framework's cost. After the fit it runs the bare loop again on the fit's own network, in the same process.

It prints the median time per step of each (the fit's step: from one ``on_train_batch_start`` to the next, in the
second epoch, so epoch ends and the first steps are left out), the difference (vitlab's cost per step), and that
difference split into the batch fetch (the loader in the training process: collate, no augmentation), the step
itself (forward, backward, optimizer, per-step hooks) and the rest (Lightning's loop, logging, progress bar). It
also prints the training thread's CPU time per step on both sides: the figure that stays put when other jobs share
the cores, since time spent waiting for a core is not counted.

Goal: the difference <= 2 ms per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model_name": "vit_tiny_patch16_224",
         "model_kwargs": {"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 1, "drop_path_rate": 0.0}}
BATCH = 2

BARE_LOOP = r"""
def bare_step(model, model_cfg, batch):
    # one step of forward + backward + AdamW (the same parameter groups) on one random batch in memory
    import torch
    from vitlab.models import parameter_groups
    opt = torch.optim.AdamW(parameter_groups(model, weight_decay=0.05, layer_decay=model_cfg.get("layer_decay")), lr=1e-3)
    x, y = torch.randn(batch, 1, 16, 16), torch.randint(0, 2, (batch,))
    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step

def bare_median(model, model_cfg, batch, steps, warmup):
    # median seconds of forward + backward + AdamW (the same parameter groups) on one random batch in memory:
    # (wall clock, this thread's CPU time)
    import statistics, time
    step = bare_step(model, model_cfg, batch)
    for _ in range(warmup):
        step()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu)
"""

BARE = BARE_LOOP + r"""
import json, sys
from vitlab.runtime import prepare_process
prepare_process()
import torch
torch.set_num_threads(int(sys.argv[2]))
from vitlab.models import build_model
model_cfg = json.loads(sys.argv[3])
torch.manual_seed(0)
model = build_model(model_cfg["model_name"], num_classes=2, in_chans=1, **model_cfg["model_kwargs"])
wall, cpu = bare_median(model, model_cfg, int(sys.argv[4]), int(sys.argv[1]), 20)
print("RESULT " + json.dumps({"step_s": wall, "cpu_s": cpu}))
"""

FIT = BARE_LOOP + r"""
import collections, functools, json, os, statistics, sys, time
from vitlab.runtime import prepare_process
prepare_process()
import pytorch_lightning as pl
from pytorch_lightning.loops import fetchers

def plain_step(*args):
    # a bare step as in a process without Lightning, which sets PYTORCH_NVML_BASED_CUDA_CHECK=1 for the whole process
    step = bare_step(*args)
    def plain():
        nvml = os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        try:
            step()
        finally:
            if nvml is not None:
                os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml
    return plain

class StepTimer(pl.Callback):
    # times the second epoch's steps; before each, one bare step on a copy of the fit's network (the paired figure)
    def __init__(self):
        self.starts, self.cpu_starts, self.inside, self.fetch, self.bare, self.bare_cpu = [], [], [], [], [], []
        self._start = None
    def on_train_start(self, trainer, pl_module):
        import copy
        self._bare_step = plain_step(copy.deepcopy(pl_module.model).train(), json.loads(os.environ["BENCH_MODEL"]),
                                    int(os.environ["BENCH_BATCH"]))
        for _ in range(10):
            self._bare_step()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 1:
            start, start_cpu = time.perf_counter(), time.thread_time()
            self._bare_step()
            self._start = time.perf_counter()
            self.bare.append(self._start - start)
            self.bare_cpu.append(time.thread_time() - start_cpu)
            self.starts.append(start)
            self.cpu_starts.append(start_cpu)
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and self._start is not None:
            self.inside.append(time.perf_counter() - self._start)

fetch_times = []
original = fetchers._PrefetchDataFetcher.__next__
@functools.wraps(original)
def timed_next(self):
    start = time.perf_counter()
    try:
        return original(self)
    finally:
        fetch_times.append(time.perf_counter() - start)
fetchers._PrefetchDataFetcher.__next__ = timed_next

import os
if os.environ.get("BENCH_CPROFILE"):  # the second epoch's steps under cProfile: the host's Python by function
    import cProfile, pstats
    profiler = cProfile.Profile()
    _start, _end = StepTimer.on_train_batch_start, StepTimer.on_train_batch_end
    def on_start(self, trainer, pl_module, batch, batch_idx):
        profiled = trainer.current_epoch == 1 and batch_idx >= 5
        if profiled and batch_idx > 5:
            profiler.disable()  # (not the bare step run beside the fit's step)
        _start(self, trainer, pl_module, batch, batch_idx)
        if profiled:
            profiler.enable()
    StepTimer.on_train_batch_start = on_start
    def on_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            profiler.disable()
            stats = pstats.Stats(profiler, stream=sys.stderr)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
    StepTimer.on_train_epoch_end = on_epoch_end

from vitlab.cli import fit
cli = fit(sys.argv[1:])
timer = next(cb for cb in cli.trainer.callbacks if isinstance(cb, StepTimer))
# the fit's step: from one batch start to the next, less the bare step run there
cycles = [b - a - bare for a, b, bare in zip(timer.starts, timer.starts[1:], timer.bare)][5:]
cpu_cycles = [b - a - bare for a, b, bare in zip(timer.cpu_starts, timer.cpu_starts[1:], timer.bare_cpu)][5:]
paired = [cycle - bare for cycle, bare in zip(cycles, timer.bare[5:])]  # each step against the bare step beside it
paired_cpu = [cycle - bare for cycle, bare in zip(cpu_cycles, timer.bare_cpu[5:])]

# the bare loop again in this process, right after the fit (same interpreter, threads, allocator and load)
bare_same, bare_same_cpu = bare_median(cli.model.model.train(), json.loads(os.environ["BENCH_MODEL"]), int(os.environ["BENCH_BATCH"]),
                        len(cycles), 10)
steps_per_epoch = len(timer.starts)
fetch = fetch_times[steps_per_epoch + 5 : 2 * steps_per_epoch]  # the second epoch's fetches
print("RESULT " + json.dumps({"step_s": statistics.median(cycles), "cpu_s": statistics.median(cpu_cycles),
                              "paired_s": statistics.median(paired), "paired_cpu_s": statistics.median(paired_cpu),
                              "bare_beside_s": statistics.median(timer.bare[5:]), "inside_s": statistics.median(timer.inside[5:]),
                              "fetch_s": statistics.median(fetch), "steps": len(cycles),
                              "bare_same_process_s": bare_same, "bare_same_process_cpu_s": bare_same_cpu}))
"""


def run(code: str, args: list[str], model: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "BENCH_MODEL": json.dumps(model or MODEL),
           "BENCH_BATCH": str(BATCH)}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if env.get("BENCH_CPROFILE") and "pstats" in code:
        print(proc.stderr[-20000:])
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def fit_config(save_dir: Path, steps: int, threads: int, workers: int = 0, model: dict | None = None) -> Path:
    import yaml

    cfg = {
        "seed_everything": 0,
        "runtime": {"threads": threads, "workers": workers, "figures": "auto"},
        "trainer": {
            "max_epochs": 2, "limit_train_batches": steps + 10, "limit_val_batches": 0, "accelerator": "cpu", "devices": 1,
            "log_every_n_steps": 5, "enable_model_summary": False,
            "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(save_dir), "name": "overhead", "default_hp_metric": False}},
            "callbacks": [{"class_path": "__main__.StepTimer"}, {"class_path": "vitlab.callbacks.QKVSnapshot"},
                          {"class_path": "vitlab.callbacks.QKVDrift"}, {"class_path": "vitlab.callbacks.QKSpectra"},
                          {"class_path": "pytorch_lightning.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "epoch"}}],
        },
        "model": {**(model or MODEL), "lr": 1e-3},
        "data": {"root": None, "embedded_kwargs": {"patients": 96, "size": 64}, "image_size": 16, "batch_size": BATCH,
                 "augment": "none", "val_fraction": 0.2},
    }
    path = save_dir / "overhead.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating; the fastest is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    parser.add_argument("--workers", type=int, default=0, help="vitlab's loader workers (default 0: batches made in the "
                        "training process, as the CPU quickstart does; 1: in a worker, as beside a GPU)")
    parser.add_argument("--depth", type=int, default=1, help="blocks of the tiny ViT (12: ViT-B's parameter tensors and "
                        "layer-decay groups, with --layer-decay 0.75)")
    parser.add_argument("--layer-decay", type=float, default=None, help="layer decay on both sides (default none)")
    parser.add_argument("--profile", action="store_true", help="print cProfile tables of the fit's second epoch (host Python)")
    args = parser.parse_args()
    if args.profile:
        os.environ["BENCH_CPROFILE"] = "1"
    model = {"model_name": MODEL["model_name"], "model_kwargs": {**MODEL["model_kwargs"], "depth": args.depth}}
    if args.layer_decay is not None:
        model["layer_decay"] = args.layer_decay
    bare_runs, fit_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            bare_runs.append(run(BARE, [str(args.steps), str(args.threads), json.dumps(model), str(BATCH)]))
            save_dir = Path(tmp) / f"run{repeat}"
            save_dir.mkdir()
            fit_runs.append(run(FIT, ["--config", str(fit_config(save_dir, args.steps, args.threads, args.workers, model)),
                                      "--trainer.logger.init_args.save_dir", str(save_dir)], model))
    bare = min(r["step_s"] for r in bare_runs)
    best = min(fit_runs, key=lambda r: r["step_s"])
    diff = best["step_s"] - bare
    print(f"tiny ViT (embed 16, {args.depth} block(s), 16 px, batch {BATCH}, layer decay {args.layer_decay}), {args.threads} torch thread(s), {args.workers} loader worker(s), "
          f"{best['steps']} steps, "
          f"fastest of {args.repeats}:")
    print(f"  bare loop        : {bare * 1e3:6.2f} ms/step (forward, backward, AdamW on a batch in memory)")
    print(f"  vitlab fit       : {best['step_s'] * 1e3:6.2f} ms/step (median, from one batch start to the next)")
    same = best["bare_same_process_s"]
    print(f"  bare, same process after the fit: {same * 1e3:6.2f} ms/step; the fit's step = {best['step_s'] / same:4.2f}x it "
          "(the side-by-side figure: same interpreter, threads and machine load)")
    print(f"  difference       : {diff * 1e3:6.2f} ms/step  (goal <= 2 ms)")
    paired = min(r["paired_s"] for r in fit_runs)
    paired_cpu = min(r["paired_cpu_s"] for r in fit_runs)
    print(f"  paired difference: {paired * 1e3:6.2f} ms/step wall, {paired_cpu * 1e3:.2f} ms CPU  (goal <= 2 ms; the "
          "median over steps of each fit step less a bare step run just before it on a copy of the network: the "
          "figure that drift in the machine's speed leaves alone)")
    bare_cpu, fit_cpu = min(r["cpu_s"] for r in bare_runs), min(r["cpu_s"] for r in fit_runs)
    print(f"  training thread's CPU time per step (the load-robust figure: a busy machine delays a step but does not "
          f"add to it): bare {bare_cpu * 1e3:.2f} ms, vitlab fit {fit_cpu * 1e3:.2f} ms, difference "
          f"{(fit_cpu - bare_cpu) * 1e3:.2f} ms (same process: {(best['cpu_s'] - best['bare_same_process_cpu_s']) * 1e3:.2f} ms)")
    where = "from the worker" if args.workers else "in the training process: read from memory, collate"
    print(f"    batch fetch    : {best['fetch_s'] * 1e3:6.2f} ms ({where})")
    print(f"    step - bare    : {(best['inside_s'] - bare) * 1e3:6.2f} ms (training_step, backward, optimizer, per-step hooks)")
    rest = best["step_s"] - best["inside_s"] - best["fetch_s"]
    print(f"    rest           : {rest * 1e3:6.2f} ms (Lightning's loop, logging every 5 steps, progress bar)")


if __name__ == "__main__":
    main()
