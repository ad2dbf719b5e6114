"""Operations a SwinUNETR training step launches: vitlab's segmentation step against the bare loop of the same model.

    python benchmarks/bench_step_ops.py [--size 64] [--feature-size 12] [--steps 3]

On a GPU SwinUNETR's step is bound by the host (about 2,900 kernel launches a step at the recipe's scale): every
operation the step adds is host time. This counts, with ``torch.profiler`` on the CPU, the aten operations of one
training step of each (their mean over ``--steps`` steps, after two warm-up steps), and prints the operations whose
counts differ most:

1. the bare loop ``bench_gpu.py`` runs: ``vitlab.models.build_model("monai:swin_unetr")``, MONAI's ``DiceCELoss``,
   AdamW over all parameters, forward + backward + step on one random batch;
2. :class:`vitlab.training.SegmentationModule`'s ``training_step`` (its weighted cross-entropy and soft Dice) on the
   same model and batch, then backward and the optimiser ``configure_optimizers`` builds (its parameter groups), as
   Lightning's automatic optimisation runs them (logging left out).

Target: vitlab's step launches no more operations than the bare loop's (ratio <= 1.0x). What the fit adds around
the step (Lightning's loop, the loader, callbacks) is ``bench_step_overhead.py``'s and ``bench_gpu_ladder.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def count_ops(step, steps: int) -> collections.Counter:
    """Mean count per step of every aten operation ``step`` runs (after two warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    return collections.Counter({name: n / steps for name, n in counts.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="cube side of the patch (voxels)")
    parser.add_argument("--feature-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch
    from monai.losses import DiceCELoss

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

    bare_ops, vitlab_ops = count_ops(bare, args.steps), count_ops(vitlab_step, args.steps)
    total_bare, total_vitlab = sum(bare_ops.values()), sum(vitlab_ops.values())
    print(f"SwinUNETR feature size {args.feature_size}, {p}^3 patch, batch {batch}, on the CPU: aten operations a training step")
    print(f"  bare loop {total_bare:.0f}, vitlab's step {total_vitlab:.0f} = {total_vitlab / total_bare:.3f}x "
          f"(target <= 1.0x); {len(module_optimizer.param_groups)} parameter groups")
    names = sorted(set(bare_ops) | set(vitlab_ops), key=lambda n: -abs(vitlab_ops[n] - bare_ops[n]))
    print("  the largest differences (per step):")
    for name in names[:12]:
        print(f"    {name:32s} bare {bare_ops[name]:8.1f}  vitlab {vitlab_ops[name]:8.1f}")


if __name__ == "__main__":
    main()
