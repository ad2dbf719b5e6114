"""The detection, segmentation and volume quickstarts end to end: wall time, CPU time, where it goes, final metrics.

    python benchmarks/bench_dense_quickstart.py [--task detection segmentation volume] [--seeds 0 1 2] [--fresh-cache]

Each quickstart runs as ``python train.py --config configs/quickstart_<task>.yaml`` in its own process,
one after the other. The machine is shared, so wall time is an upper bound; the CPU time of the run (the
training process, its threads and its data workers) does not grow with other jobs. On 2 quiet cores the run
keeps both busy (``runtime: auto``: two torch threads and no loader worker), so the quiet wall time is about the
larger of CPU-s / 2 and the training process's CPU time over its torch threads. The training process's CPU time
is split by Lightning hook: training steps (forward, backward, optimizer), the validation loop (forward + COCO
mAP / Dice), the Q/K/V callbacks, and the rest (start-up, data set-up and the embedded set's generation with
``--fresh-cache``, checkpoints, logging).

Before the runs, the detection quickstart's training step with its ``head_kwargs`` (fewer RPN boxes and
RoIs, one RoIAlign sample per bin) against ``heads: light``'s defaults: CPU time per step on the same real
batches, interleaved.

Goals: each quickstart <= 5 min on 2 quiet cores; val box mAP@0.5 >= 0.5 (detection), val lesion
Dice >= 0.6 (segmentation); ``configs/quickstart_volume.yaml`` (task ``volume``, 3-D lesion segmentation
with a tiny SwinUNETR) <= 5 min on 2 cores with val lesion Dice >= 0.5 on each of 3 seeds: ``--task volume --seeds
0 1 2`` runs it once per seed (``--seed_everything``; the patient split stays ``data.seed``'s).
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

CHILD = r"""
import json, sys, time
from vitlab.runtime import prepare_process

prepare_process()  # (first, as train.py does: before torch)
import pytorch_lightning as pl

cpu = {"train steps": 0.0, "validation": 0.0, "Q/K/V callbacks": 0.0}
marks = {}

class PhaseTimer(pl.Callback):
    def on_train_batch_start(self, *a):
        marks["train"] = time.process_time()
    def on_train_batch_end(self, *a):
        cpu["train steps"] += time.process_time() - marks.pop("train")
    def on_validation_start(self, *a):
        marks["val"] = time.process_time()
    def on_validation_end(self, *a):
        cpu["validation"] += time.process_time() - marks.pop("val")

def timed(hook):
    def inner(*a, **k):
        t = time.process_time()
        try:
            return hook(*a, **k)
        finally:
            cpu["Q/K/V callbacks"] += time.process_time() - t
    return inner

fit_method = pl.Trainer.fit
def fit(self, *args, **kwargs):
    for cb in self.callbacks:
        if type(cb).__module__.startswith("vitlab.callbacks"):
            for name in ("on_fit_start", "on_train_epoch_end"):
                if name in type(cb).__dict__:
                    setattr(cb, name, timed(getattr(cb, name)))
    self.callbacks.append(PhaseTimer())
    out = fit_method(self, *args, **kwargs)
    cpu["steps"] = self.global_step
    cpu["run_dir"] = self.logger.log_dir
    return out
pl.Trainer.fit = fit

from vitlab.cli import train_main
try:
    train_main(sys.argv[1:])
except SystemExit as exc:
    if exc.code:
        raise
cpu["total"] = time.process_time()  # the training process since it started, imports included
import torch
cpu["threads"] = torch.get_num_threads()
print("RESULT " + json.dumps(cpu))
"""

METRICS = {"detection": ("val/map_50", "val/mask_map_50", "val/map"), "segmentation": ("val/dice_lesion", "val/iou_lesion"),
           "volume": ("val/dice_lesion", "val/iou_lesion")}
GOALS = {"detection": ("val/map_50", 0.5), "segmentation": ("val/dice_lesion", 0.6), "volume": ("val/dice_lesion", 0.5)}


def run(task: str, save_dir: str, cache: str | None, seed: int | None = None) -> tuple[dict, float, float]:
    """One quickstart in a fresh process: its RESULT, wall seconds and CPU seconds (with its workers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if cache:
        env["VITLAB_CACHE"] = cache
    args = ["--config", f"configs/quickstart_{task}.yaml", "--trainer.logger.init_args.save_dir", save_dir,
            "--trainer.enable_progress_bar", "false", *([] if seed is None else ["--seed_everything", str(seed)])]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"quickstart_{task} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(line[len("RESULT "):]), wall, cpu


def final_metrics(run_dir: str, tags: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(last, best) of each validation scalar in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: (acc.Scalars(t)[-1].value, max(e.value for e in acc.Scalars(t))) for t in tags}


def head_step_ratio(steps: int = 12, repeats: int = 3) -> None:
    """CPU per training step: the quickstart's ``head_kwargs`` vs ``light``'s defaults (same batches, interleaved)."""
    import torch
    import yaml

    from vitlab.data import DenseDataModule
    from vitlab.training import DetectionModule

    torch.set_num_threads(1)  # as in a quickstart run on 2 cores (one thread beside one loader worker)
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart_detection.yaml").read_text())
    data = DenseDataModule(**{**cfg["data"], "num_workers": 0})
    data.setup("fit")
    batches = iter(data.train_dataloader())
    batches = [next(batches) for _ in range(steps + 2)]
    runs = {}
    for name, heads in (("light defaults", {}), ("quickstart head_kwargs", cfg["model"]["head_kwargs"])):
        torch.manual_seed(0)
        module = DetectionModule(num_classes=1, image_size=cfg["data"]["image_size"],
                                 **{**cfg["model"], "head_kwargs": heads}).train()
        runs[name] = (module.model, torch.optim.AdamW(module.parameters(), lr=1e-3), [])

    def step(model, optimizer, batch) -> None:
        images, targets = batch
        loss = sum(model(list(images), targets).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for model, optimizer, _ in runs.values():
        for batch in batches[:2]:  # warm-up
            step(model, optimizer, batch)
    for _ in range(repeats):
        for model, optimizer, times in runs.values():
            start = time.process_time()
            for batch in batches[2:]:
                step(model, optimizer, batch)
            times.append((time.process_time() - start) / steps)
    base = min(runs["light defaults"][2])
    for name, (_, _, times) in runs.items():
        print(f"detection training step, {name:22s}: {min(times) * 1e3:6.1f} ms CPU  ({min(times) / base:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", nargs="+", choices=sorted(METRICS), default=sorted(METRICS))
    parser.add_argument("--fresh-cache", action="store_true", help="generate the embedded set anew (a new user's first run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="run each quickstart once per seed (default: its config's)")
    opts = parser.parse_args()
    print(f"machine: {len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()[0]:.1f} "
          "(shared: wall time is an upper bound, CPU time is not inflated by other jobs)")
    with tempfile.TemporaryDirectory(prefix="vitlab-bench-dense-") as tmp:
        if "detection" in opts.task:
            head_step_ratio()
        for task, seed in [(t, s) for t in opts.task for s in (opts.seeds or [None])]:
            cache = str(Path(tmp) / f"cache-{task}-{seed}") if opts.fresh_cache else None
            result, wall, cpu = run(task, str(Path(tmp) / "runs"), cache, seed)
            main_cpu = result["total"]
            phases = {k: result[k] for k in ("train steps", "validation", "Q/K/V callbacks")}
            phases["rest of the training process"] = main_cpu - sum(phases.values())
            phases["data workers (and other children)"] = cpu - main_cpu
            quiet = max(cpu / 2, main_cpu / result["threads"])
            print(f"\nquickstart_{task}{'' if seed is None else f' seed {seed}'}: {wall:6.1f} s wall, {cpu:6.1f} CPU-s -> about {quiet:5.1f} s on 2 quiet cores"
                  f" ({result['steps']} optimizer steps; load average now {os.getloadavg()[0]:.1f})")
            for name, seconds in phases.items():
                print(f"  {name:34s} {seconds:6.1f} CPU-s  {100 * seconds / cpu:5.1f} %")
            for tag, (last, best) in final_metrics(result["run_dir"], METRICS[task]).items():
                print(f"  {tag:34s} last {last:.3f}  best {best:.3f}")
            tag, goal = GOALS[task]
            last = final_metrics(result["run_dir"], (tag,))[tag][0]
            print(f"  goal: {tag} >= {goal} ({'met' if last >= goal else 'NOT met'}), <= 300 s on 2 quiet cores "
                  f"({'met' if quiet <= 300 else 'NOT met'})")


if __name__ == "__main__":
    main()
