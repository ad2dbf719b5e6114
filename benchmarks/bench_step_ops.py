"""Operations a SwinUNETR training step launches: vitlab's segmentation step against the bare loop of the same model.

    python benchmarks/bench_step_ops.py [--size 64] [--feature-size 12] [--steps 3] [--rounds 3]

On a GPU SwinUNETR's step is bound by the host (about 2,900 kernel launches a step at the recipe's scale): every
operation the step adds is host time. This counts, with ``torch.profiler`` on the CPU, the aten operations of one
training step of each (their mean over ``--steps`` steps, after two warm-up steps), and prints the operations whose
counts differ most:

1. the bare loop ``bench_gpu.py`` runs: ``vitlab.models.build_model("monai:swin_unetr")``, MONAI's ``DiceCELoss``,
   AdamW over all parameters, forward + backward + step on one random batch;
2. :class:`vitlab.training.SegmentationModule`'s ``training_step`` (its weighted cross-entropy and soft Dice) on the
   same model and batch, then backward and the optimiser ``configure_optimizers`` builds (its parameter groups), as
   Lightning's automatic optimisation runs them (logging left out).

Both run with the shifted-window masks that ``build_model`` keeps (MONAI makes them again at every forward); the bare
loop is also counted and timed with MONAI's own ``compute_mask``, what a plain MONAI loop runs. Counts are of every
aten operation (nested ones included) and of the top-level ones (those the Python code and autograd call, each a
trip through the dispatcher); times are the fastest of ``--rounds`` interleaved steps, on the CPU's clock.

Under deterministic algorithms (the recipe's ``trainer.deterministic: warn``) torch also fills every fresh tensor
with NaN unless ``runtime.fill_uninitialized`` is false (vitlab's default): the step's count with and without is
printed too.

Target: vitlab's step launches no more operations than the bare loop's (ratio <= 1.0x). What the fit adds around
the step (Lightning's loop, the loader, callbacks) is ``bench_step_overhead.py``'s and ``bench_gpu_ladder.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def count_ops(step, steps: int) -> tuple[collections.Counter, float]:
    """Mean count per step of every aten operation ``step`` runs (after two warm-up steps), and the mean count of the
    top-level ones (no aten operation above them)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    counts = collections.Counter(e.name for e in events)
    top = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return collections.Counter({name: n / steps for name, n in counts.items()}), top / steps


def fastest(steps: dict, rounds: int) -> dict[str, float]:
    """Fastest wall time of each step over ``rounds`` rounds that run them one after the other."""
    import time

    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="cube side of the patch (voxels)")
    parser.add_argument("--feature-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (0: no timing)")
    args = parser.parse_args()
    import torch
    from monai.losses import DiceCELoss
    from monai.networks.nets import swin_unetr

    from vitlab.models import build_model
    from vitlab.training import SegmentationModule

    torch.manual_seed(0)
    kwargs = {"img_size": args.size, "feature_size": args.feature_size, "depths": [2, 2, 2, 2], "num_heads": [3, 6, 12, 24],
              "drop_rate": 0.0}
    batch, p = 2, args.size
    images, labels = torch.randn(batch, 1, p, p, p), torch.randint(0, 2, (batch, p, p, p))

    model = build_model("monai:swin_unetr", 2, 1, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)

    def bare() -> None:
        loss = loss_fn(model(images), labels.unsqueeze(1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    module = SegmentationModule(num_classes=1, model_name="monai:swin_unetr", pretrained=False, model_kwargs=kwargs,
                                sliding_window=[p, p, p])
    module.trainer = type("Trainer", (), {"estimated_stepping_batches": 10, "max_epochs": 1})()
    module.log_batch = lambda *a, **k: None  # (logging needs a fit)
    configured = module.configure_optimizers()
    module_optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    targets = [{"mask": labels[i]} for i in range(batch)]

    def vitlab_step() -> None:
        loss = module.training_step((images, targets), 0)
        module_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        module_optimizer.step()

    kept_masks = swin_unetr.compute_mask  # build_model put the kept masks in place

    def stock() -> None:  # the bare loop with MONAI's own masks, made at every forward
        swin_unetr.compute_mask = kept_masks.__wrapped__
        try:
            bare()
        finally:
            swin_unetr.compute_mask = kept_masks

    (bare_ops, bare_top), (vitlab_ops, vitlab_top) = count_ops(bare, args.steps), count_ops(vitlab_step, args.steps)
    stock_ops, stock_top = count_ops(stock, args.steps)
    total_bare, total_vitlab, total_stock = sum(bare_ops.values()), sum(vitlab_ops.values()), sum(stock_ops.values())
    print(f"SwinUNETR feature size {args.feature_size}, {p}^3 patch, batch {batch}, on the CPU: aten operations a training step "
          "(all / top-level)")
    print(f"  bare loop with MONAI's masks made at every forward {total_stock:.0f} / {stock_top:.0f}")
    print(f"  bare loop with the kept masks {total_bare:.0f} / {bare_top:.0f} = {total_bare / total_stock:.3f}x / "
          f"{bare_top / stock_top:.3f}x of MONAI's")
    print(f"  vitlab's step {total_vitlab:.0f} / {vitlab_top:.0f} = {total_vitlab / total_bare:.3f}x / {vitlab_top / bare_top:.3f}x "
          f"the bare loop's (target <= 1.0x), {total_vitlab / total_stock:.3f}x / {vitlab_top / stock_top:.3f}x MONAI's; "
          f"{len(module_optimizer.param_groups)} parameter groups")
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(True, warn_only=True)  # the recipe's trainer.deterministic: warn
    filled = {}
    for fill in (True, False):
        torch.utils.deterministic.fill_uninitialized_memory = fill
        filled[fill] = count_ops(vitlab_step, args.steps)[0]
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    print(f"  vitlab's step under deterministic algorithms (the recipe's trainer.deterministic: warn): "
          f"{sum(filled[True].values()):.0f} operations, {filled[True]['aten::fill_']:.0f} of them fill_, with fresh "
          f"tensors NaN-filled (torch's default); {sum(filled[False].values()):.0f} and "
          f"{filled[False]['aten::fill_']:.0f} without (runtime.fill_uninitialized: false, vitlab's default)")
    if args.rounds:
        times = fastest({"stock": stock, "bare": bare, "vitlab": vitlab_step}, args.rounds)
        print(f"  fastest step of {args.rounds}, s: bare loop with MONAI's masks {times['stock']:.3f}, with the kept masks "
              f"{times['bare']:.3f} ({times['stock'] / times['bare']:.2f}x as fast), vitlab's step {times['vitlab']:.3f}")
    names = sorted(set(bare_ops) | set(vitlab_ops), key=lambda n: -abs(vitlab_ops[n] - bare_ops[n]))
    print("  the largest differences (per step):")
    for name in names[:12]:
        print(f"    {name:32s} bare {bare_ops[name]:8.1f}  vitlab {vitlab_ops[name]:8.1f}")


if __name__ == "__main__":
    main()
