"""vitlab on one GPU against a bare bf16 loop of the same model, side by side on the same machine.

    python benchmarks/bench_gpu.py [--task vit swinunetr] [--epochs 3] [--train-images 5120] [--volumes 48]
                                   [--variants memdata nocallbacks gpuspectra compile nondeterministic onethread loadernorm
                                    cudagraphs graphsonly]
                                   [--out DIR]
    python benchmarks/bench_gpu.py --smoke   # tiny models on the CPU: checks the script itself, measures nothing
                                             # (the Q/K/V work and checkpoints on their threads, as beside a GPU)

What it runs (about 5 minutes on one H100 / H200):

1. **Data made on this machine**, by vitlab's synthetic generators in one process per core: ``--train-images``
   plus a quarter as many validation slices of 224 px DICOM (ViT), ``--volumes`` CT volumes of 112^3 voxels at
   the SwinUNETR recipe's spacing (1.5 x 1.5 x 2 mm).
2. **Bare loops** in this process: the same model (``vitlab.models.build_model``, so the same architecture and
   drop path), the same batch, bf16 autocast, AdamW with fused kernels, cross-entropy (MONAI's ``DiceCELoss`` for
   SwinUNETR), random tensors already on the GPU; nothing else. Training images/s and (ViT) the forward-only
   images/s a validation pass would reach. SwinUNETR's bare loop runs twice: with the shifted-window masks that
   ``build_model`` keeps (the model vitlab trains: the ratio is the framework's cost) and with MONAI's own
   ``compute_mask``, which makes them again at every forward (a plain MONAI loop: the ratio is what a user gains or
   loses against it).
3. **vitlab runs**, each ``python train.py``'s fit in a fresh process (``vitlab.cli.fit``): ViT-B/16 at 224 with
   batch 64 from ``configs/medical_vit.yaml`` (random init, bf16-mixed), SwinUNETR feature size 48 on random
   96^3 patches with batch 2 from ``configs/medical_swinunetr.yaml`` (bf16-mixed), ``runtime: auto``, for
   ``--epochs`` epochs; the first is the warm-up and is left out. Per epoch, with the GPU synchronised at the
   epoch's edges only: images/s of the training steps (first batch start to last batch end, before the epoch's
   validation), whole-epoch images/s (epoch start to the next epoch start, or for the last epoch to the end of
   training: validation, callbacks and checkpoints included) and the epoch's seconds split into steps, validation
   and the rest; the fit's end apart (once a fit: the teardown waits for the background work still queued, the
   last epochs' Q/K/V work and checkpoint writes, and the figures); the training loop's
   wait for batches per step, the seconds the Q/K/V callbacks take in the training thread per epoch and at fit
   start, the seconds the epoch's checkpoints take, the background threads' work (the seconds of Q/K/V work and of
   checkpoint writing running in the epoch, and how long after an epoch's end its Q/K/V work is done: beyond an
   epoch, the next epoch's end waits for it), and the peak GPU memory. With py-spy on ``PATH`` the default runs
   are sampled for 2 s a quarter into the first epoch (left out of the figures; ``py-spy record --nonblocking``,
   every thread, once for the threads on a CPU and once for the thread holding the interpreter's lock): the share
   of that time the training thread ran and held the lock, the lock's other holders by thread name, and the
   training thread's innermost frames (``pyspy_<task>_{active,gil}.txt`` beside the results). The default runs
   also run a paired probe in their last epoch (the first in a 2-epoch run, whose last epoch is profiled): between
   consecutive training steps (up to 8 pairs, each step synchronised at both ends, left out of the epoch's figures)
   the training thread runs one step of the bare loop (its own copy of the network, built at the train start), the
   fit's loader workers and threads running as they do. vitlab's step against that bare step says what the fit's
   step itself costs; that bare step against the bare loop's step in a process of its own says what the fit's
   process costs any step (its cores, threads and interpreter's lock): which of the two holds an eager step below
   the bare loop's speed. The default runs
   also profile 5 steps in the middle of the second epoch (``torch.profiler``, tables written beside the results); those steps, the
   profiler's start and stop and the tables' writing are left out of that epoch's figures (the time left out is
   printed).
4. **Variants** (``--variants``): ``memdata`` the same ViT run fed four training batches made once and kept in
   pinned memory (no loader: the difference is the loader's share of the step); ``nocallbacks`` the same ViT run without the Q/K/V callbacks (the difference in
   epoch time is their whole cost, the GPU's share included); ``gpuspectra`` with the QK spectra's eigenproblems
   solved on the GPU (``QKSpectra(device="weights")``) instead of the host's cores; ``compile`` both runs with
   ``model.compile: true``; ``nondeterministic`` SwinUNETR with ``trainer.deterministic: false`` beside the recipe's ``warn``; ``onethread`` the ViT run with
   ``runtime.threads: 1`` (the Q/K/V spectra's host work on one core, leaving the others to the loader);
   ``loadernorm`` the ViT run with its batches normalised by the loader workers, as before (beside a GPU they leave the
   final Normalize to the device: a gray slice travels with one channel instead of three); ``cudagraphs``
   both runs with ``model.compile: {mode: reduce-overhead}`` (the compiled forward and backward replayed as CUDA
   graphs: one launch where the host launched hundreds of kernels; the first epoch, left out, compiles);
   ``graphsonly`` both runs with ``model.compile: {backend: cudagraphs}`` (torch's own kernels, traced by dynamo and
   AOTAutograd and replayed as CUDA graphs, with no code generated: the host's launches saved at a fraction of
   inductor's compilation; its first epoch's seconds say what that fraction is). The variants run in the order
   given, each for ViT then SwinUNETR where it applies.

It prints a line per run as the run ends (with the whole-epoch ratio, over the epochs and each epoch after the
first; validation's seconds, its waits for batches and its images/s against the bare forward; the first epoch's
seconds, which hold any compilation, and for a compiled run the graphs dynamo compiled and the guards that made it
compile again), then one table: each measure, vitlab against the bare loop, and the ratios the targets are stated in
(training steps >= 0.9x the bare loop; whole ViT epochs >= 0.8x the bare loop's time for the same training and
validation images; Q/K/V callbacks <= 1 % of a ViT epoch; loader wait <= 5 % of the step time), and writes it as
JSON to ``--out``. Without a CUDA GPU it says so in one line and exits 0; without one of vitlab's dependencies it
names the missing ones in one line and exits 2.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "timm", "pytorch_lightning", "torchmetrics", "albumentations", "pydicom", "nibabel", "monai",
          "jsonargparse", "lightly", "pycocotools", "safetensors", "tensorboard", "matplotlib", "scipy", "sklearn")

# the two workloads: full scale, and a tiny one for --smoke (CPU, float32)
SIZES = {
    "full": {
        "vit": {"model": "vit_base_patch16_224", "kwargs": {"drop_path_rate": 0.1}, "image": 224, "chans": 3, "batch": 64},
        "swinunetr": {"kwargs": {"img_size": 96, "feature_size": 48, "depths": [2, 2, 2, 2], "num_heads": [3, 6, 12, 24],
                                 "drop_rate": 0.0}, "patch": 96, "volume": 112, "slices": 112, "batch": 2},
        "precision": "bf16-mixed", "bare_steps": 40, "slice_size": 224,
    },
    "smoke": {
        "vit": {"model": "vit_tiny_patch16_224", "kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
                                                            "num_heads": 2, "drop_path_rate": 0.1}, "image": 32, "chans": 3, "batch": 8},
        "swinunetr": {"kwargs": {"img_size": 32, "feature_size": 12, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1],
                                 "window_size": 4, "drop_rate": 0.0, "norm_name": ["group", {"num_groups": 4}]},
                      "patch": 32, "volume": 40, "slices": 40, "batch": 2},
        "precision": "32-true", "bare_steps": 3, "slice_size": 32,
    },
}

FIT_CHILD = r"""
import functools, json, sys, time
from vitlab.runtime import prepare_process
prepare_process()
import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loops import fetchers

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()

import os
PROFILE = os.environ.get("BENCH_PROFILE")  # a file for torch.profiler's tables of 5 steps in the middle of the second epoch
PYSPY = os.environ.get("BENCH_PYSPY")  # a file stem for py-spy's samples of the first epoch (py-spy on PATH)
PYSPY_SECONDS, PYSPY_RATE = 2, 200
# the paired probe (BENCH_PAIRED: the task; BENCH_SIZE: full or smoke): in the last epoch, a bare training step of the
# same network (bench_gpu.bare_setup: its own copy, random batch on the device, one AdamW group) run between
# consecutive training steps on the training thread, each synchronised at both ends, the fit's threads and loader
# workers running as they do: is a step slow in this process because of what the fit's step does, or because of
# the process it runs in?
PAIRED = os.environ.get("BENCH_PAIRED")
def streams_kept():  # (the bare steps draw their drop path from streams the fit's own draws do not see)
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [])

def start_py_spy():
    # two py-spy samplers of this process for PYSPY_SECONDS, every thread, the process not stopped (--nonblocking):
    # the threads on a CPU (stem_active.txt) and the thread holding the interpreter's lock (stem_gil.txt)
    import shutil, subprocess, threading
    tool = shutil.which("py-spy")
    if tool is None:
        return None
    for kind, flag in (("active", []), ("gil", ["--gil"])):
        PYSPY_PROCS.append(subprocess.Popen(
            [tool, "record", "--pid", str(os.getpid()), "-d", str(PYSPY_SECONDS), "-r", str(PYSPY_RATE), "--threads",
             "--nonblocking", "--format", "raw", "-o", f"{PYSPY}_{kind}.txt", *flag],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    return threading.get_native_id()
PYSPY_PROCS = []  # (waited for after the fit: their files are written when they end)
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
            "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::to", "aten::copy_", "Optimizer.step")

def write_profile(prof, steps):
    cuda = torch.cuda.is_available()
    averages = prof.key_averages()
    lines = [f"torch.profiler over {steps} training steps in the middle of the second epoch ({'CUDA' if cuda else 'CPU'})", "",
             "calls per step of the ops that synchronise or copy between host and device:"]
    for event in averages:
        if event.key in SYNC_OPS:
            lines.append(f"  {event.key:32s} {event.count / steps:8.2f} per step, host {event.cpu_time_total / steps / 1e3:8.3f} ms per step")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    lines += ["", f"top ops by {sort}:", averages.table(sort_by=sort, row_limit=25), "",
              "top ops by host time (cpu_time_total):", averages.table(sort_by="cpu_time_total", row_limit=25)]
    with open(PROFILE, "w") as f:
        f.write("\n".join(lines))

# the epoch-level hooks of every callback and of the module, and the logger's save, each timed on the host (no sync:
# a hook that waits, for the device or a thread, shows it): where the epoch's time outside its steps goes
EPOCH_HOOKS = ("on_train_epoch_start", "on_train_epoch_end", "on_validation_start", "on_validation_epoch_start",
               "on_validation_epoch_end", "on_validation_end", "on_save_checkpoint")
hooks = []  # (end, seconds, "Owner.hook")
def timer(fn, record):  # fn, each call's (end, seconds) handed to record, on the thread that makes it
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            record(end, end - start)
    return wrapper
def timed_hook(fn, key):
    return timer(fn, lambda end, seconds: hooks.append((end, seconds, key)))

class EpochTimer(pl.Callback):
    '''Per training epoch: its steps' span, the span to the next epoch start, images, loader wait, callbacks.'''
    def __init__(self):
        self.epochs, self.current, self.fit_start = [], None, {}
        self.prof, self.prof_first = None, 20
        self.pyspy_tid = None
        self.bare = None  # (step, batch size) of the paired probe, made at the train start (BENCH_PAIRED)
        self.pairs, self.pair_marks = [], None
    def setup(self, trainer, pl_module, stage):
        owners = [(type(cb).__name__, cb) for cb in trainer.callbacks if cb is not self] + [(type(pl_module).__name__, pl_module)]
        for name, owner in owners:
            for hook in EPOCH_HOOKS:
                fn = getattr(owner, hook, None)
                if callable(fn):
                    object.__setattr__(owner, hook, timed_hook(fn, f"{name}.{hook}"))
        for logger in trainer.loggers:
            object.__setattr__(logger, "save", timed_hook(logger.save, f"{type(logger).__name__}.save"))
    def on_train_start(self, trainer, pl_module):
        if PAIRED:  # (before the first epoch's clock starts: built and warmed up outside the epochs' figures)
            sys.path.insert(0, "benchmarks")
            from bench_gpu import SIZES, bare_setup
            try:  # (a probe that cannot run, out of memory say, leaves the run's own figures)
                with streams_kept(), torch.enable_grad():
                    model, step, x = bare_setup(PAIRED, SIZES[os.environ["BENCH_SIZE"]], pl_module.device.type)
                    for _ in range(3):
                        step()
                sync()
                self.bare = (step, len(x))
            except Exception as error:
                print(f"bench_gpu: the paired probe does not run: {type(error).__name__}: {error}", file=sys.stderr)
    def paired_window(self, trainer):
        # (epoch, the batches between which the bare steps run): the last epoch where it is not the profiled one, else
        # the first (left out of the figures; past py-spy's window), else after the profiled steps
        n, last = trainer.num_training_batches, trainer.max_epochs - 1
        profiled = min(1, last) if PROFILE else None
        epoch, start = (last, n // 4) if last != profiled else (0, n // 2) if last > 0 else (0, max(1, n // 2 - 2) + 5)
        pairs = max(0, min(8, n // 3, n - 1 - start))
        return epoch, range(start, start + pairs + 1) if pairs else range(0)
    def paired_probe(self, trainer, batch_idx, batch):
        # at the start of each batch in the window: the previous step's end (synchronised), then a bare step between
        # it and this one; the window's time, steps and images are left out of the epoch's figures
        if self.bare is None:
            return
        epoch, window = self.paired_window(trainer)
        if trainer.current_epoch != epoch or batch_idx not in window:
            return
        before = time.perf_counter()
        sync()
        now = time.perf_counter()
        if self.pair_marks is None:  # (the window's first synchronisation: its wait left out too)
            self.current.setdefault("excluded", []).append(
                {"kind": "paired", "seconds": now - before, "steps": 0, "images": 0, "gaps": (batch_idx - 1, batch_idx)})
        else:  # the vitlab step that just ended: (start, its hooks' end on the host clock)
            start, host_end = self.pair_marks
            with streams_kept(), torch.enable_grad():
                self.bare[0]()
                launched = time.perf_counter()
                sync()
            done = time.perf_counter()
            self.pairs.append({"epoch": trainer.current_epoch, "vitlab_s": now - start, "vitlab_host_s": host_end - start,
                               "bare_s": done - now, "bare_host_s": launched - now})
            self.current.setdefault("excluded", []).append({"kind": "paired", "seconds": done - start, "steps": 1,
                                                            "images": len(batch[0]), "gaps": (batch_idx - 1, batch_idx + 1)})
            now = time.perf_counter()
        self.pair_marks = (now, None) if batch_idx != window[-1] else None
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.pair_marks is not None and self.pair_marks[1] is None:
            self.pair_marks = (self.pair_marks[0], time.perf_counter())  # (no sync: the step's hooks have launched it)
        if self.prof is not None and batch_idx == self.prof_first + 4:
            sync()
            self.prof.__exit__(None, None, None)
            write_profile(self.prof, batch_idx - self.prof_first + 1)
            self.prof = None
            sync()  # (the profiled steps, the profiler and its tables are left out of the epoch's figures)
            window = next(w for w in reversed(self.current["excluded"]) if w["kind"] == "profile")
            window.update(seconds=time.perf_counter() - window.pop("start"), gaps=(self.prof_first, batch_idx + 1))
        if batch_idx + 1 >= trainer.num_training_batches:  # the last step's end (the epoch's validation runs next)
            sync()
            self.current["last"] = time.perf_counter()
    def on_sanity_check_start(self, trainer, pl_module):  # (with model.compile: the inference graph compiles here)
        self.sanity_start = time.perf_counter()
    def on_sanity_check_end(self, trainer, pl_module):
        sync()
        self.sanity_s = time.perf_counter() - self.sanity_start
    def on_validation_start(self, trainer, pl_module):
        if self.current is not None and not trainer.sanity_checking:
            sync()
            self.current["val_start"] = time.perf_counter()
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and self.current is not None and "val_start" in self.current and "val_first_s" not in self.current:
            sync()
            self.current["val_first_s"] = time.perf_counter() - self.current["val_start"]
    def on_validation_end(self, trainer, pl_module):
        if self.current is not None and "val_start" in self.current:
            sync()
            self.current["val_end"] = time.perf_counter()
            self.current["val_begin"] = self.current.pop("val_start")
            self.current["val_s"] = self.current["val_end"] - self.current["val_begin"]
    def on_train_epoch_start(self, trainer, pl_module):
        sync()
        now = time.perf_counter()
        if self.current is not None:
            self.current["epoch_s"] = now - self.current["start"]
            self.epochs.append(self.current)
        self.current = {"start": now, "images": 0, "steps": 0, "first": None, "last": None, "marks": []}
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.current["first"] is None:
            sync()
            self.current["first"] = time.perf_counter()
        self.paired_probe(trainer, batch_idx, batch)
        self.current["marks"].append(time.perf_counter())  # (host clock, no sync: the spread of the steps)
        self.current["images"] += len(batch[0])
        self.current["steps"] += 1
        # py-spy in the first epoch (left out of the figures), a quarter in: past the first steps' warm-up
        if PYSPY and trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches // 4:
            self.pyspy_tid = start_py_spy()
        # (the middle of the second epoch: past the work that the fit's start and the first epoch's end leave to threads)
        if PROFILE and trainer.current_epoch == min(1, trainer.max_epochs - 1) and batch_idx == max(1, trainer.num_training_batches // 2 - 2):
            self.prof_first = batch_idx
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            sync()
            self.current.setdefault("excluded", []).append({"kind": "profile", "start": time.perf_counter(), "steps": 5,
                                                            "images": 5 * len(batch[0])})
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
    def on_train_end(self, trainer, pl_module):  # the last epoch ends here: its epoch-end hooks and checkpoints are done
        sync()
        self.train_end = time.perf_counter()
        if self.current is not None:
            self.current["epoch_s"] = self.train_end - self.current["start"]
            self.epochs.append(self.current)
            self.current = None
    def on_fit_end(self, trainer, pl_module):  # (after the teardown: the run's background work drained, once a fit)
        sync()
        self.fit_end_s = time.perf_counter() - self.train_end if hasattr(self, "train_end") else 0.0

spans = {"fetch": [], "callbacks": [], "checkpoints": [], "fit_start": [], "ckpt_dump": [], "ckpt_io": []}
def timed(owner, name, key, store=spans):  # each call's (end, seconds) in store[key], on the thread that makes it
    setattr(owner, name, timer(getattr(owner, name), lambda end, seconds: store[key].append((end, seconds))))

from vitlab.callbacks import QKSpectra, QKVDrift, QKVSnapshot
from vitlab.checkpoint_writer import BackgroundCheckpointIO
from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector
timed(fetchers._PrefetchDataFetcher, "__next__", "fetch")
timed(ModelCheckpoint, "_save_checkpoint", "checkpoints")
timed(_CheckpointConnector, "dump_checkpoint", "ckpt_dump")
timed(BackgroundCheckpointIO, "save_checkpoint", "ckpt_io")

if os.environ.get("BENCH_MEMDATA"):  # training batches made once, in pinned memory: the loader's share of the step
    from vitlab.data.image_data import ImageData
    def memory_batches(self):
        real = self._loader("train", train=True)
        first = next(iter(real))
        batches = [tuple(t.clone().pin_memory() if torch.cuda.is_available() else t.clone() for t in first[:2])
                   for _ in range(4)]
        steps = len(real)
        class Batches:
            def __len__(self):
                return steps
            def __iter__(self):
                return (batches[i % len(batches)] for i in range(steps))
        return Batches()
    ImageData.train_dataloader = memory_batches
for cls in (QKVSnapshot, QKVDrift, QKSpectra):
    timed(cls, "on_train_epoch_end", "callbacks")
    timed(cls, "on_fit_start", "fit_start")

# the work left to background threads: each Q/K/V job (handed over, started, ended, its thread's CPU seconds) and
# each checkpoint write (its wait for the Q/K/V work it covers, then the file), on the threads that run them
background = {"qkv": [], "settle": [], "write": []}
from vitlab.callbacks import RuntimeCallback
from vitlab.qkv.worker import QKVWorker
_submit = QKVWorker.submit
def timed_submit(self, job):
    queued = time.perf_counter()
    kind = getattr(job, "__qualname__", "").split(".")[0] or "other"  # the callback that handed it in
    def run():
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return job()
        finally:
            background["qkv"].append((queued, start, time.perf_counter(), time.thread_time() - cpu, kind))
    return _submit(self, run)
QKVWorker.submit = timed_submit
if os.environ.get("BENCH_BACKGROUND"):  # (--smoke on the CPU: the Q/K/V work and the checkpoints on their threads, as beside a GPU)
    _init = QKVWorker.__init__
    QKVWorker.__init__ = lambda self, background: _init(self, True)
    _runtime_init = RuntimeCallback.__init__
    RuntimeCallback.__init__ = lambda self, figures="auto", workers=0, checkpoints="auto", **kw: _runtime_init(
        self, figures, workers, "background", **{"normalize": "device", **kw})  # (the batches normalised after the transfer too)
if os.environ.get("BENCH_NORMALIZE"):  # (the loadernorm variant: where the batches are normalised)
    _normalize_init = RuntimeCallback.__init__
    RuntimeCallback.__init__ = lambda self, *a, **kw: _normalize_init(self, *a, **{**kw, "normalize": os.environ["BENCH_NORMALIZE"]})
timed(RuntimeCallback, "_settle", "settle", background)
timed(BackgroundCheckpointIO, "_write", "write", background)

# the background threads' work in the epoch [start, end): seconds of Q/K/V jobs and checkpoint writes running in it
# (the writer's wait for the Q/K/V work a checkpoint covers counted apart), and how long after the epoch handed its
# Q/K/V work over the last of it was done (beyond the next epoch's length, the pipeline falls behind)
def background_work(start, end):
    def running(intervals):
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)
    handed = [j for j in background["qkv"] if start <= j[0] < end]
    by_kind = {}
    for j in background["qkv"]:
        if start <= j[1] < end:
            by_kind[j[4]] = by_kind.get(j[4], 0.0) + (j[2] - j[1])
    return {"qkv_busy_s": running([(j[1], j[2]) for j in background["qkv"]]), "qkv_jobs_s": by_kind,
            "qkv_cpu_s": sum(j[3] for j in background["qkv"] if start <= j[1] < end),
            "qkv_done_after_s": max(j[2] for j in handed) - min(j[0] for j in handed) if handed else 0.0,
            "write_s": running([(done - seconds, done) for done, seconds in background["write"]]),
            "settle_s": running([(done - seconds, done) for done, seconds in background["settle"]])}

def epoch_hooks(start, end):  # seconds per hook (called in [start, end)), those of 1 ms or more
    out = {}
    for done, seconds, key in hooks:
        if start <= done - seconds < end:
            out[key] = out.get(key, 0.0) + seconds
    return {key: round(value, 4) for key, value in sorted(out.items(), key=lambda kv: -kv[1]) if value >= 1e-3}

from vitlab.cli import fit
cli = fit(sys.argv[1:])
timer = next(cb for cb in cli.trainer.callbacks if isinstance(cb, EpochTimer))
for proc in PYSPY_PROCS:
    try:
        proc.wait(timeout=PYSPY_SECONDS + 10)
    except Exception:
        proc.kill()
out = []
for epoch in timer.epochs:
    end = epoch["start"] + epoch["epoch_s"]
    inside = lambda key, a=epoch["start"], b=end: [s for t, s in spans[key] if a <= t <= b]
    # the profiled window (the default run's second epoch) and the paired probe's steps (its last): their steps,
    # images and seconds are left out
    windows = epoch.get("excluded", [])
    left_out = {key: sum(w.get(key, 0) for w in windows) for key in ("seconds", "steps", "images")}  # (.get: a
    # profiled window the epoch ended inside)
    gaps = sorted(b - a for i, (a, b) in enumerate(zip(epoch["marks"], epoch["marks"][1:]))
                  if not any(w.get("gaps", (0, 0))[0] <= i < w.get("gaps", (0, 0))[1] for w in windows)) or [0.0]
    profiled = sum(w.get("seconds", 0.0) for w in windows if w["kind"] == "profile")
    out.append({"images": epoch["images"] - left_out["images"], "steps": epoch["steps"] - left_out["steps"],
                "train_s": epoch["last"] - epoch["first"] - left_out["seconds"], "profiled_s": profiled,
                "paired_left_out_s": left_out["seconds"] - profiled,
                "val_s": epoch.get("val_s", 0.0), "median_step_s": gaps[len(gaps) // 2], "p90_step_s": gaps[int(0.9 * (len(gaps) - 1))],
                "to_first_s": epoch["first"] - epoch["start"], "after_val_s": end - epoch.get("val_end", epoch["last"]),
                "val_first_s": epoch.get("val_first_s", 0.0), "hooks_s": epoch_hooks(epoch["start"], end),
                "epoch_s": epoch["epoch_s"] - left_out["seconds"], "callbacks_s": sum(inside("callbacks")),
                # the loader's waits: in the training steps, and in validation (apart)
                "fetch_s": sum(inside("fetch", epoch["start"], epoch["last"])),
                "val_fetch_s": sum(inside("fetch", epoch["val_begin"], epoch["val_end"])) if "val_end" in epoch else 0.0,
                "checkpoints_s": sum(inside("checkpoints")), "ckpt_dump_s": sum(inside("ckpt_dump")),
                "ckpt_io_s": sum(inside("ckpt_io")), **background_work(epoch["start"], end)})
memory = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
sys.path.insert(0, "benchmarks")  # (the child runs in the repository root)
from bench_gpu import compile_stats
print("RESULT " + json.dumps({"epochs": out, "compile": compile_stats(), "sanity_s": getattr(timer, "sanity_s", 0.0), "fit_start_callbacks_s": sum(s for _, s in spans["fit_start"]),
                              "fit_end_s": getattr(timer, "fit_end_s", 0.0),
                              "background_writes": len(background["write"]), "qkv_jobs": len(background["qkv"]),
                              "threads": torch.get_num_threads(), "workers": cli.datamodule.num_workers, "peak_gib": memory,
                              "pyspy_tid": timer.pyspy_tid, "paired": timer.pairs, "pyspy_window": [PYSPY_SECONDS, PYSPY_RATE],
                              "val_images": len(cli.datamodule.samples("val"))}))
"""


def compile_stats() -> dict | None:
    """What ``torch.compile`` did in this process: the graphs dynamo compiled, and each time it compiled a function
    again, the guards of the earlier graphs that failed (dynamo's own words: a changed grad mode, a batch size outside
    a graph's range, ...). None where nothing was compiled."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters, guard_failures

    graphs = counters["stats"]["unique_graphs"]
    if not graphs:
        return None
    again = [f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno}): {reason.strip()}"
             for code, reasons in guard_failures.items() for reason in reasons]
    # graphs run without CUDA graphs under mode reduce-overhead or backend cudagraphs (TORCH_LOGS=cudagraphs says why)
    return {"graphs": graphs, "recompiled": again, "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def compile_line(stats: dict | None) -> str:
    """``compile_stats`` in words ("" where nothing was compiled)."""
    if not stats:
        return ""
    again = stats.get("recompiled", [])
    skips = stats.get("cudagraph_skips", 0)
    return (f"; compiled {stats['graphs']} graph(s)"
            + (f", {skips} run without CUDA graphs (TORCH_LOGS=cudagraphs says why)" if skips else "")
            + (f", {len(again)} guard failure(s) before compiling again: " + "; ".join(again[:6])
               + (f"; ... {len(again) - 6} more" if len(again) > 6 else "") if again else ""))


def missing_dependencies() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


# ---------------------------------------------------------------------------------------------- data
def _slices_shard(args: tuple[str, int, int, int]) -> str:
    from vitlab.data.synthetic import generate

    out, seed, patients, size = args
    return str(generate(out, seed=seed, patients=patients, slices=6, size=size))


def _volumes_shard(args: tuple[str, int, int, int, int]) -> str:
    from vitlab.data.synthetic import generate_volumes

    out, seed, patients, size, slices = args
    return str(generate_volumes(out, seed=seed, patients=patients, size=size, slices=slices, spacing=(1.5, 1.5, 2.0)))


def make_data(kind: str, root: Path, count: int, size: dict, processes: int) -> Path:
    """``count`` training items (and a quarter more for validation) in shards written in parallel; one manifest."""
    shards = max(1, min(processes * 2, count // 8))
    if kind == "vit":
        patients = max(2, -(-int(count * 1.25) // (6 * shards)))
        jobs = [(str(root / f"s{i:02d}"), i, patients, size["slice_size"]) for i in range(shards)]
        work = _slices_shard
    else:
        patients = max(1, -(-count // shards))
        volume = size["swinunetr"]
        jobs = [(str(root / f"s{i:02d}"), i, patients, volume["volume"], volume["slices"]) for i in range(shards)]
        work = _volumes_shard
    with ProcessPoolExecutor(max_workers=min(processes, shards)) as pool:
        manifests = list(pool.map(work, jobs))
    rows, header = [], None
    for manifest in manifests:
        with open(manifest, newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader)
            for row in reader:
                shard = Path(manifest).parent.name
                rows.append([f"{shard}/{v}" if k in ("path", "mask") and v else v for k, v in zip(header, row)])
    combined = root / "manifest.csv"
    with open(combined, "w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    return combined


# ---------------------------------------------------------------------------------------------- bare loops
def bare_setup(kind: str, size: dict, device: str):
    """The bare loop's network, one training step of it (forward, loss and backward under bf16 autocast, fused AdamW,
    one parameter group) and its input batch, random tensors already on the device: ``(model, step, x)``."""
    import torch

    from vitlab.models import build_model

    bf16 = size["precision"].startswith("bf16")
    spec = size[kind]
    if kind == "vit":
        model = build_model(spec["model"], num_classes=2, in_chans=spec["chans"], **spec["kwargs"]).to(device)
        x = torch.randn(spec["batch"], spec["chans"], spec["image"], spec["image"], device=device)
        y = torch.randint(0, 2, (spec["batch"],), device=device)
        loss_fn = torch.nn.functional.cross_entropy
    else:
        from monai.losses import DiceCELoss

        model = build_model("monai:swin_unetr", 2, 1, **spec["kwargs"]).to(device)
        p = spec["patch"]
        x = torch.randn(spec["batch"], 1, p, p, p, device=device)
        y = torch.randint(0, 2, (spec["batch"], 1, p, p, p), device=device)
        loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return model, step, x


def bare_loop(kind: str, size: dict, device: str, steps: int) -> dict[str, float]:
    """Training images/s of forward + backward + fused AdamW on random tensors on the device (and for ViT the
    forward-only images/s of a validation pass)."""
    import torch

    torch.manual_seed(0)
    bf16 = size["precision"].startswith("bf16")
    model, step, x = bare_setup(kind, size, device)
    out = {}

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def train_ips() -> float:
        for _ in range(max(3, steps // 4)):
            step()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return steps * len(x) / (time.perf_counter() - start)

    if kind == "swinunetr":  # a plain MONAI loop first: its masks made at every forward
        from monai.networks.nets import swin_unetr

        kept = swin_unetr.compute_mask
        swin_unetr.compute_mask = kept.__wrapped__
        try:
            out["monai_masks_train_ips"] = train_ips()
        finally:
            swin_unetr.compute_mask = kept
    out["train_ips"] = train_ips()
    if kind == "vit":
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            for _ in range(3):
                model(x)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                model(x)
            sync()
        out["eval_ips"] = steps * len(x) / (time.perf_counter() - start)
    del model, step
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- vitlab runs
# the tasks each variant runs for (the rest are about the ViT run's loader, callbacks or threads)
VARIANT_TASKS = {"nondeterministic": ("swinunetr",), "compile": ("vit", "swinunetr"), "cudagraphs": ("vit", "swinunetr"),
                 "graphsonly": ("vit", "swinunetr")}
VARIANT_TASKS.update({v: ("vit",) for v in ("memdata", "nocallbacks", "gpuspectra", "onethread", "loadernorm")})
def vitlab_args(kind: str, variant: str, manifest: Path, save_dir: Path, size: dict, epochs: int, accelerator: str) -> list[str]:
    spec = size[kind]
    common = ["--trainer.max_epochs", str(epochs), "--trainer.accelerator", accelerator, "--trainer.devices", "1",
              "--trainer.precision", size["precision"], "--trainer.logger.init_args.save_dir", str(save_dir),
              "--trainer.logger.init_args.name", f"{kind}-{variant}", "--trainer.enable_model_summary", "false",
              "--data.root", str(manifest), "--data.batch_size", str(spec["batch"])]
    if kind == "vit":
        args = ["--config", str(ROOT / "configs" / "medical_vit.yaml"), "--model.model_name", spec["model"],
                "--model.pretrained", "false", "--model.model_kwargs", json.dumps(spec["kwargs"]),
                "--data.image_size", str(spec["image"]), "--data.val_fraction", "0.2", *common]
    else:
        p = spec["patch"]
        args = ["--config", str(ROOT / "configs" / "medical_swinunetr.yaml"), "--model.weights", "null",
                "--model.model_kwargs", json.dumps(spec["kwargs"]), "--model.sliding_window", json.dumps([p, p, p]),
                "--data.patch_size", json.dumps([p, p, p]), "--data.val_fraction", "0.1", "--trainer.limit_val_batches", "0",
                *common]
    if variant == "compile":
        args += ["--model.compile", "true"]
    if variant == "cudagraphs":  # compiled, and the compiled graphs replayed as CUDA graphs (the host launches one)
        args += ["--model.compile", json.dumps({"mode": "reduce-overhead"})]
    if variant == "graphsonly":  # the same CUDA graphs of torch's own kernels: traced, no code generated
        args += ["--model.compile", json.dumps({"backend": "cudagraphs"})]
    if variant == "nondeterministic":
        args += ["--trainer.deterministic", "false"]
    if variant == "onethread":  # the host's share of the Q/K/V work (spectra) on one core instead of runtime: auto's
        args += ["--runtime.threads", "1"]
    callbacks = [{"class_path": "__main__.EpochTimer"}]  # (first: its epoch-end hook runs before the others')
    if variant != "nocallbacks":
        # figures after the first and the last epoch only, as in a long run (by default about 5 sets a run: after
        # every epoch of a 3-epoch one); epochs 2..3 then hold one epoch with figures and one without
        callbacks += [{"class_path": "vitlab.callbacks.QKVSnapshot"}] + [
            {"class_path": f"vitlab.callbacks.{name}", "init_args": {"figures_every_n_epochs": 1000}} for name in ("QKVDrift", "QKSpectra")]
    if variant == "gpuspectra":  # the eigenproblems on the GPU instead of the host's cores
        callbacks[-1]["init_args"]["device"] = "weights"
    callbacks.append({"class_path": "pytorch_lightning.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "epoch"}})
    return args + ["--trainer.callbacks", json.dumps(callbacks)]


def vitlab_run(args: list[str], profile: Path | None = None, memdata: bool = False, background: bool = False,
               normalize: str | None = None, pyspy: Path | None = None, paired: tuple[str, str] | None = None) -> dict | None:
    """One vitlab fit in a fresh process; ``None`` (its error printed) when it fails, so the other runs still run.
    ``background``: the Q/K/V work and the checkpoints on their threads even without a GPU (the smoke test);
    ``paired``: (task, ``SIZES`` key) of the bare steps run between the last epoch's steps (the paired probe)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1"}
    if background:
        env["BENCH_BACKGROUND"] = "1"
    if profile is not None:
        env["BENCH_PROFILE"] = str(profile)
    if pyspy is not None:
        env["BENCH_PYSPY"] = str(pyspy)
    if memdata:
        env["BENCH_MEMDATA"] = "1"
    if normalize is not None:
        env["BENCH_NORMALIZE"] = normalize
    if paired is not None:
        env["BENCH_PAIRED"], env["BENCH_SIZE"] = paired
    proc = subprocess.run([sys.executable, "-c", FIT_CHILD, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(f"bench_gpu: the vitlab run failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(line[len("RESULT "):])


BACKGROUND = ("qkv_busy_s", "qkv_cpu_s", "qkv_done_after_s", "write_s", "settle_s")  # per epoch (see FIT_CHILD)


def summarise(run: dict) -> dict[str, float]:
    """Means over the epochs after the first (the warm-up)."""
    epochs = run["epochs"][1:] or run["epochs"]
    images = sum(e["images"] for e in epochs)
    steps = sum(e["steps"] for e in epochs)
    train_s, epoch_s = sum(e["train_s"] for e in epochs), sum(e["epoch_s"] for e in epochs)
    return {"train_ips": images / train_s, "epoch_ips": images / epoch_s, "epoch_s": epoch_s / len(epochs),
            "images_per_epoch": images / len(epochs), "fetch_ms_per_step": 1e3 * sum(e["fetch_s"] for e in epochs) / steps,
            "step_ms": 1e3 * train_s / steps, "val_s": sum(e.get("val_s", 0.0) for e in epochs) / len(epochs),
            "val_fetch_s": sum(e.get("val_fetch_s", 0.0) for e in epochs) / len(epochs),
            "first_epoch_s": run["epochs"][0]["epoch_s"], "sanity_s": run.get("sanity_s", 0.0),
            "train_s": train_s / len(epochs), "median_step_ms": 1e3 * statistics.median(e.get("median_step_s", 0.0) for e in epochs),
            "p90_step_ms": 1e3 * statistics.median(e.get("p90_step_s", 0.0) for e in epochs),
            "to_first_s": sum(e.get("to_first_s", 0.0) for e in epochs) / len(epochs),
            "val_first_s": sum(e.get("val_first_s", 0.0) for e in epochs) / len(epochs),
            "qkv_jobs_s": {kind: sum(e.get("qkv_jobs_s", {}).get(kind, 0.0) for e in epochs) / len(epochs)
                           for kind in sorted({k for e in epochs for k in e.get("qkv_jobs_s", {})})},
            "hooks_s": dict(sorted(((key, sum(e.get("hooks_s", {}).get(key, 0.0) for e in epochs) / len(epochs))
                                    for key in {k for e in epochs for k in e.get("hooks_s", {})}), key=lambda kv: -kv[1])),
            "after_val_s": sum(e.get("after_val_s", 0.0) for e in epochs) / len(epochs), "callbacks_s_per_epoch": sum(e["callbacks_s"] for e in epochs) / len(epochs),
            "checkpoints_s_per_epoch": sum(e["checkpoints_s"] for e in epochs) / len(epochs),
            "ckpt_dump_s_per_epoch": sum(e.get("ckpt_dump_s", 0.0) for e in epochs) / len(epochs),
            "ckpt_io_s_per_epoch": sum(e.get("ckpt_io_s", 0.0) for e in epochs) / len(epochs),
            "profiled_s": sum(e.get("profiled_s", 0.0) for e in epochs) / len(epochs),
            **{key: sum(e.get(key, 0.0) for e in epochs) / len(epochs) for key in BACKGROUND},
            "qkv_done_after_max_s": max(e.get("qkv_done_after_s", 0.0) for e in epochs),
            "fit_start_callbacks_s": run["fit_start_callbacks_s"], "fit_end_s": run.get("fit_end_s", 0.0),
            "peak_gib": run["peak_gib"], "workers": run["workers"],
            "background_writes": run.get("background_writes", 0), "qkv_jobs": run.get("qkv_jobs", 0),
            "threads": run["threads"], "val_images": run["val_images"], "compile": run.get("compile"),
            "paired": paired_summary(run.get("paired") or []),
            "per_epoch": [{key: round(value, 4) if isinstance(value, float) else value for key, value in e.items()}
                          for e in run["epochs"]]}


def paired_summary(pairs: list[dict]) -> dict | None:
    """The paired probe's medians (ms): vitlab's step and the bare step run after it, each synchronised at both ends,
    and the host's share of each (until the step's hooks / the bare step's launches returned)."""
    if not pairs:
        return None
    medians = {f"{key[:-2]}_ms": 1e3 * statistics.median(p[key] for p in pairs)
               for key in ("vitlab_s", "vitlab_host_s", "bare_s", "bare_host_s")}
    return {"pairs": len(pairs), "epoch": pairs[0]["epoch"] + 1, **medians}


def paired_line(kind: str, run: dict) -> str:
    """What the paired probe says: the fit's step against a bare step in the same process, and that bare step against
    the bare loop's step in a process of its own (``bare_alone_ms``, this one's)."""
    p = run.get("paired")
    if not p:
        return ""
    alone = p["bare_alone_ms"]
    step, inside = p["vitlab_ms"] / p["bare_ms"], p["bare_ms"] / alone
    found = (["the fit's process slows a bare step too (around the step: cores, threads, the interpreter's lock)"]
             if inside > 1.15 else []) + (["the fit's own step costs more than the bare one beside it (its hooks, loader, "
                                           "logging)"] if step > 1.1 else [])
    verdict = "; and ".join(found) or "neither: the synchronised steps run as fast as a bare one"
    return (f"  {kind}: paired in the fit's process, epoch {p['epoch']}, {p['pairs']} pair(s), each step synchronised: "
            f"vitlab's step {p['vitlab_ms']:.1f} ms (its host {p['vitlab_host_ms']:.1f} ms) against a bare step "
            f"{p['bare_ms']:.1f} ms (its host {p['bare_host_ms']:.1f} ms) run after it = {step:.2f}x; that bare step "
            f"against the bare loop in its own process ({alone:.1f} ms) = {inside:.2f}x: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", nargs="+", choices=["vit", "swinunetr"], default=["vit", "swinunetr"])
    parser.add_argument("--epochs", type=int, default=3, help="epochs per vitlab run; the first is left out (default 3)")
    parser.add_argument("--train-images", type=int, default=5120, help="ViT training slices (a quarter more for validation)")
    parser.add_argument("--volumes", type=int, default=48, help="SwinUNETR training volumes (one random patch each per epoch)")
    parser.add_argument("--variants", nargs="*", default=["memdata", "nocallbacks", "gpuspectra", "compile", "nondeterministic"],
                        choices=["memdata", "nocallbacks", "gpuspectra", "compile", "nondeterministic", "onethread", "loadernorm",
                                 "cudagraphs", "graphsonly"],
                        help="runs beside the default ones")
    parser.add_argument("--out", type=Path, default=None, help="folder for the data, runs and bench_gpu.json (default: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and data on the CPU: checks this script, measures nothing")
    args = parser.parse_args()

    missing = missing_dependencies()
    if missing:
        print(f"bench_gpu: missing Python packages {', '.join(missing)}: install vitlab's dependencies "
              "(pip install -e . -c constraints.txt) or put their wheels on PYTHONPATH (benchmarks/gpu_wheels.py fetches "
              "them where an index is reachable)", file=sys.stderr)
        sys.exit(2)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing measured")
        return
    size = SIZES["smoke" if args.smoke else "full"]
    device, accelerator = ("cpu", "cpu") if args.smoke else ("cuda", "gpu")
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke test)"
    if args.smoke:
        args.train_images, args.volumes, args.epochs = min(args.train_images, 64), min(args.volumes, 4), min(args.epochs, 2)
    root = args.out or Path(tempfile.mkdtemp(prefix="vitlab-bench-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"bench_gpu: {card}, {cores} cores, torch {torch.__version__}; data and runs in {root}", flush=True)
    results: dict[str, dict] = {"card": card, "cores": cores}
    # the default runs first, then the variants: a run that fails or a time limit leaves the most important numbers
    plan = [(kind, "default") for kind in args.task]
    plan += [(kind, v) for v in args.variants for kind in args.task if kind in VARIANT_TASKS[v]]
    manifests: dict[str, Path] = {}
    for kind, variant in plan:
        if kind not in manifests:
            start = time.perf_counter()
            count = args.train_images if kind == "vit" else args.volumes
            manifests[kind] = make_data(kind, root / f"data-{kind}", count, size, cores)
            print(f"  {kind}: data made in {time.perf_counter() - start:.0f} s ({manifests[kind]})", flush=True)
            results[f"{kind}/bare"] = bare = bare_loop(kind, size, device, size["bare_steps"])
            print(f"  {kind}: bare loop {bare['train_ips']:.1f} images/s"
                  + (f" (with MONAI's masks made at every forward {bare['monai_masks_train_ips']:.1f})"
                     if "monai_masks_train_ips" in bare else ""), flush=True)
        profile = root / f"profile_{kind}.txt" if variant == "default" else None
        pyspy = root / f"pyspy_{kind}" if variant == "default" else None
        run = vitlab_run(vitlab_args(kind, variant, manifests[kind], root / "runs", size, args.epochs, accelerator), profile,
                         memdata=variant == "memdata", background=args.smoke, normalize="loader" if variant == "loadernorm" else None,
                         pyspy=pyspy, paired=(kind, "smoke" if args.smoke else "full") if variant == "default" else None)
        if run is None:
            continue
        results[f"{kind}/{variant}"] = summary = summarise(run)
        print(run_line(f"{kind}/{variant}", summary, results[f"{kind}/bare"]), flush=True)
        if summary["paired"]:
            summary["paired"]["bare_alone_ms"] = 1e3 * size[kind]["batch"] / results[f"{kind}/bare"]["train_ips"]
            print(paired_line(kind, summary), flush=True)
        if pyspy is not None and run.get("pyspy_tid") is not None:
            texts = [Path(f"{pyspy}_{k}.txt").read_text() if Path(f"{pyspy}_{k}.txt").exists() else "" for k in ("active", "gil")]
            summary["pyspy"] = py_spy_summary(*texts, run["pyspy_tid"], *run["pyspy_window"])
            print(py_spy_line(kind, summary["pyspy"]), flush=True)
        # (after every run: a time limit that stops the script later still leaves the runs done so far)
        (root / "bench_gpu.json").write_text(json.dumps(results, indent=1))
        if profile is not None and profile.exists():
            print(f"  {kind}: torch.profiler tables in {profile}", flush=True)
    report(results, args)
    (root / "bench_gpu.json").write_text(json.dumps(results, indent=1))
    print(f"bench_gpu: results in {root / 'bench_gpu.json'}")


def py_spy_samples(text: str) -> list[tuple[int, str, list[str], int]]:
    """py-spy's raw samples (``record --threads --format raw``): (thread id, thread name, frames outermost first, count)."""
    import re

    out = []
    for line in text.splitlines():
        found = re.search(r"thread \((\d+)\): ([^;]*)(.*) (\d+)$", line)
        if found:
            frames = [f for f in found.group(3).split(";") if f]
            out.append((int(found.group(1)), found.group(2).strip(), frames, int(found.group(4))))
    return out


def py_spy_summary(active: str, gil: str, tid: int, seconds: float, rate: int) -> dict:
    """Where the training thread (native id ``tid``) spent py-spy's window (``seconds`` sampled ``rate`` times a
    second): its samples on a CPU and holding the interpreter's lock, the lock's other holders (by thread name), and
    its top frames (innermost function) of each, as shares of the window."""
    from collections import Counter

    def tally(text):
        samples = py_spy_samples(text)
        total = sum(n for _, _, _, n in samples)
        ours = [(frames, n) for t, _, frames, n in samples if t == tid]
        others = Counter()
        for t, name, _, n in samples:
            if t != tid:
                others[name] += n
        top = Counter()
        for frames, n in ours:
            top[frames[-1] if frames else "?"] += n
        return total, sum(n for _, n in ours), others, top

    window = seconds * rate
    a_total, a_ours, a_others, a_top = tally(active)
    g_total, g_ours, g_others, g_top = tally(gil)
    return {"window_s": seconds, "window_samples": window, "active_samples": a_total, "gil_samples": g_total,
            "training_on_cpu": a_ours / window, "training_holds_lock": g_ours / window,
            "lock_held_by_others": {name: n / window for name, n in g_others.most_common(5)},
            "others_on_cpu": {name: n / window for name, n in a_others.most_common(5)},
            "training_top_on_cpu": {frame: n / window for frame, n in a_top.most_common(6)},
            "training_top_holding_lock": {frame: n / window for frame, n in g_top.most_common(6)}}


def py_spy_line(kind: str, spy: dict) -> str:
    if not spy["active_samples"] and not spy["gil_samples"]:
        return f"  {kind}: py-spy took no samples (not allowed to read the process?)"
    share = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items()) or "none"
    return (f"  {kind}: py-spy, {spy['window_s']:g} s of the first epoch: the training thread on a CPU {spy['training_on_cpu']:.0%} of the time, "
            f"holding the interpreter's lock {spy['training_holds_lock']:.0%}; the lock held by other threads: "
            f"{share(spy['lock_held_by_others'])}; other threads on a CPU: {share(spy['others_on_cpu'])}; the training "
            f"thread's innermost frames on a CPU: {share(spy['training_top_on_cpu'])}")


def bare_epoch_s(run: dict, bare: dict, epoch: dict | None = None) -> float:
    """The bare loop's seconds for an epoch's training images (``epoch``'s, else the run's mean) and its validation
    images (forward only, where the bare loop measured that)."""
    images = epoch["images"] if epoch is not None else run["images_per_epoch"]
    val = run.get("val_images", 0) / bare["eval_ips"] if "eval_ips" in bare and run.get("val_s") else 0.0
    return images / bare["train_ips"] + val


def run_line(name: str, run: dict, bare: dict) -> str:
    first = (run.get("per_epoch") or [{}])[0]
    per_epoch = " / ".join(f"{bare_epoch_s(run, bare, e) / e['epoch_s']:.2f}" for e in run.get("per_epoch", [])[1:] if e.get("epoch_s"))
    return (f"{name:28s} steps {run['train_ips']:8.1f} img/s = {run['train_ips'] / bare['train_ips']:5.2f}x bare "
            f"({bare['train_ips']:.1f})"
            + (f", {run['train_ips'] / bare['monai_masks_train_ips']:5.2f}x the bare loop with MONAI's own masks "
               f"({bare['monai_masks_train_ips']:.1f})" if "monai_masks_train_ips" in bare else "")
            + f"; whole epoch {run['epoch_ips']:8.1f} img/s = {bare_epoch_s(run, bare) / run['epoch_s']:.2f}x "
            f"the bare loop's time for its images (epochs 2..: {per_epoch or '-'}); step {run['step_ms']:6.1f} ms, "
            f"loader wait {run['fetch_ms_per_step']:5.2f} ms/step ({run['fetch_ms_per_step'] / run['step_ms']:5.1%}); "
            f"Q/K/V callbacks {run['callbacks_s_per_epoch']:5.3f} s/epoch ({run['callbacks_s_per_epoch'] / run['epoch_s']:5.1%}), "
            f"at fit start {run['fit_start_callbacks_s']:5.3f} s; checkpoints {run['checkpoints_s_per_epoch']:5.3f} s/epoch "
            f"(state {run.get('ckpt_dump_s_per_epoch', 0):5.3f} s, hand-over {run.get('ckpt_io_s_per_epoch', 0):5.3f} s); "
            f"{run['workers']} workers, {run['threads']} threads; peak {run['peak_gib']:.1f} GiB"
            + (" (the paired probe's copy of the network included)" if run.get("paired") else "") + f"; epoch {run['epoch_s']:.2f} s = "
            f"steps {run.get('train_s', 0):.2f} + validation {run.get('val_s', 0):.2f} (to its first batch "
            f"{run.get('val_first_s', 0):.2f}, waiting for batches {run.get('val_fetch_s', 0):.2f} in all"
            + (f", {run['val_images'] / run['val_s']:.0f} img/s = {run['val_images'] / run['val_s'] / bare['eval_ips']:.2f}x "
               f"the bare forward" if run.get("val_s") and "eval_ips" in bare else "")
            + f") + the rest "
            f"{run['epoch_s'] - run.get('train_s', 0) - run.get('val_s', 0):.2f} s (after validation {run.get('after_val_s', 0):.2f} s, "
            f"epoch start to first batch {run.get('to_first_s', 0):.2f} s); first epoch {run.get('first_epoch_s', 0):.1f} s "
            f"(steps {first.get('train_s', 0):.1f} + validation {first.get('val_s', 0):.1f} s"
            + (f", after Lightning's sanity check {run['sanity_s']:.1f} s" if run.get("sanity_s") else "")
            + f"; with compilation, if any{compile_line(run.get('compile'))}); step median {run.get('median_step_ms', 0):.1f} ms, "
            f"90th percentile {run.get('p90_step_ms', 0):.1f} ms; fit end {run.get('fit_end_s', 0):.2f} s (once a fit: the "
            f"background work drained); the slowest epoch-level hooks per epoch: "
            + (", ".join(f"{key} {seconds:.3f} s" for key, seconds in list(run.get("hooks_s", {}).items())[:6]) or "none")
            + (f"; left out: {run['profiled_s']:.2f} s/epoch of 5 profiled steps" if run.get("profiled_s") else "")
            + (f"; background threads per epoch: Q/K/V work {run['qkv_busy_s']:.2f} s ({run['qkv_cpu_s']:.2f} s of its thread's "
               f"CPU; " + ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in run.get("qkv_jobs_s", {}).items())
               + f"), done {run['qkv_done_after_s']:.2f} s after the hand-over (at most {run['qkv_done_after_max_s']:.2f} s), "
               f"checkpoint writes {run['write_s']:.2f} s (+ {run['settle_s']:.2f} s waiting for the Q/K/V work)"
               if "qkv_busy_s" in run else ""))


def report(results: dict, args) -> None:
    print(f"\nbench_gpu on {results['card']} ({results['cores']} cores); vitlab = mean of epochs 2..{args.epochs}")
    for kind in args.task:
        bare = results[f"{kind}/bare"]
        for name, run in results.items():
            if not name.startswith(f"{kind}/") or name.endswith("/bare"):
                continue
            print(run_line(name, run, bare))
            if run.get("paired"):
                print(paired_line(kind, run))
        if kind == "vit" and "eval_ips" in bare and "vit/default" in results:
            run = results["vit/default"]
            bare_epoch = bare_epoch_s(run, bare)
            print(f"vit whole epoch: {run['epoch_s']:.2f} s against the bare loop's {bare_epoch:.2f} s for the same training and "
                  f"validation images = {bare_epoch / run['epoch_s']:.2f}x (target >= 0.8x)")
            if "qkv_done_after_s" in run:
                behind = run["qkv_done_after_max_s"] > run["epoch_s"]
                print(f"vit Q/K/V work of an epoch: done {run['qkv_done_after_s']:.2f} s after the epoch handed it over (at most "
                      f"{run['qkv_done_after_max_s']:.2f} s) against an epoch of {run['epoch_s']:.2f} s: "
                      + ("it falls behind, and the next epoch's end waits for it" if behind else "it keeps up"))
            if "vit/nocallbacks" in results:
                cost = run["epoch_s"] - results["vit/nocallbacks"]["epoch_s"]
                print(f"vit Q/K/V callbacks' whole cost: {cost:+.3f} s per epoch = {cost / run['epoch_s']:+.1%} of it "
                      f"(epoch with them against without; target <= 1 %)")


if __name__ == "__main__":
    main()
