"""probe.py ablate (= ``probe.py --ablate X``): the Attentionless article's ablation survey by representation inversion."""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from vitlab import models
from vitlab.probes.common import ImageBatch, ProbeContext, add_common_arguments, load_images
from vitlab.probes.invert import Variant, add_inversion_arguments, resolve_layers, run_survey
from vitlab.outputs.files import write_csv

HELP = """Ablation survey (Attentionless article): invert each layer of the intact and of the ablated model, side by side.

--ablate removes a component from the --blocks (default all): residual, layernorm, attention, mlp, or the finer
residual_attention, residual_mlp, norm1, norm2 (MLP-Mixer: token_mixing, residual_token_mixing). Repeat --ablate to
survey several ablations; join names with + to remove several at once. Writes per-layer grids (original | intact |
ablated), errors / noise baseline / pass / steps vs depth, summary.csv and, with labels, accuracy.csv.

example:
  python probe.py --ablate attention --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt
  python probe.py ablate --ablate layernorm --ablate attention+layernorm --model vit_base_patch32_224 --pretrained --layers 0,5,11
"""
ABLATION_NAMES = ("residual", "residual_attention", "residual_mlp", "residual_token_mixing", "layernorm", "norm1", "norm2",
                  "attention", "token_mixing", "mlp")


def parse_ablation(text: str) -> tuple[str, ...]:
    """``"attention+layernorm"`` -> ("attention", "layernorm") (argparse type; names checked per family later)."""
    names = tuple(name.strip() for name in text.split("+"))
    for name in names:
        if name not in ABLATION_NAMES:
            raise argparse.ArgumentTypeError(f"unknown ablation {name!r}: choose from {', '.join(ABLATION_NAMES)} "
                                             f"(join several with +, e.g. attention+layernorm)")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    group = parser.add_argument_group("ablation")
    group.add_argument("--ablate", type=parse_ablation, action="append", required=True, metavar="NAME[+NAME]",
                       help=f"component(s) to remove, repeatable: {', '.join(ABLATION_NAMES)}")
    group.add_argument("--blocks", default=None,
                       help="blocks to ablate, comma-separated indices or names (default: every block)")
    group.add_argument("--accuracy-images", type=int, default=32,
                       help="labelled images for the intact vs ablated accuracy (default 32; 0 = skip)")
    add_inversion_arguments(parser, default_layers="all")


def run(ctx: ProbeContext) -> None:
    model, args = ctx.model, ctx.args
    blocks = [item.strip() for item in args.blocks.split(",") if item.strip()] if args.blocks else None
    if blocks is not None:
        try:
            models.select_blocks(model, blocks)
        except ValueError as err:
            raise ValueError(f"--blocks: {err}") from None
    variants = [Variant("intact", model)]
    for names in args.ablate:
        try:
            with models.ablated(model, names, blocks):
                pass
        except ValueError as err:
            raise ValueError(f"--ablate {'+'.join(names)}: {err}") from None
        variants.append(Variant(f"no {'+'.join(names)}", model, functools.partial(models.ablated, model, names, blocks)))
    layers = resolve_layers(model, args.layers)
    images = ctx.images(default_count=4)
    if args.accuracy_images > 0 and not ctx.loaded.head_trained:
        print(f"probe.py ablate: {ctx.loaded.untrained_head('accuracy skipped')}")
    elif args.accuracy_images > 0:
        accuracy(ctx, variants)
    run_survey(ctx, images, variants, layers)


@torch.no_grad()
def accuracy(ctx: ProbeContext, variants: list[Variant], batch_size: int = 32) -> list[dict[str, Any]]:
    """Top-1 accuracy of every variant on ``--accuracy-images`` labelled images (skipped without labels)."""
    args = argparse.Namespace(**{**vars(ctx.args), "num_images": ctx.args.accuracy_images})
    images: ImageBatch = load_images(args, ctx.loaded, ctx.args.accuracy_images)
    if images.labels is None:
        print("probe.py ablate: the images have no labels (--images files): accuracy skipped")
        return []
    rows = []
    for variant in variants:
        with variant.context():
            logits = torch.cat([variant.model(chunk.to(ctx.device)).cpu() for chunk in images.inputs.split(batch_size)])
        correct = (logits.argmax(1) == images.labels).float()  # (N,)
        rows.append({"variant": variant.name, "images": len(correct), "accuracy": float(correct.mean())})
        ctx.writer.add_scalar(f"accuracy/{variant.tag}", rows[-1]["accuracy"], 0)
    write_csv(ctx.out / "accuracy.csv", rows)
    listed = ", ".join(f"{row['variant']} {row['accuracy']:.1%}" for row in rows)
    print(f"accuracy: {listed} (on {rows[0]['images']} images)")
    return rows
