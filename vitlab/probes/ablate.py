"""probe.py ablate (= ``probe.py --ablate X``): the Attentionless article's ablation survey by representation inversion."""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from vitlab import models
from vitlab.analysis.probing import dice_counts, dice_from_counts
from vitlab.probes.common import ProbeContext, add_common_arguments, progress
from vitlab.probes.streams import ImageStream, image_stream
from vitlab.probes.invert import Variant, add_inversion_arguments, resolve_layers, run_survey
from vitlab.outputs.files import write_csv

HELP = """Ablation survey (Attentionless article): invert each layer of the intact and of the ablated model, side by side.

--ablate removes a component from the --blocks (default all): residual, layernorm, attention, mlp, or the finer
residual_attention, residual_mlp, norm1, norm2 (MLP-Mixer: token_mixing, residual_token_mixing). Repeat --ablate to
survey several ablations; join names with + to remove several at once. Writes per-layer grids (original | intact |
ablated), errors / noise baseline / pass / steps vs depth, summary.csv and, with labels, accuracy.csv.

A 3-D checkpoint (vit3d:, monai:swin_unetr, monai:unetr) is measured on --accuracy-images volumes of its data, read as
training reads them (no inversion survey: that draws 2-D images): a classifier's accuracy.csv as above; a segmenter's
dice.csv, the Dice of each foreground class (training's definition: argmax voxels pooled over the volumes) of whole
volumes predicted as validation predicts them (sliding window when the run used one).

example:
  python probe.py --ablate attention --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt
  python probe.py ablate --ablate layernorm --ablate attention+layernorm --model vit_base_patch32_224 --pretrained --layers 0,5,11
  python probe.py ablate --ablate attention --ablate mlp --checkpoint runs/quickstart_volume/version_0/checkpoints/last.ckpt
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
                       help="labelled images for the intact vs ablated accuracy (default 32; 0 = skip); a 3-D model: volumes "
                            "for its accuracy, or a segmenter's Dice")
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
    if len(models.input_size(model)) == 4:  # (C, I, J, K): a 3-D model, measured on volumes, no inversion survey
        print("probe.py ablate: a 3-D model: the inversion survey (2-D images) is skipped; the ablations are measured by "
              + ("the Dice of each class" if ctx.loaded.task == "segmentation" else "accuracy"))
        if args.accuracy_images <= 0:
            print("probe.py ablate: --accuracy-images 0: nothing measured")
        elif ctx.loaded.task == "segmentation":
            dice(ctx, variants)
        elif not ctx.loaded.head_trained:
            print(f"probe.py ablate: {ctx.loaded.untrained_head('accuracy skipped')}")
        else:
            accuracy(ctx, variants)
        return
    layers = resolve_layers(model, args.layers)
    images = ctx.images(default_count=4)
    if args.accuracy_images > 0 and not ctx.loaded.head_trained:
        print(f"probe.py ablate: {ctx.loaded.untrained_head('accuracy skipped')}")
    elif args.accuracy_images > 0:
        accuracy(ctx, variants)
    run_survey(ctx, images, variants, layers)


def measured_stream(ctx: ProbeContext) -> ImageStream:
    """The ``--accuracy-images`` images (a 3-D model: volumes, with their label maps when the data has them)."""
    args = argparse.Namespace(**{**vars(ctx.args), "num_images": ctx.args.accuracy_images})
    return image_stream(args, ctx.loaded, ctx.args.accuracy_images, volumes=True)


@torch.no_grad()
def accuracy(ctx: ProbeContext, variants: list[Variant], batch_size: int | None = None) -> list[dict[str, Any]]:
    """Top-1 accuracy of every variant on ``--accuracy-images`` labelled images or volumes (skipped without labels),
    read a batch at a time (each batch once, through every variant)."""
    stream = measured_stream(ctx)
    if not stream.labelled:
        print("probe.py ablate: the images have no labels (--images files): accuracy skipped")
        return []
    batch_size = batch_size or (2 if stream.volumetric else 32)
    correct: dict[str, list[torch.Tensor]] = {variant.name: [] for variant in variants}
    for batch in progress(stream.image_batches(batch_size), "accuracy", -(-stream.count // batch_size)):
        for variant in variants:
            with variant.context():
                logits = variant.model(batch.inputs.to(ctx.device)).cpu()
            correct[variant.name].append(logits.argmax(1) == batch.labels)  # (b,)
    rows = []
    for variant in variants:
        hits = torch.cat(correct[variant.name]).float()  # (N,)
        rows.append({"variant": variant.name, "images": len(hits), "accuracy": float(hits.mean())})
        ctx.writer.add_scalar(f"accuracy/{variant.tag}", rows[-1]["accuracy"], 0)
    write_csv(ctx.out / "accuracy.csv", rows)
    listed = ", ".join(f"{row['variant']} {row['accuracy']:.1%}" for row in rows)
    print(f"accuracy: {listed} (on {rows[0]['images']} {'volumes' if stream.volumetric else 'images'})")
    return rows


@torch.no_grad()
def dice(ctx: ProbeContext, variants: list[Variant], batch_size: int = 1) -> list[dict[str, Any]]:
    """Dice of each foreground class of a 3-D segmenter, every variant, on ``--accuracy-images`` volumes and their label
    maps: whole volumes through :func:`~vitlab.models.inference.segment_logits` (the checkpoint's sliding window and
    overlap, as validation), argmax voxels pooled over the volumes; a batch of volumes at a time."""
    from vitlab.models.inference import segment_logits

    stream = measured_stream(ctx)
    if stream.read_mask is None or not stream.mask_classes:
        print("probe.py ablate: the volumes have no label maps (a data section with mask_classes and a mask for every "
              "volume; not --images files): Dice skipped")
        return []
    classes = stream.mask_classes
    window, overlap = ctx.loaded.hparams.get("sliding_window"), float(ctx.loaded.hparams.get("sliding_overlap", 0.25))
    counts = {variant.name: torch.zeros(3, len(classes), dtype=torch.float64) for variant in variants}
    for batch in progress(stream.image_batches(batch_size), "dice", -(-stream.count // batch_size)):
        for variant in variants:
            with variant.context():
                logits = segment_logits(variant.model, batch.inputs.to(ctx.device), window, overlap)  # (b, K+1, I, J, K)
            counts[variant.name] += dice_counts(logits.argmax(1).cpu(), batch.masks, len(classes))
    rows = []
    for variant in variants:
        scores = dice_from_counts(counts[variant.name])
        row: dict[str, Any] = {"variant": variant.name, "volumes": stream.count, "dice": float(scores.nanmean())}
        for name, value in zip(classes, scores.tolist()):
            row[f"dice_{name}"] = value
            ctx.writer.add_scalar(f"dice_{name}/{variant.tag}", value, 0)
        ctx.writer.add_scalar(f"dice/{variant.tag}", row["dice"], 0)
        rows.append(row)
    write_csv(ctx.out / "dice.csv", rows)
    listed = ", ".join(f"{row['variant']} {row['dice']:.3f}" for row in rows)
    print(f"dice (mean over {', '.join(classes)}): {listed} (on {stream.count} volumes)")
    return rows
