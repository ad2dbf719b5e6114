"""What the work a training run leaves to background threads costs a GPU training thread: the interpreter's lock,
measured on the CPU.

    python benchmarks/bench_beside_training.py [--repeats 3] [--seconds-per-epoch 2.16] [--only qkv|checkpoints]

Beside a GPU the Q/K/V callbacks' per-epoch work and the checkpoints' writing run on background threads of the
training process. The training thread launches an operation every few microseconds and releases the interpreter's
lock around each: whenever a background thread runs Python (or C code that keeps the lock), the training thread
waits for the lock at its next launch, and a GPU whose host falls behind idles. This measures that wait without a
GPU: a stand-in training thread runs small torch operations (each releases and takes back the lock, as a launch
does) while another thread runs the work, sized for ViT-B/16. The stall is the work's wall time less the time the
stand-in's operations would have taken alone (its rate measured alone, before). Side by side in one process:

- ``drift, table here``: the Q/K/V drift report (12 blocks of 768 x 768 Q, K, V, 12 heads; an epoch without
  figures) with its CSV table formatted in the thread (the worker on the CPU, and beside a GPU before the table
  worker);
- ``drift, table worker``: the same with the table handed to :class:`vitlab.table_worker.TableWorker` (a child
  process), as beside a GPU now;
- ``drift, figure epoch``: the same in an epoch that draws its figures (the drift maps and a heads x rows map per
  block, 15 figures), handed to a figure worker process, until they are written (the figure worker's threads in
  this process send them and write the images it returns; TensorBoard's writer thread checksums each record):
  ``before`` with TensorBoard's pure-Python checksums, ``now`` with ``train.py``'s in C
  (:func:`vitlab.outputs.tensorboard.fast_event_checksums`);
- ``spectra``: the QK spectra's eigenproblems on the host (LAPACK releases the lock) and their report;
- ``checkpoint, Lightning's writer``: a checkpoint of ViT-B/16 with its AdamW state (1.0 GB, as
  ``ModelCheckpoint`` saves one) written by Lightning's ``TorchCheckpointIO`` (pickled into an in-memory buffer,
  then written);
- ``checkpoint, vitlab's writer``: the same checkpoint as :class:`vitlab.checkpoint_writer.BackgroundCheckpointIO`
  writes it (``torch.save`` into the open file; the same bytes, checked).

A second probe separates the lock from the cores: a thread that sleeps 0.5 ms at a time (using no core worth
sharing) is late to wake by as long as the work holds the lock ("the lock held"). The busy stand-in's stall also
counts the cores the two threads share (on a 2-core machine, or two hyperthreads of one core, LAPACK slows the
stand-in without holding the lock) and the disk's; on a GPU machine's many cores the lock is what remains.

Each share divides by ``--seconds-per-epoch`` (default 2.16 s: 5,000 images at the bare bf16 loop's 2,310
images/s on an H200); the GPU target is 1 % of an epoch for the Q/K/V callbacks. A ViT-B run writes two such
checkpoints in an epoch whose best metric improves (the best and the last). On a machine of 2 shared cores
compare the rows, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vit_b_states():
    import torch

    g = torch.Generator().manual_seed(0)
    blocks = [f"blocks.{i}" for i in range(12)]
    ref = {}
    for b in blocks:
        for m in "qkv":
            ref[f"{b}.{m}.weight"] = 0.02 * torch.randn(768, 768, generator=g)
            ref[f"{b}.{m}.bias"] = torch.zeros(768)
    prev = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in ref.items()}
    cur = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in prev.items()}
    return ref, prev, cur, {b: 12 for b in blocks}


def stall(work, rate: float) -> tuple[float, float]:
    """(wall seconds of ``work`` on a thread, seconds the stand-in training thread lost meanwhile)."""
    import torch

    x = torch.zeros(4)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work(), done.set()), daemon=True)
    start = time.perf_counter()
    thread.start()
    ops = 0
    while not done.is_set():
        x.add_(1.0)
        ops += 1
    wall = time.perf_counter() - start
    thread.join()
    return wall, max(0.0, wall - ops / rate)


def vit_b_checkpoint():
    """A ViT-B/16 checkpoint as Lightning dumps one: the module's state dict, AdamW's state (two moments and a step
    count per parameter, 28 groups' worth of settings) and some plain values."""
    import torch

    from vitlab.models import build_model

    torch.manual_seed(0)
    model = build_model("vit_base_patch16_224", num_classes=2, in_chans=3)
    state = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    moments = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn_like(p) * 1e-3, "exp_avg_sq": torch.rand_like(p) * 1e-6}
               for i, p in enumerate(model.parameters())}
    groups = [{"lr": 1e-4 * 0.75 ** (i // 2), "weight_decay": 0.05 * (i % 2), "params": list(range(i, len(moments), 28))}
              for i in range(28)]
    return {"epoch": 3, "global_step": 400, "pytorch-lightning_version": "2.6", "state_dict": state,
            "optimizer_states": [{"state": moments, "param_groups": groups}], "lr_schedulers": [{"last_epoch": 400}],
            "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.9)}}}


def lock_held(work, idle_late: float) -> float:
    """Seconds ``work`` (on a thread) kept a sleeping probe from waking on time: a probe that wakes every 0.5 ms
    needs the interpreter's lock to go on, and uses no core worth sharing, so its lateness beyond an idle wake-up's
    (``idle_late``) is the time the work held the lock."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work(), done.set()), daemon=True)
    thread.start()
    late = 0.0
    while not done.is_set():
        start = time.perf_counter()
        time.sleep(0.0005)
        late += max(0.0, time.perf_counter() - start - 0.0005 - idle_late)
    thread.join()
    return late


def idle_lateness(seconds: float = 0.3) -> float:
    """A sleeping probe's lateness per wake-up when nothing else runs."""
    late, count, end = 0.0, 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        time.sleep(0.0005)
        late += time.perf_counter() - start - 0.0005
        count += 1
    return late / count


def solo_rate(seconds: float = 0.5) -> float:
    import torch

    x = torch.zeros(4)
    ops, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            x.add_(1.0)
        ops += 1000
    return ops / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row (the median is shown)")
    parser.add_argument("--seconds-per-epoch", type=float, default=2.16, help="the epoch the stall is a share of")
    parser.add_argument("--only", choices=["qkv", "checkpoints"], default=None, help="one kind of work only")
    args = parser.parse_args()
    import shutil

    import torch
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.checkpoint_writer import BackgroundCheckpointIO
    from vitlab.figure_worker import FigureWorker
    from vitlab.qkv.drift import report_drift
    from vitlab.qkv.spectra import block_spectra, report_spectra
    from vitlab.table_worker import TableWorker

    torch.set_num_threads(1)
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    from vitlab.outputs.tensorboard import fast_event_checksums

    python_crc = pywrap_tensorflow.masked_crc32c

    def checksums(fast: bool) -> None:  # (TensorBoard's pure-Python record checksums, or train.py's in C)
        if fast:
            fast_event_checksums()
        else:
            record_writer.masked_crc32c = pywrap_tensorflow.masked_crc32c = python_crc

    checksums(True)
    out = Path(tempfile.mkdtemp(prefix="bench-beside-"))
    rows = {}
    tables = writer = None
    if args.only in (None, "qkv"):
        ref, prev, cur, heads = vit_b_states()
        writer = SummaryWriter(str(out / "events"))
        tables, figures = TableWorker(), FigureWorker(process=True)
        rows.update({
            "drift, table here": lambda: report_drift(writer, ref, cur, prev, heads, 1, out / "drift_here.csv", 1, figures=False),
            "drift, table worker": lambda: report_drift(writer, ref, cur, prev, heads, 1, out / "drift_worker.csv", 1,
                                                        figures=False, tables=tables),
            "drift, figure epoch (before)": lambda: (checksums(False), report_drift(
                writer, ref, cur, prev, heads, 1, out / "drift_figures.csv", 1, figure_worker=figures, tables=tables),
                figures.flush(), checksums(True)),
            "drift, figure epoch (now)": lambda: (report_drift(writer, ref, cur, prev, heads, 1, out / "drift_figures.csv", 1,
                                                               figure_worker=figures, tables=tables), figures.flush()),
            "spectra": lambda: report_spectra(writer, block_spectra(cur, heads, out_device="cpu"), 1, out / "spectra.csv", 1,
                                              figures=False),
        })
    if args.only in (None, "checkpoints"):
        checkpoint, vitlab_io = vit_b_checkpoint(), BackgroundCheckpointIO()
        rows.update({
            "checkpoint, Lightning's writer": lambda: TorchCheckpointIO().save_checkpoint(checkpoint, out / "lightning.ckpt"),
            "checkpoint, vitlab's writer": lambda: vitlab_io._write(checkpoint, out / "vitlab.ckpt", None),
        })
    for work in rows.values():  # warm-up (imports, the table worker's child)
        work()
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, work in rows.items():
            results[name].append((*stall(work, solo_rate()), lock_held(work, idle_lateness())))
    checks = []
    if tables is not None:
        tables.close()
        figures.close()
        writer.close()
        same = (out / "drift_here.csv").read_bytes() == (out / "drift_worker.csv").read_bytes()
        checks.append(f"the two drift tables {'identical' if same else 'DIFFER'}")
    if (out / "vitlab.ckpt").exists():
        size = (out / "vitlab.ckpt").stat().st_size
        same = (out / "lightning.ckpt").read_bytes() == (out / "vitlab.ckpt").read_bytes()
        checks.append(f"the two checkpoints ({size / 2**30:.2f} GiB) {'identical' if same else 'DIFFER'}")
    shutil.rmtree(out, ignore_errors=True)
    print(f"work of ViT-B/16 beside a stand-in training thread (median of {args.repeats}; 1 torch thread; "
          f"{'; '.join(checks)})")
    for name, runs in results.items():
        wall, lost, held = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"  {name:30s} {wall:6.3f} s of work; the training thread stalled {lost:6.3f} s = "
              f"{lost / args.seconds_per_epoch:6.1%} of a {args.seconds_per_epoch:.2f} s epoch; the lock held "
              f"{held:6.3f} s = {held / args.seconds_per_epoch:6.1%}")


if __name__ == "__main__":
    main()
