"""Data pipeline benchmarks, measured side by side in one run.

1. Throughput of vitlab's DICOM pipeline (read + modality LUT + window + augment + normalise ->
   tensor) relative to a bare ``pydicom.dcmread(path).pixel_array`` on the same files (goal >= 0.8x).
2. Decoded-array cache for epochs >= 2: loading the cached array vs decoding + windowing again
   (goal >= 3x), and the whole item with and without the cache.

Optional: ``--learnability`` trains a small CNN and the quickstart's tiny Swin on the embedded
synthetic dataset at several difficulties (64 px, CPU): learnable, not trivial, harder with difficulty.

    python benchmarks/bench_data.py [--repeats 5] [--learnability]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import albumentations as A
import cv2
import pydicom
import torch
from pydicom.uid import RLELossless

from vitlab.data import ImageReader, MedicalDataModule, generate, read_image


def best_per_item_ms(fns: dict[str, Callable[[], None]], items: int, rounds: int) -> dict[str, float]:
    """Fastest of ``rounds`` runs of each function, interleaved so drifting machine load hits all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds / items * 1e3 for name, seconds in best.items()}


def rle_copy(manifest: Path, out: Path) -> Path:
    """The same dataset with RLE-compressed pixel data (a codec pydicom ships)."""
    for row in manifest.read_text().splitlines()[1:]:
        relative = row.split(",")[0]
        ds = pydicom.dcmread(manifest.parent / relative)
        ds.compress(RLELossless)
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        ds.save_as(out / relative)
    (out / "manifest.csv").write_text(manifest.read_text())
    return out / "manifest.csv"


def bench_dataset(
    manifest: Path, image_size: int, rounds: int, cache_dir: Path, transforms: A.Compose | None = None
) -> dict[str, float]:
    """Per-item milliseconds of bare pydicom and of vitlab's pipeline."""
    kwargs = dict(root=str(manifest), image_size=image_size, num_workers=0, val_fraction=0.0)
    kwargs["train_transforms"] = transforms
    dm = MedicalDataModule(**kwargs)
    dm.setup("fit")  # header check of every file, remembered by dm.reader
    dataset = dm.dataset("train", augmented=True)
    cached = MedicalDataModule(**kwargs, cache=True, cache_dir=str(cache_dir)).dataset("train", augmented=True)
    paths = [s.path for s in dataset.samples]
    for i in range(len(cached)):  # epoch 1 fills the cache
        cached.load_array(i)

    def bare():
        for p in paths:
            pydicom.dcmread(p).pixel_array  # noqa: B018

    def setup_check():  # once per run, in the main process, before the workers start
        reader = ImageReader(dm.read_options)
        for p in paths:
            reader.inspect(p)

    def epoch():
        for i in range(len(dataset)):
            dataset[i]  # noqa: B018

    def decode_again():  # pydicom decode + modality LUT + window: what the cache saves
        for p in paths:
            read_image(p)

    def from_cache():
        for i in range(len(cached)):
            cached.load_array(i)

    def epoch_cached():
        for i in range(len(cached)):
            cached[i]  # noqa: B018

    fns = {"bare": bare, "setup": setup_check, "epoch": epoch, "decode": decode_again, "cache": from_cache,
           "epoch_cached": epoch_cached}  # fmt: skip
    return best_per_item_ms(fns, len(paths), rounds)


def _small_cnn() -> torch.nn.Module:
    """A detector-style CNN (global max pooling)."""
    nn = torch.nn

    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.GELU()]

    return nn.Sequential(
        *block(1, 16), *block(16, 16), nn.MaxPool2d(2), *block(16, 32), *block(32, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(64, 2),
    )  # fmt: skip


def _tiny_swin() -> torch.nn.Module:
    """The Swin of configs/quickstart.yaml, from scratch."""
    import timm

    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=2, in_chans=1, img_size=64,
        patch_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.1,
    )  # fmt: skip


def _warmup_cosine(warm_steps: int, total_steps: int) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up, then cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warm_steps:
            return (step + 1) / warm_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warm_steps) / max(1, total_steps - warm_steps)))

    return factor


def learnability(difficulties: list[float], epochs: int) -> None:
    """Val accuracy per epoch on the embedded dataset (64 px, augment=light) per difficulty and model.

    CNN: Adam 1e-3, batch 16; Swin: AdamW 1e-3 (wd 0.05), batch 32; both one warm-up epoch, then cosine.
    """
    models = {"small CNN": (_small_cnn, 16), "tiny Swin": (_tiny_swin, 32)}
    for difficulty in difficulties:
        for name, (make, batch_size) in models.items():
            torch.manual_seed(0)
            dm = MedicalDataModule(image_size=64, batch_size=batch_size, num_workers=0, augment="light",
                                   embedded_kwargs={"difficulty": difficulty})  # fmt: skip
            val = dm.dataset("val")
            x_val, y_val = torch.stack([val[i][0] for i in range(len(val))]), torch.tensor(val.labels)
            net, loader = make(), dm.train_dataloader()
            if name == "small CNN":
                optimizer = torch.optim.Adam(net.parameters(), 1e-3)
            else:
                optimizer = torch.optim.AdamW(net.parameters(), 1e-3, weight_decay=0.05)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(len(loader), epochs * len(loader)))
            history, start = [], time.perf_counter()
            for _ in range(epochs):
                net.train()
                for x, y in loader:
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(net(x), y).backward()
                    optimizer.step()
                    schedule.step()
                net.eval()
                with torch.no_grad():
                    history.append((net(x_val).argmax(1) == y_val).float().mean().item())
            print(f"difficulty {difficulty:.2f} {name:<9}: val accuracy per epoch"
                  f" {' '.join(f'{a:.2f}' for a in history)}  ({time.perf_counter() - start:.0f} s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the best counts")
    parser.add_argument("--learnability", action="store_true")
    parser.add_argument("--epochs", type=int, default=30, help="epochs of the learnability check")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)  # one DataLoader worker = one thread

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VITLAB_CACHE", str(Path(tmp) / "vitlab-cache"))
        ct128 = generate(Path(tmp) / "ct128", patients=16, slices=6, size=128)
        ct512 = generate(Path(tmp) / "ct512", patients=4, slices=6, size=512)
        rle512 = rle_copy(ct512, Path(tmp) / "rle512")
        linear_crop = A.Compose([A.RandomResizedCrop((224, 224), scale=(0.7, 1.0)), A.HorizontalFlip(),
                                 A.Affine(rotate=(-15, 15), p=0.5), A.RandomBrightnessContrast(0.1, 0.1)])  # fmt: skip
        cases = [
            ("CT 128 px (embedded), default augment", ct128, 64, None),
            ("CT 128 px (embedded), default augment", ct128, 224, None),
            ("CT 512 px, default augment (area)", ct512, 224, None),
            ("CT 512 px, linear-interpolation crop", ct512, 224, linear_crop),
            ("CT 512 px RLE, default augment", rle512, 224, None),
        ]
        print("milliseconds per file (best of interleaved rounds); ratio = bare / vitlab = relative throughput")
        print(f"{'files':<38} {'size':>4} | {'bare':>6} | {'vitlab':>6} {'ratio':>6} (goal >= 0.8) | {'setup':>5} |"
              f" {'decode':>6} {'cache':>6} {'speed-up':>8} (goal >= 3) | {'cached item':>11}")  # fmt: skip
        for name, manifest, size, transforms in cases:
            r = bench_dataset(manifest, size, args.repeats, Path(tmp) / f"cache-{size}", transforms)
            print(f"{name:<38} {size:>4} | {r['bare']:6.3f} | {r['epoch']:6.3f} {r['bare'] / r['epoch']:5.2f}x"
                  f"               | {r['setup']:5.2f} | {r['decode']:6.3f} {r['cache']:6.3f}"
                  f" {r['decode'] / r['cache']:7.1f}x"
                  f"             | {r['epoch_cached']:11.3f}")  # fmt: skip
        print("bare   = pydicom.dcmread(p).pixel_array")
        print("vitlab = one training item, any epoch: read + modality LUT + window + augment + normalise -> tensor")
        print("setup  = the header check of one file at setup (once per run; its result is reused by every epoch)")
        print("decode = read_image (pydicom decode + modality LUT + window); cache = loading that array from the")
        print("         decoded-array cache (cache=True, epochs >= 2); cached item = a training item with the cache")
        if args.learnability:
            learnability([0.0, 0.15, 0.3, 0.5], args.epochs)


if __name__ == "__main__":
    main()
