"""Per-epoch cost of the three Q/K/V callbacks vs a 200-step Mask R-CNN epoch, side by side in one run.

Goal: QKVSnapshot + QKVDrift + QKSpectra per epoch <= 5 % of a 200-step detection epoch
(Mask R-CNN, swin_tiny_patch4_window7_224 backbone, torchvision's full heads, batch 4, 512 px, AdamW).
The callbacks see the detector's backbone through vitlab.models, exactly as in training.

    python benchmarks/bench_detection.py [--size 512] [--batch 4] [--steps-per-epoch 200] [--heads full]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from vitlab.qkv.state import head_counts, qkv_state, snapshot_name
from vitlab.qkv.drift import report_drift
from vitlab.qkv.spectra import block_spectra, report_spectra
from vitlab.models import build_detector, parameter_groups
from vitlab.outputs.files import save_safetensors
from _timing import best_of  # benchmarks/_timing.py


def targets(batch: int, size: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(batch):
        masks = torch.zeros(2, size, size, dtype=torch.uint8)
        masks[0, size // 8 : size // 3, size // 6 : size // 2] = 1
        masks[1, size // 2 : size // 2 + size // 5, size // 2 : size // 2 + size // 4] = 1
        boxes = torch.tensor([[size // 6, size // 8, size // 2, size // 3],
                              [size // 2, size // 2, size // 2 + size // 4, size // 2 + size // 5]], dtype=torch.float32)
        out.append({"boxes": boxes, "labels": torch.tensor([1, 1]), "masks": masks})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    parser.add_argument("--heads", default="full", choices=["light", "full"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_detector(args.model, 1, in_chans=3, image_size=args.size, heads=args.heads)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.05), lr=1e-4)
    images = list(torch.randn(args.batch, 3, args.size, args.size))
    truth = targets(args.batch, args.size)

    def train_step() -> None:
        loss = sum(model(images, truth).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step_s, _ = best_of(train_step, args.repeats)
    heads = head_counts(model)
    reference = qkv_state(model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        writer = SummaryWriter(str(out / "tb"))
        epoch = iter(range(1, 1000))

        def snapshot() -> None:
            save_safetensors(qkv_state(model), out / snapshot_name(next(epoch)), {"heads": heads})

        def drift() -> None:
            report_drift(writer, reference, qkv_state(model), reference, heads, step=1, table_path=out / "drift.csv")

        def spectra() -> None:
            report_spectra(writer, block_spectra(qkv_state(model), heads), step=1, table_path=out / "spectra.csv")

        costs = {name: best_of(fn, args.repeats, warmup=False)[0]
                 for name, fn in (("QKVSnapshot", snapshot), ("QKVDrift", drift), ("QKSpectra", spectra))}
        writer.close()

    epoch_s = step_s * args.steps_per_epoch
    total = sum(costs.values())
    print(f"Mask R-CNN ({args.heads} heads) over {args.model}: {len(heads)} attention blocks, batch {args.batch}, "
          f"{args.size} px, torch threads = {torch.get_num_threads()}")
    print(f"one training step: {step_s:.3f} s; a {args.steps_per_epoch}-step epoch: {epoch_s:.1f} s")
    for name, seconds in costs.items():
        print(f"  {name:12s} per epoch: {seconds:.3f} s  ({100 * seconds / epoch_s:.2f} % of the epoch)")
    print(f"all three callbacks per epoch / epoch = {100 * total / epoch_s:.2f} %  (goal <= 5 %)")


if __name__ == "__main__":
    main()
