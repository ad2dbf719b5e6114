"""What a training batch of gray images costs on its way to the GPU, normalised by the loader workers or after the
transfer, for a model of three input channels.

    python benchmarks/bench_loader_batches.py [--images 512] [--workers 1] [--rounds 2] [--augment default] [--task dense]

Beside a GPU the loaders of ``train.py`` leave the pipelines' final Normalize to the device
(:attr:`vitlab.data.image_data.ImageData.normalize_on_device`): a gray CT slice for a model of three channels
(``configs/medical_vit.yaml``) then leaves its worker with one channel instead of three normalised ones. This runs
the training loader of one synthetic set of 224 px CT slices (vitlab's generator; batch 64, ``image_size`` 224,
``--workers`` loader workers) both ways, side by side in one process, alternating, the decoded images kept in the
workers' memory caches (a first pass fills them), and measures per batch:

- the bytes of the images a worker collates into shared memory, the training process receives and a GPU run pins
  and copies to the device;
- the loader workers' CPU time (from ``/proc``, summed over the workers), and the training process's CPU time and
  wall time per batch while it only takes batches (receiving each from a worker: unpickling, mapping its shared
  memory);
- a copy of each batch into a buffer allocated once, as the pin-memory thread copies it into page-locked memory
  beside a GPU (the machine has none: the copy is timed on its own), and the normalisation of a one-channel batch
  that the device then does (on these host cores here; on a GPU a few microseconds);

and checks that both ways give the same normalised batches, bit for bit. On a GPU ``bench_gpu.py`` measures the
training run itself (its ``loadernorm`` variant: the batches normalised by the workers, as before).

``--task dense``: a detection / segmentation batch (the embedded synthetic set at 128 px, batch 16, a label map,
boxes, labels and instance masks per image) whose target dicts cross from the worker to the training process as
they are (a tensor each: four an image, before) or packed into a flat tensor per key
(:class:`vitlab.data.datasets.targets.PackedTargets`, now): the same measures, and the same batches both ways.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (Linux's ``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def one_epoch(loader, epoch: int, consume) -> dict:
    """Every batch of ``loader``'s ``epoch`` through ``consume``; seconds and bytes per batch."""
    loader.sampler.set_epoch(epoch)
    iterator = iter(loader)
    pids = [w.pid for w in getattr(iterator, "_workers", [])]
    workers_before, cpu_before, start = worker_cpu(pids), time.process_time(), time.perf_counter()
    batches = [batch for batch in iterator]
    wall, cpu, workers = time.perf_counter() - start, time.process_time() - cpu_before, worker_cpu(pids) - workers_before
    pinned = normalise = 0.0
    for batch in batches:
        pinned += consume["copy"](batch)
        normalise += consume["normalise"](batch)
    del iterator
    n = len(batches)
    return {"batches": batches, "wall": wall / n, "cpu": cpu / n, "workers": workers / n, "copy": pinned / n,
            "normalise": normalise / n, "bytes": batches[0][0].nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512, help="training slices (224 px)")
    parser.add_argument("--workers", type=int, default=1, help="loader worker processes")
    parser.add_argument("--rounds", type=int, default=2, help="alternating epochs of each way (the median is shown)")
    parser.add_argument("--augment", default="default", help="the training recipe")
    parser.add_argument("--task", choices=["classification", "dense"], default="classification",
                        help="dense: target dicts sent as they are or packed (see above)")
    args = parser.parse_args()

    import torch

    from vitlab.data import DenseDataModule, MedicalDataModule
    from vitlab.data.synthetic import generate

    torch.set_num_threads(1)
    modules = {}
    if args.task == "dense":
        ways = ("list", "packed")
        for way in ways:
            dm = DenseDataModule(root=None, embedded_kwargs={"patients": max(2, args.images // 8), "slices": 8, "size": 128},
                                 image_size=128, batch_size=16, num_workers=args.workers, augment=args.augment, val_fraction=0.0)
            if way == "list":  # (before: the targets as they are)
                dm.collate_fn = lambda batch: (torch.stack([x for x, _ in batch]), [t for _, t in batch])
            dm.setup("fit")
            modules[way] = (dm, dm.train_dataloader())
    else:
        ways = ("workers", "device")
        root = generate(Path(tempfile.mkdtemp(prefix="bench-batches-")) / "data", seed=0, patients=max(2, args.images // 16),
                        slices=16, size=224)
        for way in ways:
            dm = MedicalDataModule(root=str(root), image_size=224, in_chans=3, batch_size=64, num_workers=args.workers,
                                   augment=args.augment, val_fraction=0.0)
            dm.normalize_on_device = way == "device"
            dm.setup("fit")
            modules[way] = (dm, dm.train_dataloader())
    buffers: dict[tuple, torch.Tensor] = {}

    def copy(batch) -> float:  # the pin-memory thread's copy, into memory allocated once
        images = batch[0]
        buffer = buffers.setdefault(tuple(images.shape), torch.empty_like(images))
        start = time.perf_counter()
        buffer.copy_(images)
        return time.perf_counter() - start

    def normaliser(dm):
        def normalise(batch) -> float:
            start = time.perf_counter()
            dm.normalize_batch(batch)
            return time.perf_counter() - start
        return normalise

    results: dict[str, list[dict]] = {way: [] for way in modules}
    for epoch in range(args.rounds + 1):  # epoch 0 fills the workers' memory caches
        for way, (dm, loader) in (modules.items() if epoch % 2 == 0 else reversed(modules.items())):
            out = one_epoch(loader, epoch, {"copy": copy, "normalise": normaliser(dm)})
            if epoch:
                results[way].append(out)
    before, after = ways
    for epoch_results in zip(results[before], results[after]):
        dm = modules[after][0]
        for a, b in zip(epoch_results[0]["batches"], epoch_results[1]["batches"]):
            b = dm.normalize_batch(b)
            same = torch.equal(a[0], b[0]) and len(a[1]) == len(b[1])
            if args.task == "dense":
                same = same and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1], b[1]))
            else:
                same = same and torch.equal(a[1], b[1])
            assert same, "the two ways differ"
    if args.task == "dense":
        print(f"bench_loader_batches --task dense: the embedded synthetic set at 128 px, batch 16, augment {args.augment}, "
              f"{args.workers} loader worker(s), one torch thread; median of {args.rounds} epochs each; the same batches both ways")
    else:
        print(f"bench_loader_batches: {args.images} gray 224 px CT slices, model of 3 channels, batch 64, augment "
              f"{args.augment}, {args.workers} loader worker(s), one torch thread; median of {args.rounds} epochs each; "
              "the same normalised batches both ways")
    names = {"workers": "normalised by the loader workers", "device": "normalised by the device (after the transfer)",
             "list": "targets sent as they are (a tensor each)", "packed": "targets packed (a flat tensor per key)"}
    rows = {}
    for way, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in ("wall", "cpu", "workers", "copy", "normalise", "bytes")}
        rows[way] = med
        print(f"  {names[way]}:")
        print(f"    {med['bytes'] / 2**20:6.1f} MiB of images a batch; workers' CPU {1e3 * med['workers']:7.1f} ms a batch; "
              f"training process {1e3 * med['cpu']:6.1f} ms of CPU ({1e3 * med['wall']:6.1f} ms of wall) a batch taking it; "
              f"the pin-memory copy of the images {1e3 * med['copy']:5.1f} ms" +
              (f"; the normalisation here {1e3 * med['normalise']:5.1f} ms" if way == "device" else ""))
    w, d = rows[before], rows[after]
    ratio = {key: f"{d[key] / w[key]:.2f}x" if w[key] > 0 else "n/a" for key in w}  # (no workers: no workers' CPU)
    print(f"  {after} / {before}: bytes {ratio['bytes']}, workers' CPU {ratio['workers']}, training process's CPU "
          f"{ratio['cpu']}, wall {ratio['wall']}, pin-memory copy {ratio['copy']}")


if __name__ == "__main__":
    main()
