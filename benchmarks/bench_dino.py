"""Benchmark: DINO pretraining throughput (multi-crop included) vs the same backbone's supervised step.

Both on the same batch of images, measured side by side in one run: a DINO step = multi-crop (2 global + N local
views) + teacher forward of the 2 global views + student forward/backward of all views + optimizer step + EMA
update; a supervised step = forward/backward of the batch through the classifier + optimizer step.
The literature puts DINO's multi-crop at about 2-3x a supervised step. Prints images/s and the ratio.
The two steps alternate in every repeat (a shared machine's load hits both alike); the fastest of each counts.
Run: ``python benchmarks/bench_dino.py [--model quickstart|vit_s16] [--batch 32] [--local-crops N] [--local-size S]
[--device cuda --bf16]`` (``quickstart``: the model, head and multi-crop of ``configs/dino_pretrain.yaml``;
``vit_s16``: ViT-S/16 at 224 px, 96 px local views: the GPU configuration of the issue).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
import yaml
import torch.nn.functional as F
from lightly.models.utils import update_momentum

from vitlab import models
from vitlab.training.dino import DINOModule

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dino_pretrain.yaml"
VIT_S16 = dict(model_name="vit_small_patch16_224", model_kwargs=dict(dynamic_img_size=True), local_crops=4, local_size=96,
               out_dim=65536, hidden_dim=2048, bottleneck_dim=256)


def dino_kwargs(model: str) -> tuple[dict, int]:
    """DINOModule arguments and the global view size: the quickstart's from its config, or ViT-S/16's."""
    if model == "vit_s16":
        return dict(VIT_S16), 224
    cfg = yaml.safe_load(CONFIG.read_text())["model"]
    return cfg, int(cfg["model_kwargs"]["img_size"])


def interleaved(fns: list, repeats: int) -> list[float]:
    """Fastest wall time of each function, run alternately ``repeats`` times after one warm-up round."""
    best = [float("inf")] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if r:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["quickstart", "vit_s16"], default="quickstart")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--local-crops", type=int, default=None, help="default: the config's model.local_crops")
    parser.add_argument("--local-size", type=int, default=None, help="default: the config's model.local_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs, size = dino_kwargs(args.model)
    kwargs.update({k: v for k, v in (("local_crops", args.local_crops), ("local_size", args.local_size)) if v is not None})
    name, local = kwargs["model_name"], kwargs["local_size"]
    dev = torch.device(args.device)
    torch.manual_seed(0)
    dino = DINOModule(in_chans=1, **kwargs).to(dev)
    dino.teacher_model.eval()  # as in training: the teacher runs without stochastic depth
    sup = models.build_model(name, num_classes=2, in_chans=1, **kwargs["model_kwargs"]).to(dev)
    images = torch.randn(args.batch, 1, size, size, device=dev)
    labels = torch.randint(0, 2, (args.batch,), device=dev)
    opt_d = torch.optim.AdamW([p for p in [*dino.model.parameters(), *dino.head.parameters()] if p.requires_grad], lr=1e-4)
    opt_s = torch.optim.AdamW(sup.parameters(), lr=1e-4)
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)

    def dino_step():
        with autocast():
            teacher, student = dino.dino_outputs(dino.multicrop(images))
            loss = dino.criterion([t.float() for t in teacher], [s.float() for s in student], teacher_temp=dino.hparams.teacher_temp)
        opt_d.zero_grad(set_to_none=True)
        loss.backward()
        opt_d.step()
        update_momentum(dino.model, dino.teacher_model, 0.996)
        update_momentum(dino.head, dino.teacher_head, 0.996)
        sync()

    def sup_step():
        with autocast():
            loss = F.cross_entropy(sup(images).float(), labels)
        opt_s.zero_grad(set_to_none=True)
        loss.backward()
        opt_s.step()
        sync()

    def crop_only():
        dino.multicrop(images)
        sync()

    t_dino, t_sup, t_crop = interleaved([dino_step, sup_step, crop_only], args.repeats)
    views = f"2x{size}px + {dino.multicrop.local_crops}x{local}px"
    print(f"{args.model} ({name}), batch {args.batch}, device {dev}{' bf16' if args.bf16 else ''}, threads {torch.get_num_threads()}")
    print(f"  DINO step ({views} views): {t_dino * 1e3:8.1f} ms  {args.batch / t_dino:8.1f} images/s")
    print(f"  supervised step ({size}px):      {t_sup * 1e3:8.1f} ms  {args.batch / t_sup:8.1f} images/s")
    print(f"  DINO / supervised time per image: {t_dino / t_sup:.2f}x  (literature: about 2-3x)")
    n_local, share = dino.multicrop.local_crops, (local / size) ** 2  # a local view's share of a global view's tokens
    floor = 2 + 2 / 3 + n_local * share  # with a backward pass costing two forwards
    print(f"    of which multi-crop augmentation {t_crop * 1e3:.1f} ms ({t_crop / t_dino:.0%}); networks alone {(t_dino - t_crop) / t_sup:.2f}x")
    print(f"    by operation count: 2 student forward/backward passes + 2 teacher forwards (2 + 2/3) + {n_local} local views "
          f"x {share:.2f} of a global view's tokens = {floor:.2f}x")


if __name__ == "__main__":
    main()
