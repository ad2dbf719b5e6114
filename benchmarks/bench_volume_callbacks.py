"""Per-epoch cost of the three Q/K/V callbacks on MONAI's SwinUNETR vs a training epoch, side by side in one run.

Goal (issue 24): QKVSnapshot + QKVDrift + QKSpectra per epoch (timed as ``bench_callbacks.py`` does: a snapshot
file, a drift report and a spectra report of the Swin encoder's Q/K/V, each the fastest of ``--repeats``)
    (a) <= 5 % of one epoch of the quickstart volume run (``configs/quickstart_volume.yaml``: tiny SwinUNETR,
        32^3 volumes, feature size 12, batch 2, AdamW, cross-entropy + soft Dice);
    (b) <= 1 % of one epoch of a full-scale SwinUNETR (``configs/medical_swinunetr.yaml``: img_size 96, feature
        size 48, batch 1 of 96^3 voxels) on a BTCV-like training split of 24 volumes.

Neither epoch is run in full: one training step is timed and multiplied by the steps per epoch.
    (a) the training split of the quickstart's own data module (``configs/quickstart_volume.yaml``'s ``data``:
        16 embedded patients, split patient-grouped and stratified, 12 train and 4 validate): ceil(12 / 2) = 6
        steps per epoch, each timed as the fastest of ``--repeats`` steps at batch 2 after a warm-up.
    (b) 24 volumes at batch 1 = 24 steps of one 96^3 crop (MONAI's BTCV tutorial takes 4 crops per volume, which
        would make the epoch 4x longer and the share 4x smaller); the step is the fastest of ``--full-repeats``
        after one warm-up step (about 40 s each on 2 CPU cores).
Each callback is timed drawing its figures (as ``bench_callbacks.py`` does) and without them: in a run the
figures are drawn on about 5 epochs (``figures_due``: the first, every ceil(max_epochs / 4)-th and the last), by
the figure worker; the other epochs cost the "without figures" share. Validation, data loading and checkpoints
are left out of both epochs, and the callbacks are counted every epoch (the full-scale config snapshots every
10th): the shares printed are upper bounds.

    python benchmarks/bench_volume_callbacks.py [--repeats 3] [--full-repeats 1] [--full-volumes 24] [--no-full]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import best_of  # benchmarks/_timing.py
from torch.utils.tensorboard import SummaryWriter

from vitlab.models import build_model, parameter_groups
from vitlab.outputs.files import save_safetensors
from vitlab.qkv.drift import report_drift
from vitlab.qkv.spectra import block_spectra, report_spectra
from vitlab.qkv.state import head_counts, qkv_state, snapshot_name
from vitlab.training.segmentation import soft_dice_loss

ROOT = Path(__file__).resolve().parent.parent
TINY = {"img_size": 32, "feature_size": 12, "depths": (2, 2, 2, 2), "num_heads": (3, 6, 12, 24), "norm_name": "batch"}
FULL = {"img_size": 96, "feature_size": 48, "depths": (2, 2, 2, 2), "num_heads": (3, 6, 12, 24)}


def quickstart_split() -> tuple[int, int]:
    """Training volumes and batch size of ``configs/quickstart_volume.yaml`` (its data module, set up)."""
    import yaml

    from vitlab.data.datamodule import DenseDataModule

    data = yaml.safe_load((ROOT / "configs" / "quickstart_volume.yaml").read_text())["data"]
    module = DenseDataModule(**data)
    module.setup("fit")
    return len(module.samples("train")), data["batch_size"]


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, side: int):
    """One training step of the segmentation task (cross-entropy + soft Dice, AdamW) on a fixed random batch."""
    images = torch.randn(batch, 1, side, side, side)
    masks = torch.randint(0, 2, (batch, side, side, side))

    def step() -> None:
        logits = model(images)
        loss = F.cross_entropy(logits, masks) + soft_dice_loss(logits, masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def callback_costs(model: torch.nn.Module, reference: dict[str, torch.Tensor], repeats: int) -> tuple[dict[str, float], float, int]:
    """Seconds per epoch of each callback's work, the snapshot's MiB and the number of attention blocks
    (``reference``: the Q/K/V before the timed training steps, so drift is not zero)."""
    heads = head_counts(model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        writer = SummaryWriter(str(out / "tb"))
        epoch = iter(range(1, 1000))

        def snapshot() -> None:
            save_safetensors(qkv_state(model), out / snapshot_name(next(epoch)), {"heads": heads})

        def drift(figures: bool = True) -> None:
            report_drift(writer, reference, qkv_state(model), reference, heads, step=1, table_path=out / "drift.csv",
                         figures=figures)

        def spectra(figures: bool = True) -> None:
            report_spectra(writer, block_spectra(qkv_state(model), heads), step=1, table_path=out / "spectra.csv",
                           figures=figures)

        costs = {name: best_of(fn, repeats, warmup=False)[0] for name, fn in (
            ("QKVSnapshot", snapshot), ("QKVDrift", drift), ("QKSpectra", spectra),
            ("QKVDrift no figures", lambda: drift(False)), ("QKSpectra no figures", lambda: spectra(False)))}
        writer.close()
        snap_mb = (out / snapshot_name(1)).stat().st_size / 2**20
    return costs, snap_mb, len(heads)


def report(label: str, costs: dict[str, float], epoch_s: float, goal: float) -> None:
    for name, seconds in costs.items():
        print(f"  {name:20s} per epoch: {seconds:.3f} s  ({100 * seconds / epoch_s:.2f} % of the epoch)")
    for kind, names in (("with figures", ("QKVSnapshot", "QKVDrift", "QKSpectra")),
                        ("without figures", ("QKVSnapshot", "QKVDrift no figures", "QKSpectra no figures"))):
        total = sum(costs[name] for name in names)
        print(f"{label}: all three callbacks per epoch {kind} = {total:.3f} s = {100 * total / epoch_s:.2f} % of the "
              f"epoch  (goal <= {goal:g} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the tiny step and of each callback")
    parser.add_argument("--full-repeats", type=int, default=1, help="timed full-scale steps after one warm-up")
    parser.add_argument("--full-volumes", type=int, default=24, help="full-scale training volumes per epoch")
    parser.add_argument("--no-full", action="store_true", help="skip (b), the full-scale model")
    args = parser.parse_args()
    print(f"torch threads = {torch.get_num_threads()}")

    # (a) the quickstart volume run
    torch.manual_seed(0)
    model = build_model("monai:swin_unetr", 2, in_chans=1, **TINY)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.05), lr=5e-3)
    train, batch = quickstart_split()
    steps = math.ceil(train / batch)
    reference = qkv_state(model)
    step_s, _ = best_of(make_step(model, optimizer, batch, 32), args.repeats)
    epoch_s = steps * step_s
    costs, snap_mb, blocks = callback_costs(model, reference, args.repeats)
    print(f"\n(a) quickstart volume run: tiny SwinUNETR 32^3, feature size 12, {blocks} attention blocks, "
          f"one snapshot = {snap_mb:.2f} MiB")
    print(f"  one training step at batch {batch}: {step_s:.3f} s")
    print(f"  epoch = {steps} steps ({train} training volumes / batch {batch}) x {step_s:.3f} s = {epoch_s:.2f} s  (estimated)")
    report("(a) quickstart", costs, epoch_s, 5)
    del model, optimizer

    if args.no_full:
        return
    # (b) full scale
    torch.manual_seed(0)
    model = build_model("monai:swin_unetr", 2, in_chans=1, **FULL)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=1e-5), lr=1e-4)
    reference = qkv_state(model)
    step_s, _ = best_of(make_step(model, optimizer, 1, 96), args.full_repeats)
    epoch_s = args.full_volumes * step_s
    costs, snap_mb, blocks = callback_costs(model, reference, args.repeats)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n(b) full scale: SwinUNETR 96^3, feature size 48 ({params:.1f} M parameters), {blocks} attention blocks, "
          f"one snapshot = {snap_mb:.2f} MiB")
    print(f"  one training step at batch 1: {step_s:.2f} s (fastest of {args.full_repeats} after a warm-up)")
    print(f"  epoch = {args.full_volumes} volumes x {step_s:.2f} s = {epoch_s:.1f} s  (estimated)")
    report("(b) full scale", costs, epoch_s, 1)


if __name__ == "__main__":
    main()
