"""Per-epoch cost of the three Q/K/V callbacks vs one training step, side by side in one run.

Goal: QKVSnapshot + QKVDrift + QKSpectra per epoch <= one training step at batch 32 of
swin_tiny_patch4_window7_224 (224 px, AdamW) on the same machine.

    python benchmarks/bench_callbacks.py [--model swin_tiny_patch4_window7_224] [--batch 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

from vitlab.qkv.state import head_counts, qkv_state, snapshot_name
from vitlab.qkv.drift import report_drift
from vitlab.qkv.spectra import block_spectra, report_spectra
from vitlab.models import build_model, parameter_groups
from vitlab.outputs.files import save_safetensors
from _timing import best_of  # benchmarks/_timing.py



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=2, in_chans=3)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.05), lr=1e-4)
    images = torch.randn(args.batch, 3, 224, 224)
    labels = torch.randint(0, 2, (args.batch,))

    def train_step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step_s, _ = best_of(train_step, args.repeats)

    heads = head_counts(model)
    reference = qkv_state(model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        writer = SummaryWriter(str(out / "tb"))
        train_step()  # move the weights a little, so drift is not zero
        epoch = iter(range(1, 1000))

        def snapshot() -> None:
            save_safetensors(qkv_state(model), out / snapshot_name(next(epoch)), {"heads": heads})

        def drift() -> None:
            report_drift(writer, reference, qkv_state(model), reference, heads, step=1, table_path=out / "drift.csv")

        def spectra() -> None:
            report_spectra(writer, block_spectra(qkv_state(model), heads), step=1, table_path=out / "spectra.csv")

        costs = {name: best_of(fn, args.repeats, warmup=False)[0] for name, fn in (("QKVSnapshot", snapshot), ("QKVDrift", drift), ("QKSpectra", spectra))}
        writer.close()
        snap_mb = (out / snapshot_name(1)).stat().st_size / 2**20

    total = sum(costs.values())
    print(f"{args.model}: {len(heads)} attention blocks, one snapshot = {snap_mb:.1f} MiB, torch threads = {torch.get_num_threads()}")
    print(f"one training step at batch {args.batch}: {step_s:.3f} s")
    for name, seconds in costs.items():
        print(f"  {name:12s} per epoch: {seconds:.3f} s  ({seconds / step_s:.2f}x a step)")
    print(f"all three callbacks per epoch / one training step = {total / step_s:.2f}x  (goal <= 1.00x)")


if __name__ == "__main__":
    main()
