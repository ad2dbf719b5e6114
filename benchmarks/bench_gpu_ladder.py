"""Where a ViT-B training step's time goes: a ladder from the bare bf16 loop to vitlab's fit, one thing added a rung.

    python benchmarks/bench_gpu_ladder.py [--steps 60] [--profile FILE]
    python benchmarks/bench_gpu_ladder.py --smoke   # a tiny model on the CPU: checks the script, measures nothing

``bench_gpu.py`` says how far vitlab's training steps are from a bare loop; this says which layer costs what. Every
rung runs in this one process on the same random batches (made once: on the GPU for the bare loops, in pinned host
memory for the fits, as a loader hands them over), ``--steps`` timed steps after a warm-up, the GPU synchronised at
the edges only:

- ``bare``: ``vitlab.models.build_model`` (ViT-B/16, drop path 0.1), one AdamW group with fused kernels, bf16
  autocast, cross-entropy, batches already on the GPU (``bench_gpu.py``'s bare loop);
- ``bare + host batches``: the batch copied from pinned host memory each step (``non_blocking``);
- ``bare + groups``: vitlab's 28 parameter groups (layer decay 0.75, no decay on norms / biases) and the
  warm-up-cosine ``LambdaLR`` stepped every step;
- ``lightning, plain module``: a minimal ``LightningModule`` of the same model and single group under a
  ``Trainer`` (bf16-mixed, no logger, no checkpoints, no progress bar): Lightning's own cost;
- ``lightning, vitlab module``: vitlab's ``ClassificationModule`` (``configs/medical_vit.yaml``'s model arguments)
  under the same bare ``Trainer``: its groups, scheduler, label smoothing, ``self.log`` and per-epoch outputs;
- ``+ logger``: the same with TensorBoard logging every 10 steps and the learning-rate monitor;
- ``+ logger, bar``: and the progress bar ``train.py`` shows (:class:`vitlab.callbacks.LogStepProgressBar`), as
  ``train.py`` runs it (without the epoch-end Q/K/V callbacks and checkpoints: ``bench_gpu.py`` measures those);
- ``+ logger, bar, loss on the bar (before)``: the loss logged with ``prog_bar=True`` and Lightning's Rich bar, as
  vitlab did before: Lightning reads the loss off the device after every batch;
- ``+ logger, bar, a Python thread 10 % busy``: beside the steps, a thread that runs plain Python a tenth of the
  time (as the Q/K/V thread's tables or a progress bar's redraws do): what the interpreter's lock costs the step;
- ``train.py fit`` (in this process, then in new processes with one setting changed each): see the rungs' names.

Below the table: for the bare loops, the host's own time to launch one step when the GPU is idle (a loop whose
launch time is close to its step time has no host time to spare: anything added on the host slows it), and for
each fit its five slowest steps with their batch index (stalls at the logging steps, the 10th, 20th, ... batches,
or at the start) and the CPUs its training thread ran on. One new-process rung runs on the CPUs of the GPU's NUMA
node only (on a machine of several nodes, launches from the far node cross the processors' interconnect).
``--py-spy DIR`` (py-spy on ``PATH``): every thread's stack and 3 s of samples of the thread holding the
interpreter's lock, taken at each fit's first timed step, into DIR.

For each: images/s, the ratio to ``bare`` and the host's time per step (the training loop's wall time between
consecutive batch starts; when it equals the step time, the host is what the GPU waits for). ``--profile FILE``
writes cProfile tables (by own time and by cumulative time) of the ``+ logger, bar`` rung's timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "full": {"model": "vit_base_patch16_224", "kwargs": {"drop_path_rate": 0.1}, "image": 224, "batch": 64, "classes": 2,
             "precision": "bf16-mixed"},
    "smoke": {"model": "vit_tiny_patch16_224", "kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
                                                          "num_heads": 2, "drop_path_rate": 0.1},
              "image": 32, "batch": 8, "classes": 2, "precision": "32-true"},
}
MODULE_ARGS = {"lr": 1e-4, "weight_decay": 0.05, "layer_decay": 0.75, "warmup_epochs": 0.5, "label_smoothing": 0.1}


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def batches(size: dict, device: str, count: int = 4, pinned: bool = False):
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randn(size["batch"], 3, size["image"], size["image"], generator=g)
        y = torch.randint(0, size["classes"], (size["batch"],), generator=g)
        if pinned and device == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        elif not pinned:
            x, y = x.to(device), y.to(device)
        out.append((x, y))
    return out


def bare(size: dict, device: str, steps: int, host_batches: bool = False, groups: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from vitlab.models import build_model, parameter_groups
    from vitlab.training.base import warmup_cosine

    torch.manual_seed(0)
    model = build_model(size["model"], num_classes=size["classes"], in_chans=3, **size["kwargs"]).to(device)
    if groups:
        params = parameter_groups(model, weight_decay=MODULE_ARGS["weight_decay"], layer_decay=MODULE_ARGS["layer_decay"])
        for group in params:
            group["lr"] = MODULE_ARGS["lr"] * group.pop("lr_scale", 1.0)
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=MODULE_ARGS["lr"], **({"fused": True} if device == "cuda" else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, 10_000, 0.01)) if groups else None
    data = batches(size, device, pinned=host_batches)
    bf16 = size["precision"].startswith("bf16")

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        if host_batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y, label_smoothing=MODULE_ARGS["label_smoothing"] if groups else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()

    for i in range(max(5, steps // 4)):
        step(i)
    sync(device)
    marks = []
    start = time.perf_counter()
    for i in range(steps):
        marks.append(time.perf_counter())
        step(i)
    sync(device)
    out = step_stats(marks, time.perf_counter(), size["batch"])
    launches = []  # the host's own time per step: launching one step on an idle GPU (no queue ahead to wait for)
    for i in range(10):
        sync(device)
        begin = time.perf_counter()
        step(i)
        launches.append(time.perf_counter() - begin)
    sync(device)
    out["launch_ms"] = 1e3 * statistics.median(launches)
    return out


def lightning(size: dict, device: str, steps: int, module: str, extras: bool, bar: str | None = None,
              profile: Path | None = None, python_beside: float = 0.0) -> dict:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from vitlab.models import build_model

    warmup = max(5, steps // 4)
    data = batches(size, device, pinned=True)

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return warmup + steps + 1

        def __getitem__(self, i):
            return data[i % len(data)]

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(size["model"], num_classes=size["classes"], in_chans=3, **size["kwargs"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=MODULE_ARGS["lr"], **({"fused": True} if device == "cuda" else {}))

    class Timer(pl.Callback):
        def __init__(self):
            self.marks, self.start, self.profiler = [], None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                sync(device)
                self.start = time.perf_counter()
                if profile is not None:
                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
            if batch_idx >= warmup:
                self.marks.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, pl_module):
            sync(device)
            self.end = time.perf_counter()
            if self.profiler is not None:
                self.profiler.disable()

    torch.manual_seed(0)
    if module == "plain":
        net = Plain()
    else:
        from vitlab.training import ClassificationModule

        class OnTheBar(ClassificationModule):  # the loss logged with prog_bar=True, as before
            def log(self, name, value, *args, **kwargs):
                super().log(name, value, *args, **{**kwargs, "prog_bar": name == "train/loss" or kwargs.get("prog_bar", False)})

        net = (OnTheBar if module == "before" else ClassificationModule)(
            model_name=size["model"], num_classes=size["classes"], in_chans=3, pretrained=False, model_kwargs=size["kwargs"],
            **MODULE_ARGS)
    timer = Timer()
    callbacks = [timer]
    kwargs = {"logger": False, "enable_progress_bar": False}
    if extras:
        import tempfile

        from pytorch_lightning.callbacks import LearningRateMonitor, RichProgressBar
        from pytorch_lightning.loggers import TensorBoardLogger

        from vitlab.callbacks import LogStepProgressBar

        callbacks.append(LearningRateMonitor(logging_interval="step"))
        kwargs = {"logger": TensorBoardLogger(tempfile.mkdtemp(prefix="ladder-"), name="ladder", default_hp_metric=False),
                  "enable_progress_bar": bar is not None, "log_every_n_steps": 10}
        if bar is not None:
            callbacks.append(RichProgressBar() if bar == "lightning" else LogStepProgressBar())
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision=size["precision"],
                         max_epochs=1, limit_val_batches=0, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=callbacks, num_sanity_val_steps=0, **kwargs)
    loader = DataLoader(Batches(), batch_size=None, shuffle=False, num_workers=0)
    stop = None
    if python_beside:  # a thread running plain Python for that share of the time (the Q/K/V thread's tables, a bar's
        import threading   # redraws): each torch call of the training thread lets it take the interpreter's lock

        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                end = time.perf_counter() + 0.01 * python_beside
                while time.perf_counter() < end:
                    pass
                time.sleep(0.01 * (1.0 - python_beside))

        threading.Thread(target=busy, daemon=True).start()
    try:
        trainer.fit(net, loader)
    finally:
        if stop is not None:
            stop.set()
    timed = len(timer.marks)
    out = step_stats(timer.marks, timer.end, size["batch"], first=warmup)
    if profile is not None and timer.profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(timer.profiler, stream=text)
        text.write(f"cProfile of {timed} timed steps ({module} module, extras {extras}); per step divide by {timed}\n")
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(70)
        profile.write_text(text.getvalue())
    del trainer, net
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def step_stats(marks: list[float], end: float, batch: int, first: int = 0) -> dict:
    """images/s and step times (mean; median and 90th percentile of the intervals between batch starts); the five
    slowest steps as (batch index, ms), ``first`` being the index of the first timed batch."""
    intervals = [b - a for a, b in zip(marks, [*marks[1:], end])]
    steps = sorted(intervals)
    elapsed = end - marks[0]
    slowest = sorted(range(len(intervals)), key=lambda i: -intervals[i])[:5]
    return {"ips": len(marks) * batch / elapsed, "step_ms": 1e3 * elapsed / len(marks),
            "host_ms": 1e3 * statistics.median(steps), "p90_ms": 1e3 * steps[int(0.9 * (len(steps) - 1))],
            "slowest": [(first + i, round(1e3 * intervals[i], 1)) for i in slowest]}


def fit(size: dict, device: str, steps: int, extra: list[str], qkv: bool = False, epochs: int = 1) -> dict:
    """``train.py``'s fit (``vitlab.cli.fit``, ``configs/medical_vit.yaml``'s recipe, its runtime callback, checkpointers,
    logger and bar) on the rung's batches in pinned memory instead of its loader's (validation: two batches of the
    embedded data). The last epoch's steps are timed, up to its last batch (its validation runs after that): with
    ``epochs=2`` the work the first epoch's end leaves to background threads (Q/K/V spectra, the checkpoint
    writer) runs beside them. On a GPU the data module normalises every batch after its transfer, as in ``train.py``'s
    runs there (the rung's random batches of three channels, where a run's gray slices travel with one)."""
    import json
    import tempfile

    import torch

    from vitlab.cli import fit as cli_fit
    from vitlab.data.image_data import ImageData

    warmup = max(5, steps // 4)
    data = batches(size, device, pinned=True)

    class Batches:
        def __len__(self):
            return warmup + steps + 1

        def __iter__(self):
            return (data[i % len(data)] for i in range(len(self)))

    original = ImageData.train_dataloader
    ImageData.train_dataloader = lambda self: Batches()
    global _FIT_TIMER
    _FIT_TIMER = {"marks": [], "warmup": warmup, "device": device, "epoch": epochs - 1, "name": RUNG[0]}
    callbacks = [{"class_path": f"{__name__}.FitTimer"},
                 {"class_path": "pytorch_lightning.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}}]
    if qkv:
        callbacks += [{"class_path": f"vitlab.callbacks.{name}"} for name in ("QKVSnapshot", "QKVDrift", "QKSpectra")]
    save_dir = tempfile.mkdtemp(prefix="ladder-fit-")
    args = ["--config", str(ROOT / "configs" / "medical_vit.yaml"), "--model.model_name", size["model"],
            "--model.pretrained", "false", "--model.model_kwargs", json.dumps(size["kwargs"]),
            "--trainer.accelerator", "gpu" if device == "cuda" else "cpu", "--trainer.devices", "1",
            "--trainer.precision", size["precision"], "--trainer.max_epochs", str(epochs), "--trainer.limit_val_batches", "2",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
            "--trainer.logger.init_args.save_dir", save_dir, "--data.root", "null", "--data.image_size", str(size["image"]),
            "--data.in_chans", "3", "--data.batch_size", str(size["batch"]), "--trainer.callbacks", json.dumps(callbacks), *extra]
    try:
        cli_fit(args)
    finally:
        ImageData.train_dataloader = original
    if device == "cuda":
        torch.cuda.empty_cache()
    out = step_stats(_FIT_TIMER["marks"], _FIT_TIMER["end"], size["batch"], first=warmup)
    out["cpus"] = sorted(c for c in _FIT_TIMER.get("cpus", ()) if c is not None)  # where the training thread ran
    return out


def fresh_fit(smoke: bool, steps: int, extra: list[str], qkv: bool = False, epochs: int = 1, prepare: bool = True,
              cpus: list[int] | None = None) -> dict:
    """:func:`fit` in a new Python process, as ``train.py`` starts one (``prepare=False``: without
    ``vitlab.runtime.prepare_process``'s settings made before torch is imported)."""
    import json
    import os
    import subprocess

    spec = {"smoke": smoke, "steps": steps, "extra": extra, "qkv": qkv, "epochs": epochs, "prepare": prepare, "name": RUNG[0],
            "cpus": cpus}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"bench_gpu_ladder child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def current_cpu() -> int | None:
    """The CPU this thread runs on now (Linux: field 39 of /proc/thread-self/stat)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def gpu_numa_cpus() -> list[int]:
    """The CPUs of the NUMA node the GPU is attached to (from nvidia-smi's PCI bus id and sysfs), among those this
    process may use; empty when unknown (one node, no nvidia-smi)."""
    import os
    import subprocess

    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"], capture_output=True,
                             text=True, timeout=30).stdout.strip().lower()
        node = int(Path(f"/sys/bus/pci/devices/{bus[-12:]}/numa_node").read_text())
        cpulist = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return []
    return sorted(set(cpu_list(cpulist)) & os.sched_getaffinity(0))


def cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (sysfs's CPU lists) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs (sysfs; empty off Linux)."""
    nodes = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[int(path.name[4:])] = cpu_list((path / "cpulist").read_text())
    return nodes


def child(spec_json: str) -> None:
    import json
    import os

    spec = json.loads(spec_json)
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])  # (before anything starts a thread)
    if spec["prepare"]:
        from vitlab.runtime import prepare_process

        prepare_process()  # (what train.py does first, before torch is imported)
    size = SIZES["smoke" if spec["smoke"] else "full"]
    RUNG[0] = spec["name"]
    result = fit(size, "cpu" if spec["smoke"] else "cuda", spec["steps"], spec["extra"], spec["qkv"], spec["epochs"])
    print("RESULT " + json.dumps(result), flush=True)


_FIT_TIMER: dict = {}
RUNG = ["fit"]  # the rung running now (py-spy's file names)


def py_spy(name: str) -> None:
    """With ``--py-spy DIR`` (``LADDER_PY_SPY`` in a fit's process): every thread's stack now, then 3 s of samples of
    the thread holding the interpreter's lock (``py-spy record --gil --nonblocking``: the process is not stopped to
    be sampled, but its steps still pay for the reads), into DIR, in the background."""
    import os
    import re
    import shutil
    import subprocess

    folder = os.environ.get("LADDER_PY_SPY")
    tool = shutil.which("py-spy")
    if not folder or tool is None:
        return
    stem = Path(folder) / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
    pid = str(os.getpid())
    command = (f"'{tool}' dump --pid {pid} > '{stem}_dump.txt' 2>&1; '{tool}' record --pid {pid} -d 3 -r 250 --gil "
               f"--threads --nonblocking --format raw -o '{stem}_gil.txt' > /dev/null 2>&1")
    subprocess.Popen(["sh", "-c", command], start_new_session=True)


def _fit_timer():
    import pytorch_lightning as pl

    class FitTimer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch != _FIT_TIMER["epoch"]:
                return
            if batch_idx == _FIT_TIMER["warmup"]:
                sync(_FIT_TIMER["device"])
                py_spy(_FIT_TIMER.get("name", "fit"))
            if batch_idx >= _FIT_TIMER["warmup"]:
                _FIT_TIMER["marks"].append(time.perf_counter())
                _FIT_TIMER.setdefault("cpus", set()).add(current_cpu())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == _FIT_TIMER["epoch"] and batch_idx + 1 >= trainer.num_training_batches:
                sync(_FIT_TIMER["device"])  # (the epoch's validation runs after this, before the epoch-end hooks)
                _FIT_TIMER["end"] = time.perf_counter()

    return FitTimer


def __getattr__(name: str):  # (the CLI imports the timer callback by its class path)
    if name == "FitTimer":
        return _fit_timer()
    raise AttributeError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per rung (default 60; 8 with --smoke)")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile tables of the '+ logger, bar' rung's timed steps")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks this script, measures nothing")
    parser.add_argument("--py-spy", type=Path, default=None, help="a folder for py-spy's stacks and lock-holder samples "
                        "of each fit's first timed steps (py-spy on PATH)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (a fresh-process rung)
    args = parser.parse_args()
    if args.py_spy is not None:
        import os

        args.py_spy.mkdir(parents=True, exist_ok=True)
        os.environ["LADDER_PY_SPY"] = str(args.py_spy.resolve())  # (inherited by the new-process rungs)
    if args.child is not None:
        return child(args.child)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_ladder: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing measured")
        return
    size = SIZES["smoke" if args.smoke else "full"]
    device = "cpu" if args.smoke else "cuda"
    steps = args.steps or (8 if args.smoke else 60)
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke test)"
    from vitlab.runtime import available_cores

    cores = available_cores()
    nodes = numa_nodes()
    local_cpus = gpu_numa_cpus() if device == "cuda" else []
    print(f"NUMA nodes (CPUs): {nodes or 'unknown'}; the GPU's node's CPUs: {local_cpus or 'unknown'}", flush=True)
    rungs = [
        ("bare", lambda: bare(size, device, steps)),
        ("bare + host batches", lambda: bare(size, device, steps, host_batches=True)),
        ("bare + groups", lambda: bare(size, device, steps, groups=True)),
        ("lightning, plain module", lambda: lightning(size, device, steps, "plain", extras=False)),
        ("lightning, vitlab module", lambda: lightning(size, device, steps, "vitlab", extras=False)),
        ("+ logger", lambda: lightning(size, device, steps, "vitlab", extras=True)),
        ("+ logger, bar", lambda: lightning(size, device, steps, "vitlab", extras=True, bar="vitlab", profile=args.profile)),
        ("+ logger, bar, loss on the bar (before)", lambda: lightning(size, device, steps, "before", extras=True, bar="lightning")),
        ("+ logger, bar, a Python thread 10 % busy", lambda: lightning(size, device, steps, "vitlab", extras=True, bar="vitlab",
                                                                        python_beside=0.1)),
        ("train.py fit", lambda: fit(size, device, steps, [])),
        ("train.py fit, runtime.figures off", lambda: fit(size, device, steps, ["--runtime.figures", "off"])),
        ("train.py fit, torch threads = cores", lambda: fit(size, device, steps, ["--runtime.threads", str(cores)])),
        ("train.py fit, TensorBoard every step", lambda: fit(size, device, steps, ["--trainer.log_every_n_steps", "1"])),
        ("train.py fit + Q/K/V callbacks", lambda: fit(size, device, steps, [], qkv=True)),
        # a new process each, as train.py runs (these differ from the rungs above only by the process)
        ("new process: train.py fit", lambda: fresh_fit(args.smoke, steps, [])),
        ("new process: without prepare_process", lambda: fresh_fit(args.smoke, steps, [], prepare=False)),
        ("new process: runtime.threads 1", lambda: fresh_fit(args.smoke, steps, ["--runtime.threads", "1"])),
        ("new process: runtime.figures off", lambda: fresh_fit(args.smoke, steps, ["--runtime.figures", "off"])),
        ("new process: on the GPU's NUMA node", lambda: fresh_fit(args.smoke, steps, [], cpus=local_cpus or None)),
        ("new process: 2nd epoch", lambda: fresh_fit(args.smoke, steps, [], epochs=2)),
        ("new process: 2nd epoch, Q/K/V callbacks", lambda: fresh_fit(args.smoke, steps, [], qkv=True, epochs=2)),
    ]
    results = {}
    for name, run in rungs:
        RUNG[0] = name
        results[name] = result = run()
        print(f"  {name:40s} {result['ips']:8.1f} img/s  step {result['step_ms']:6.1f} ms  median {result['host_ms']:6.1f} ms"
              + (f"  launch on an idle GPU {result['launch_ms']:6.1f} ms" if "launch_ms" in result else ""),
              flush=True)  # (as each rung ends: a time limit that stops the ladder later leaves these)
    base = results["bare"]["ips"]
    print(f"\nbench_gpu_ladder on {card}, {size['model']} batch {size['batch']}, {size['precision']}, {steps} steps a rung")
    for name, result in results.items():
        print(f"  {name:40s} {result['ips']:8.1f} img/s = {result['ips'] / base:5.2f}x bare; step {result['step_ms']:6.1f} ms "
              f"(median {result['host_ms']:6.1f}, p90 {result.get('p90_ms', float('nan')):6.1f})")
    print("\nthe host's time to launch one step on an idle GPU (below the step time: the GPU sets the pace):")
    for name, result in results.items():
        if "launch_ms" in result:
            print(f"  {name:40s} {result['launch_ms']:6.1f} ms of {result['step_ms']:6.1f} ms")
    print("\nslowest steps of the fits (batch index: ms; the logging steps are the 10th, 20th, ... batches):")
    for name, result in results.items():
        if "fit" in name or "process" in name:
            print(f"  {name:40s} " + "  ".join(f"{i}: {ms}" for i, ms in result["slowest"])
                  + f"; training thread on CPU(s) {result.get('cpus')}")


if __name__ == "__main__":
    main()
