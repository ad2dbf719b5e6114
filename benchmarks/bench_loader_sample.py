"""What one training sample of gray images costs a loader worker, for a model of three input channels.

    python benchmarks/bench_loader_sample.py [--images 192] [--rounds 3] [--recipes default light strong none]

A ViT-B/16 on an H200 trains on about 2,200 images a second; every one of them is decoded, windowed, augmented and
normalised by a loader worker on the host's cores, beside the training process. For a model of three input channels
(``configs/medical_vit.yaml``) a gray CT or X-ray image is the gray image repeated three times. vitlab augments the
gray image once and repeats it in its Normalize (where every transform acts on each channel alike: the recipes
``none``, ``light``, ``default`` and validation) or just before the first transform that draws per channel
(``strong``'s GaussNoise). Before, the dataset repeated it first, every warp and resize ran three times, and
albumentations' Normalize filled two image-sized arrays for each image. This measures both, side by side in one
process on the same samples (the earlier path rebuilt: each image repeated to three channels as it is decoded, so
that the prescale, the memory cache and the recipe see three, and albumentations' Normalize), with the same keyed
seeds, and checks that they give the same tensors:

- synthetic CT slices (vitlab's generator) of 224 px (as ``bench_gpu.py`` makes) and of 512 px (a CT's own
  size: the dataset's prescale halves them first), ``--images`` of each;
- ``image_size`` 224, batch 64 collated as a loader worker does (``torch.stack``), one thread;
- per sample: decoded every time (a worker's memory cache misses: each worker meets a sample about once an epoch
  among many) and from the memory cache (the decoded image kept), the fastest of ``--rounds`` interleaved rounds.

It prints the milliseconds of CPU time per sample of each path, their ratio, and how many
cores each needs to make 2,200 samples a second.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATE = 2200  # ViT-B/16 training images a second on an H200 (bench_gpu.py's bare loop)


def datasets(root: Path, images: int, recipe: str, size: int):
    """(vitlab's dataset, the earlier path's) of one synthetic set, the same samples."""
    import albumentations as A
    import numpy as np

    from vitlab.data import MedicalDataModule
    from vitlab.data.cache import MemoryCache
    from vitlab.data.transforms import AUGMENT_RECIPES

    dm = MedicalDataModule(root=str(root / "manifest.csv"), image_size=224, in_chans=3, batch_size=64, num_workers=0,
                           augment="none" if recipe == "none" else recipe, val_fraction=0.0)
    dm.setup("fit")
    new = dm.dataset("train", augmented=recipe != "none")
    old = dm.dataset("train", augmented=recipe != "none")
    steps = AUGMENT_RECIPES[recipe](224)
    old.transform = A.Compose([*steps, A.Normalize(mean=dm.mean, std=dm.std, max_pixel_value=1.0)], seed=0)
    decode = old.load_array
    old.load_array = lambda index: np.repeat(np.atleast_3d(decode(index)), 3, axis=2)  # repeated as it is decoded
    assert new.keep_gray and not old.keep_gray
    for dataset in (new, old):
        dataset.samples = dataset.samples[:images]
        dataset.kept = MemoryCache(2**31)  # each its own
    return new, old


def epoch_cpu_s(dataset, seed: int, cached: bool):
    """CPU seconds of one pass over ``dataset`` in batches of 64 (keyed seeds, as the loader sets them), and the
    first batch (to compare the two paths' tensors)."""
    import numpy as np
    import torch

    dataset.memory = dataset.kept if cached else None
    first = None
    start = time.process_time()
    for begin in range(0, len(dataset), 64):
        items = []
        for index in range(begin, min(begin + 64, len(dataset))):
            dataset.set_random_state(np.random.default_rng(seed * 100003 + index), random.Random(seed * 100003 + index))
            items.append(dataset[index][0])
        batch = torch.stack(items)
        first = batch if first is None else first
    return time.process_time() - start, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=192, help="samples of each synthetic set")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the fastest is reported")
    parser.add_argument("--recipes", nargs="*", default=["default", "light", "strong", "none"],
                        choices=["default", "light", "strong", "none"], help="'none': the validation pipeline (resize)")
    args = parser.parse_args()

    from vitlab.runtime import prepare_process

    prepare_process()
    import torch

    from vitlab.data.synthetic import generate
    from vitlab.data.transforms import single_opencv_thread

    torch.set_num_threads(1)
    single_opencv_thread()
    with tempfile.TemporaryDirectory() as tmp:
        sets = {}
        for size in (224, 512):
            patients = -(-args.images // 6)
            print(f"making {patients * 6} synthetic CT slices of {size} px ...", flush=True)
            sets[size] = generate(Path(tmp) / f"s{size}", seed=0, patients=patients, slices=6, size=size).parent
        print(f"one thread; ms of CPU per sample (batches of 64 stacked), fastest of {args.rounds} interleaved rounds; "
              f"cores to make {RATE} samples/s in brackets")
        print(f"{'recipe':8s} {'source':7s} {'memory cache':12s} {'vitlab':>14s} {'repeated first':>16s}  ratio  same tensors")
        for recipe in args.recipes:
            for size, root in sets.items():
                new, old = datasets(root, args.images, recipe, size)
                for cached in (False, True):
                    if cached:  # fill both caches once
                        epoch_cpu_s(new, 0, True)
                        epoch_cpu_s(old, 0, True)
                    best = {"new": float("inf"), "old": float("inf")}
                    firsts = {}
                    for round_ in range(args.rounds):
                        for name, dataset in (("new", new), ("old", old)) if round_ % 2 == 0 else (("old", old), ("new", new)):
                            spent, first = epoch_cpu_s(dataset, round_, cached)
                            best[name] = min(best[name], spent)
                            firsts.setdefault(round_, {})[name] = first
                    same = all(torch.equal(f["new"], f["old"]) for f in firsts.values())
                    ms = {k: 1e3 * v / len(new) for k, v in best.items()}
                    cores = {k: v * RATE / 1e3 for k, v in ms.items()}
                    print(f"{recipe:8s} {size:4d} px {'warm' if cached else 'off':12s} {ms['new']:6.2f} ({cores['new']:4.1f}) "
                          f"{ms['old']:8.2f} ({cores['old']:4.1f})  {ms['new'] / ms['old']:5.2f}x  {same}", flush=True)


if __name__ == "__main__":
    main()
