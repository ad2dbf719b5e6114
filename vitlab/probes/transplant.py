"""probe.py transplant: an untrained model receives trained parts, then inversion runs on both (Attentionless article)."""

from __future__ import annotations

import argparse

from vitlab import models
from vitlab.probes.common import ProbeContext, add_common_arguments
from vitlab.probes.invert import Variant, add_inversion_arguments, resolve_layers, run_survey
from vitlab.outputs.files import write_json

HELP = """Give trained parts to a fresh untrained model, then invert both (the Attentionless article's embedding / LayerNorm experiments).

The trained model is the loaded one (--checkpoint / --config / --model --pretrained); each recipient is a fresh model
of its architecture (the same random draw as the untrained baseline). Each --parts (repeatable) makes one recipient:
a comma list of patch_embed, pos_embed, cls_token, norm, head, embed, and per block block@i, norm1@i, attn@i
(MLP-Mixer token_mixing@i), norm2@i, mlp@i. Columns: original | untrained | recipients (| trained with
--include-trained). Default layers: embed,0. Writes transplant.json (copied tensors) and the inversion outputs.

example:
  python probe.py transplant --model vit_base_patch32_224 --pretrained --parts patch_embed --parts patch_embed,norm1@0
"""


def parse_parts(text: str) -> tuple[str, ...]:
    """``"patch_embed,norm1@0"`` -> ("patch_embed", "norm1@0") (argparse type; names checked per model later)."""
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    if not parts:
        raise argparse.ArgumentTypeError("--parts needs at least one part name, e.g. patch_embed,pos_embed,norm1@0")
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    group = parser.add_argument_group("transplant")
    group.add_argument("--parts", type=parse_parts, action="append", required=True, metavar="PART[,PART]",
                       help="trained parts given to one untrained recipient, repeatable (e.g. patch_embed,norm1@0)")
    group.add_argument("--include-trained", action="store_true", help="also invert the trained donor itself")
    add_inversion_arguments(parser, default_layers="embed,0")


def run(ctx: ProbeContext) -> None:
    args, trained = ctx.args, ctx.model
    untrained = ctx.loaded.fresh(seed=args.seed).to(ctx.device)
    variants = [Variant("untrained", untrained)]
    copied: dict[str, list[list]] = {}
    for parts in args.parts:
        if "head" in parts and not ctx.loaded.head_trained:
            raise ValueError(ctx.loaded.untrained_head(f"--parts {','.join(parts)}"))
        recipient = ctx.loaded.fresh(seed=args.seed).to(ctx.device)  # same draw as `untrained`
        try:
            report = models.transplant(recipient, trained, parts)
        except ValueError as err:
            raise ValueError(f"--parts {','.join(parts)}: {err}") from None
        name = f"untrained+{','.join(parts)}"
        variants.append(Variant(name, recipient))
        copied[name] = [[key, list(shape)] for key, shape in report.copied]
    if args.include_trained:
        variants.append(Variant("trained", trained))
    write_json(ctx.out / "transplant.json", {"donor": ctx.loaded.source, "untrained_seed": args.seed, "copied": copied})
    layers = resolve_layers(trained, args.layers)
    run_survey(ctx, ctx.images(default_count=4), variants, layers)
