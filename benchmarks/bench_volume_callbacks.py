"""Per-epoch cost of the three Q/K/V callbacks on MONAI's SwinUNETR vs a training epoch, side by side in one run.

Goal: QKVSnapshot + QKVDrift + QKSpectra per epoch (timed as ``bench_callbacks.py`` does: a snapshot
file, a drift report and a spectra report of the Swin encoder's Q/K/V, each the fastest of ``--repeats``)
    (a) <= 5 % of one epoch of the quickstart volume run (``configs/quickstart_volume.yaml``: tiny SwinUNETR,
        32^3 volumes, feature size 12, batch 2, AdamW, cross-entropy + soft Dice);
    (b) <= 1 % of one epoch of a full-scale SwinUNETR (``configs/medical_swinunetr.yaml``: img_size 96, feature
        size 48, batch 1 of 96^3 voxels) on a BTCV-like training split of 24 volumes.

Neither epoch is run in full: one training step is timed and multiplied by the steps per epoch.
    (a) the training split of the quickstart's own data module and its model arguments
        (``configs/quickstart_volume.yaml``'s ``data`` and ``model.model_kwargs``, with its deterministic kernels):
        ceil(train / batch) steps per epoch, each timed as the fastest of ``--repeats`` steps after a warm-up.
    (b) 24 volumes at batch 1 = 24 steps of one 96^3 crop (MONAI's BTCV tutorial takes 4 crops per volume, which
        would make the epoch 4x longer and the share 4x smaller); the step is the fastest of ``--full-repeats``
        after one warm-up step (about 40 s each on 2 CPU cores).
Each callback is timed without figures and with them, drawn as a run's figure worker draws them: each figure built
once (the first figure epoch, with what a process pays for its first figures) and kept, later figure epochs updating
it. Figures are drawn on about 5 epochs (``figures_due``: the first, every ceil(max_epochs / 4)-th and the last); the
other epochs cost the "without figures" share; the run average spreads the builds and the updates over all
epochs. ``--clock cpu`` (the default) times CPU seconds of this process (all threads): steady on a machine shared
with other work, and what the figure worker takes from training on a small CPU machine; ``--clock wall`` as before.
Validation, data loading and checkpoints are left out of both epochs, and the callbacks are counted every epoch
(the full-scale config snapshots every 10th): the shares printed are upper bounds.

``--fit-epochs N`` adds (c), the quickstart itself: ``train.py --config configs/quickstart_volume.yaml`` for N epochs
with ``runtime.figures off`` and ``auto`` (the figure worker), alternated ``--fit-repeats`` times; each epoch's wall
time is read from the event file (the ``epoch`` scalar's first timestamp per epoch, so it includes validation,
data loading, the callbacks and checkpoints), the fastest of the repeats per epoch. On 2 cores the figure worker
draws while the training process loads data and validates on one thread, so this is what the figures cost a user
in wall time, where (a) assumes every CPU second of drawing is taken from training.

    python benchmarks/bench_volume_callbacks.py [--repeats 3] [--full-repeats 1] [--full-volumes 24] [--full-epochs 300] [--no-full]
                                                   [--clock cpu|wall] [--fit-epochs 5] [--fit-repeats 2]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from vitlab.runtime import keep_freed_memory, prepare_process

prepare_process()  # (first, as train.py does: OpenMP's spin policy before torch)
keep_freed_memory()  # (freed memory reused, as train.py sets it for runs on 3-D volumes)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _timing import best_of  # noqa: E402  (benchmarks/_timing.py)
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from vitlab.models import build_model, parameter_groups  # noqa: E402
from vitlab.outputs.files import save_safetensors  # noqa: E402
from vitlab.qkv.drift import report_drift  # noqa: E402
from vitlab.qkv.spectra import block_spectra, report_spectra  # noqa: E402
from vitlab.qkv.state import head_counts, qkv_state, snapshot_name  # noqa: E402
from vitlab.training.segmentation import soft_dice_loss  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLOCK = "cpu"  # set by --clock


def timed(fn, repeats: int, warmup: bool = True):
    """:func:`best_of` on the clock chosen by ``--clock``."""
    return best_of(fn, repeats, warmup=warmup, clock=CLOCK)


FULL = {"img_size": 96, "feature_size": 48, "depths": (2, 2, 2, 2), "num_heads": (3, 6, 12, 24)}


def quickstart_split(path: Path = ROOT / "configs" / "quickstart_volume.yaml") -> tuple[int, int, int, dict]:
    """Training volumes, batch size, epochs and model arguments of ``configs/quickstart_volume.yaml`` (its data
    module, set up)."""
    import yaml

    from vitlab.data.datamodule import DenseDataModule

    config = yaml.safe_load(Path(path).read_text())
    data = config["data"]
    module = DenseDataModule(**data)
    module.setup("fit")
    if config["trainer"].get("deterministic"):  # as Lightning sets it: torch's deterministic kernels (slower backward)
        torch.use_deterministic_algorithms(True, warn_only=config["trainer"]["deterministic"] == "warn")
    return len(module.samples("train")), data["batch_size"], config["trainer"]["max_epochs"], config["model"]["model_kwargs"]


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
    (``reference``: the Q/K/V before the timed training steps, so drift is not zero).

    Figures are drawn as a run's figure worker draws them (:class:`vitlab.runtime.FigureWorker`, here inline): a
    figure is built the first time its tag is drawn and kept, later epochs update it and redraw what changed.
    ``... figures built``: the first figure epoch (its figures built, the process's first figures);
    ``... figures updated``: a later figure epoch (the fastest of ``repeats``)."""
    from vitlab.runtime import FigureWorker

    heads = head_counts(model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        writer = SummaryWriter(str(out / "tb"))
        epoch = iter(range(1, 1000))
        step = iter(range(1, 10**6))
        worker = FigureWorker(process=False)
        costs = {}

        def snapshot() -> None:
            save_safetensors(qkv_state(model), out / snapshot_name(next(epoch)), {"heads": heads})

        def drift(figures: bool = True) -> None:
            report_drift(writer, reference, qkv_state(model), reference, heads, step=next(step), table_path=out / "drift.csv",
                         figures=figures, figure_worker=worker)

        def spectra(figures: bool = True) -> None:
            report_spectra(writer, block_spectra(qkv_state(model), heads), step=next(step), table_path=out / "spectra.csv",
                           figures=figures, figure_worker=worker)

        costs["QKVSnapshot"] = timed(snapshot, repeats, warmup=False)[0]
        for name, fn in (("QKVDrift", drift), ("QKSpectra", spectra)):
            costs[f"{name} no figures"] = timed(lambda: fn(False), repeats, warmup=False)[0]
            costs[f"{name} figures built"] = timed(fn, 1, warmup=False)[0] - costs[f"{name} no figures"]
            costs[f"{name} figures updated"] = timed(fn, repeats, warmup=False)[0] - costs[f"{name} no figures"]
        writer.close()
        snap_mb = (out / snapshot_name(1)).stat().st_size / 2**20
    return costs, snap_mb, len(heads)


def figure_sets(max_epochs: int, every_n_epochs: int | None = None) -> int:
    """Figure epochs of a run of ``max_epochs`` under the callbacks' default schedule (``figures_due``)."""
    from types import SimpleNamespace

    from vitlab.outputs.tensorboard import figures_due

    trainer = SimpleNamespace(max_epochs=max_epochs)
    return sum(figures_due(trainer, e, every_n_epochs) for e in range(1, max_epochs + 1))


def report(label: str, costs: dict[str, float], epoch_s: float, goal: float, max_epochs: int) -> None:
    for name, seconds in costs.items():
        print(f"  {name:28s} {seconds:.3f} s  ({100 * seconds / epoch_s:.2f} % of an epoch)")
    plain = costs["QKVSnapshot"] + costs["QKVDrift no figures"] + costs["QKSpectra no figures"]
    built = costs["QKVDrift figures built"] + costs["QKSpectra figures built"]
    updated = costs["QKVDrift figures updated"] + costs["QKSpectra figures updated"]
    sets = figure_sets(max_epochs)
    # QKSpectra also draws at fit start (epoch 0): one more set of its figures, counted as an update
    drawn = built + (sets - 1) * updated + costs["QKSpectra figures updated"]
    average = plain + drawn / max_epochs
    for kind, total in (("without figures", plain), ("first figure epoch (figures built)", plain + built),
                        ("later figure epoch (figures updated)", plain + updated),
                        (f"average over a run of {max_epochs} epochs ({sets} figure epochs)", average)):
        print(f"{label}: all three callbacks, {kind} = {total:.3f} s = {100 * total / epoch_s:.2f} % of an epoch  "
              f"(goal <= {goal:g} %)")


def epoch_seconds(run_dir: Path) -> list[float]:
    """Wall seconds of each epoch but the last, from the first timestamp of each value of the ``epoch`` scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    first: dict[int, float] = {}
    for event in acc.Scalars("epoch"):
        first.setdefault(int(event.value), event.wall_time)
    epochs = sorted(first)
    return [first[b] - first[a] for a, b in zip(epochs, epochs[1:])]


def fit_epochs(config: Path, epochs: int, repeats: int) -> None:
    """(c): the quickstart's epochs with and without the figure worker (see the module docstring)."""
    import os
    import subprocess
    import sys

    from vitlab.outputs.tensorboard import figures_due

    best: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for figures in ("off", "auto"):
                name = f"{figures}_{r}"
                subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(config), "--trainer.max_epochs", str(epochs),
                                "--trainer.logger.init_args.save_dir", tmp, "--trainer.logger.init_args.name", name,
                                "--trainer.enable_progress_bar", "false", "--runtime.figures", figures],
                               cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True, capture_output=True)
                seconds = epoch_seconds(Path(tmp) / name / "version_0")
                best[figures] = [min(a, b) for a, b in zip(best[figures], seconds)] if figures in best else seconds
    from types import SimpleNamespace

    due = [figures_due(SimpleNamespace(max_epochs=epochs), e, None) for e in range(1, epochs + 1)]
    print(f"\n(c) the quickstart run itself, {epochs} epochs, figures off vs auto (wall s per epoch, fastest of {repeats}):")
    print("  epoch  " + " ".join(f"{e:>6d}" for e in range(1, len(best['off']) + 1)))
    for figures in ("off", "auto"):
        print(f"  {figures:5s}  " + " ".join(f"{t:6.2f}" for t in best[figures]))
    print("  figures drawn after epochs " + ", ".join(str(e) for e, d in enumerate(due, 1) if d))
    off, auto = sum(best["off"]), sum(best["auto"])
    worst = max((a - o) / o for o, a in zip(best["off"], best["auto"]))
    print(f"  figures' cost: {100 * (auto - off) / off:+.1f} % of the run's epochs, at most {100 * worst:+.1f} % of one epoch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the tiny step and of each callback")
    parser.add_argument("--full-repeats", type=int, default=1, help="timed full-scale steps after one warm-up")
    parser.add_argument("--full-volumes", type=int, default=24, help="full-scale training volumes per epoch")
    parser.add_argument("--full-epochs", type=int, default=300, help="full-scale epochs (medical_swinunetr.yaml)")
    parser.add_argument("--no-full", action="store_true", help="skip (b), the full-scale model")
    parser.add_argument("--fit-epochs", type=int, default=0, help="(c): epochs of the real quickstart run (0: skip)")
    parser.add_argument("--fit-repeats", type=int, default=2, help="(c): runs with and without figures, alternated")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_volume.yaml",
                        help="the quickstart config of (a)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU seconds (user + system, all threads: a 2-thread step counts "
                             "twice its wall time on 2 idle cores; steady on a shared machine); wall: wall-clock seconds")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    print(f"torch threads = {torch.get_num_threads()}, clock = {CLOCK} ({'CPU seconds, all threads' if CLOCK == 'cpu' else 'wall seconds'})")

    # (a) the quickstart volume run
    train, batch, max_epochs, tiny = quickstart_split(args.config)
    torch.manual_seed(0)
    model = build_model("monai:swin_unetr", 2, in_chans=1, **tiny)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.05), lr=5e-3)
    steps = math.ceil(train / batch)
    reference = qkv_state(model)
    step_s, _ = timed(make_step(model, optimizer, batch, 32), args.repeats)
    epoch_s = steps * step_s
    costs, snap_mb, blocks = callback_costs(model, reference, args.repeats)
    print(f"\n(a) quickstart volume run: tiny SwinUNETR 32^3, feature size 12, {blocks} attention blocks, "
          f"one snapshot = {snap_mb:.2f} MiB")
    print(f"  one training step at batch {batch}: {step_s:.3f} s")
    print(f"  epoch = {steps} steps ({train} training volumes / batch {batch}) x {step_s:.3f} s = {epoch_s:.2f} s  (estimated)")
    report("(a) quickstart", costs, epoch_s, 5, max_epochs)
    del model, optimizer
    if args.fit_epochs:
        fit_epochs(args.config, args.fit_epochs, args.fit_repeats)

    if args.no_full:
        return
    # (b) full scale
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(False)  # (medical_swinunetr.yaml sets it too; left out here as before)
    model = build_model("monai:swin_unetr", 2, in_chans=1, **FULL)
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=1e-5), lr=1e-4)
    reference = qkv_state(model)
    step_s, _ = timed(make_step(model, optimizer, 1, 96), args.full_repeats)
    epoch_s = args.full_volumes * step_s
    costs, snap_mb, blocks = callback_costs(model, reference, args.repeats)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n(b) full scale: SwinUNETR 96^3, feature size 48 ({params:.1f} M parameters), {blocks} attention blocks, "
          f"one snapshot = {snap_mb:.2f} MiB")
    print(f"  one training step at batch 1: {step_s:.2f} s (fastest of {args.full_repeats} after a warm-up)")
    print(f"  epoch = {args.full_volumes} volumes x {step_s:.2f} s = {epoch_s:.1f} s  (estimated)")
    report("(b) full scale", costs, epoch_s, 1, args.full_epochs)


if __name__ == "__main__":
    main()
