"""Benchmark: DINO pretraining throughput (multi-crop included) vs the same backbone's supervised step.

Both on the same batch of images, measured side by side in one run: a DINO step = multi-crop (2 global + N local
views) + teacher forward of the 2 global views + student forward/backward of all views + optimizer step + EMA
update; a supervised step = forward/backward of the batch through the classifier + optimizer step.
The literature puts DINO's multi-crop at about 2-3x a supervised step. Prints images/s and the ratio.
Run: ``python benchmarks/bench_dino.py [--model quickstart|vit_s16] [--batch 32] [--local-crops 4] [--device cuda --bf16]``
(``vit_s16``: ViT-S/16 at 224 px, 96 px local views: the GPU configuration of the issue).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from lightly.models.utils import update_momentum

from _timing import best_of  # benchmarks/_timing.py
from vitlab import models
from vitlab.training.dino import DINOModule

MODELS = {
    "quickstart": ("swin_tiny_patch4_window7_224", dict(img_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                                         window_size=4, strict_img_size=False), 64, 32),
    "vit_s16": ("vit_small_patch16_224", dict(dynamic_img_size=True), 224, 96),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="quickstart")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--local-crops", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name, kwargs, size, local = MODELS[args.model]
    dev = torch.device(args.device)
    torch.manual_seed(0)
    dino = DINOModule(model_name=name, model_kwargs=kwargs, in_chans=1, local_crops=args.local_crops, local_size=local,
                      out_dim=1024 if args.model == "quickstart" else 65536, hidden_dim=256 if args.model == "quickstart" else 2048,
                      bottleneck_dim=64 if args.model == "quickstart" else 256).to(dev)
    sup = models.build_model(name, num_classes=2, in_chans=1, **kwargs).to(dev)
    images = torch.randn(args.batch, 1, size, size, device=dev)
    labels = torch.randint(0, 2, (args.batch,), device=dev)
    opt_d = torch.optim.AdamW([p for p in [*dino.model.parameters(), *dino.head.parameters()] if p.requires_grad], lr=1e-4)
    opt_s = torch.optim.AdamW(sup.parameters(), lr=1e-4)
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)

    def dino_step():
        with autocast():
            teacher, student = dino.dino_outputs(dino.multicrop(images))
            loss = dino.criterion([t.float() for t in teacher], [s.float() for s in student], teacher_temp=0.04)
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

    t_dino, _ = best_of(dino_step, args.repeats)
    t_sup, _ = best_of(sup_step, args.repeats)
    views = f"2x{size}px + {args.local_crops}x{local}px"
    print(f"{args.model} ({name}), batch {args.batch}, device {dev}{' bf16' if args.bf16 else ''}, threads {torch.get_num_threads()}")
    print(f"  DINO step ({views} views): {t_dino * 1e3:8.1f} ms  {args.batch / t_dino:8.1f} images/s")
    print(f"  supervised step ({size}px):      {t_sup * 1e3:8.1f} ms  {args.batch / t_sup:8.1f} images/s")
    print(f"  DINO / supervised time per image: {t_dino / t_sup:.2f}x  (literature: about 2-3x)")


if __name__ == "__main__":
    main()
