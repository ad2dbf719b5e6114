"""The wait for each epoch's first training batch: loader workers that start the next epoch early, against workers
that start it when the epoch does.

    python benchmarks/bench_epoch_start.py [--epochs 5] [--workers 1] [--image-size 128] [--batch 32] [--repeats 2]

With persistent loader workers, a ``DataLoader`` begins an epoch's batches when the training loop iterates it, at
the epoch's start, so the first step of every epoch waits while one worker makes a whole batch; the workers were
idle through the previous epoch's validation, epoch-end callbacks and checkpoints. vitlab's training loaders
(:class:`vitlab.data.sampling.EpochLoader`) restart their workers on the next epoch right after an epoch's last
training batch instead (``vitlab.callbacks.RuntimeCallback``). This runs ``configs/quickstart.yaml``'s fit (its
Q/K/V callbacks, checkpoints and validation) with ``--workers`` persistent loader workers and Albumentations'
``default`` augmentation at ``--image-size`` px, ``--epochs`` whole epochs (the embedded data's 96 patients) with
4 validation batches each, each run in its own process, alternating:

1. ``early``: as ``train.py`` runs it;
2. ``at start``: the same with the early start switched off (``EpochLoader.start_epoch`` does nothing).

For each it prints the median over epochs 2.. of the time from an epoch's start (``on_train_epoch_start``) to its
first batch (``on_train_batch_start``: the other callbacks' epoch-start hooks and the loader), of it the time the
training loop spends in the loader for that batch (its ``iter`` and ``next``; a later batch's ``next`` beside it),
of the whole epoch (one epoch start to the next), and whether the runs' training batches are equal (the same
batches, whenever they are made). On a GPU the wait is time the GPU idles:
a batch of 64 augmented 224 px images is about 0.2 s of one worker's time; a 3-D patch batch can be seconds.

Goal: the first batch waits <= 10 % of what it waits at start (it was made during the last epoch's end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, os, sys, time
from vitlab.runtime import prepare_process
prepare_process()
import pytorch_lightning as pl
import torch
from vitlab.data.sampling import EpochLoader

if os.environ["BENCH_MODE"] == "start":
    EpochLoader.start_epoch = lambda self, epoch: False

from pytorch_lightning.loops import fetchers

class EpochTimer(pl.Callback):
    def __init__(self):
        self.starts, self.first, self.first_loader, self.others, self.digest = [], [], [], [], hashlib.sha256()
        self._loader = None  # the training loop's time in the loader: iter() and each next()
        timer, original_iter, original_next = self, fetchers._PrefetchDataFetcher.__iter__, fetchers._PrefetchDataFetcher.__next__
        def timed_iter(fetcher):
            start = time.perf_counter()
            try:
                return original_iter(fetcher)
            finally:
                timer._loader = time.perf_counter() - start
        def timed_next(fetcher):
            start = time.perf_counter()
            try:
                return original_next(fetcher)
            finally:
                timer._loader = (timer._loader or 0.0) + time.perf_counter() - start
        fetchers._PrefetchDataFetcher.__iter__, fetchers._PrefetchDataFetcher.__next__ = timed_iter, timed_next
    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.perf_counter())
        self._loader = None
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.first.append(time.perf_counter() - self.starts[-1])
            self.first_loader.append(self._loader)
        else:
            self.others.append(self._loader)
        self._loader = 0.0
        images, labels = batch
        self.digest.update(images.numpy().tobytes()); self.digest.update(labels.numpy().tobytes())

from vitlab.cli import fit
cli = fit(sys.argv[1:])
timer = next(cb for cb in cli.trainer.callbacks if isinstance(cb, EpochTimer))
print("RESULT " + json.dumps({"first": timer.first, "first_loader": timer.first_loader, "others": timer.others, "epochs": [b - a for a, b in zip(timer.starts, timer.starts[1:])],
                              "digest": timer.digest.hexdigest()}))
"""


def run(mode: str, args: argparse.Namespace, save_dir: Path) -> dict:
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["trainer"]["callbacks"].insert(0, {"class_path": "__main__.EpochTimer"})
    cfg["trainer"].update({"max_epochs": args.epochs, "limit_val_batches": 4,
                           "accelerator": "cpu", "enable_progress_bar": False})
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(save_dir)
    cfg["runtime"]["workers"] = args.workers
    cfg["model"]["model_kwargs"]["img_size"] = args.image_size
    cfg["data"].update({"image_size": args.image_size, "batch_size": args.batch, "augment": "default",
                        "embedded_kwargs": {"patients": 96, "size": args.image_size}})
    path = save_dir / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "BENCH_MODE": mode}
    proc = subprocess.run([sys.executable, "-c", CHILD, "--config", str(path)], cwd=save_dir, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run (default 5; epochs 2.. are timed)")
    parser.add_argument("--workers", type=int, default=1, help="persistent loader workers (default 1)")
    parser.add_argument("--image-size", type=int, default=128, help="image size in px (default 128)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating (default 2)")
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be >= 3 (epochs 2.. are timed)")
    results: dict[str, list[dict]] = {"early": [], "at start": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode, name in (("early", "early"), ("start", "at start")):
                save_dir = Path(tmp) / f"{mode}{repeat}"
                save_dir.mkdir()
                results[name].append(run(mode, args, save_dir))
    print(f"quickstart fit, {args.workers} persistent loader worker(s), augment default at {args.image_size} px, "
          f"batch {args.batch}, whole epochs with 4 validation batches, epochs 2-{args.epochs} "
          f"(median over epochs; runs alternating, {args.repeats} each):")
    medians = {}
    for name, runs in results.items():
        first = [statistics.median(r["first"][1:]) for r in runs]
        loader = [statistics.median(r["first_loader"][1:]) for r in runs]
        others = [statistics.median(r["others"]) for r in runs]
        epoch = [statistics.median(r["epochs"][1:]) for r in runs]
        medians[name] = min(loader)
        print(f"  {name:9s}: epoch start to first batch {' / '.join(f'{f * 1e3:6.1f}' for f in first)} ms, of it "
              f"in the loader {' / '.join(f'{f * 1e3:6.1f}' for f in loader)} ms (a later batch: "
              f"{' / '.join(f'{f * 1e3:5.1f}' for f in others)} ms); epoch {' / '.join(f'{e:5.2f}' for e in epoch)} s")
    digests = {r["digest"] for runs in results.values() for r in runs}
    print(f"  early / at start, the loader's time for the first batch: {medians['early'] / medians['at start']:.2f}x "
          f"(goal <= 0.10); training batches {'identical in every run' if len(digests) == 1 else 'DIFFER between runs'}")
    if len(digests) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
