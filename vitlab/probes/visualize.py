"""probe.py visualize: class-maximising inputs (Attentionless article) and MLP-neuron visualisation (Ghiasi et al. 2022)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from vitlab import models
from vitlab.analysis.featurevis import (
    CLASS_RECIPE,
    NEURON_RECIPE,
    VisResult,
    class_maximization,
    neuron_maximization,
    recipe_with,
)
from vitlab.analysis.inversion import with_normalization
from vitlab.probes.common import ProbeContext, add_common_arguments, progress
from vitlab.probes.streams import planar_input
from vitlab.probes.invert import enlarge
from vitlab.outputs.figures import chw_to_image, image_table_figure
from vitlab.outputs.images import image_grid
from vitlab.outputs.files import write_csv

HELP = """Generate inputs that drive a class logit to a target (Attentionless article) or maximise one MLP hidden unit (Ghiasi et al. 2022).

Classes: loss (z_c - T)^2 with T = 100, Adam, 3x3 Gaussian blur after each step with sigma annealed 2.4 -> 0,
roll jitter of about a patch from step 200. Neurons: patch-token mean of an MLP hidden unit (after GELU), with
jitter, colour shift, decaying noise, small TV, cosine learning rate. Images every --every steps (TensorBoard
slider), logit / probability / activation curves, visualize.csv.

example:
  python probe.py visualize --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt --classes all --neurons 5:0-7
"""
MAX_AUTO_CLASSES = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, images=False)
    group = parser.add_argument_group("visualisation")
    group.add_argument("--classes", default="all",
                       help=f"class indices (comma list, ranges 0-3), 'all' (first {MAX_AUTO_CLASSES}) or 'none'")
    group.add_argument("--neurons", action="append", default=None, metavar="BLOCK:UNITS",
                       help="MLP hidden units to visualise, repeatable: e.g. 5:0-7 or stage1.block0:3,9; "
                            "default: units 0-3 of the middle block; 'none' to skip")
    group.add_argument("--steps", type=int, default=400, help="Adam steps (default 400)")
    group.add_argument("--lr", type=float, default=None,
                       help=f"learning rate (default {CLASS_RECIPE.lr} for classes, {NEURON_RECIPE.lr} for neurons)")
    group.add_argument("--target", type=float, default=100.0, help="the constant logit target T (default 100)")
    group.add_argument("--blur-start", type=float, default=CLASS_RECIPE.blur_start, help="blur sigma at step 0 (default 2.4)")
    group.add_argument("--jitter", type=int, default=None, help="max roll jitter in pixels (default: the patch size)")
    group.add_argument("--jitter-from", type=int, default=CLASS_RECIPE.jitter_from,
                       help="first step of the class-visualisation jitter (default 200)")
    group.add_argument("--every", type=int, default=50, help="log the images every this many steps (default 50)")


def parse_indices(text: str, upper: int, what: str) -> list[int]:
    """``"0,3,5-7"`` -> [0, 3, 5, 6, 7], each in [0, upper); one-line ValueError otherwise."""
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        first, dash, last = item.partition("-")
        try:
            chunk = list(range(int(first), int(last) + 1)) if dash else [int(item)]
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not an index or a range like 0-7") from None
        bad = [v for v in chunk if not 0 <= v < upper]
        if bad or not chunk:
            raise ValueError(f"{what}: {item!r} is out of range: valid are 0-{upper - 1}")
        values += [v for v in chunk if v not in values]
    return values


def run(ctx: ProbeContext) -> None:
    model, args = ctx.model, ctx.args
    shape = planar_input(model, ctx.loaded.source if ctx.loaded is not None else "the model")  # (C, H, W)
    mean, std = models.normalization(model)
    patch = max(models.embeddings(model).patch_size)
    probe_input = torch.zeros(1, *shape, device=ctx.device)
    with torch.no_grad():
        num_classes = model(probe_input).shape[1]
    classes = _classes(args.classes, num_classes)
    if classes and not ctx.loaded.head_trained:
        if args.classes != "all":  # asked for explicitly: refuse
            raise ValueError(ctx.loaded.untrained_head(f"--classes {args.classes}") + "; use --classes none --neurons ...")
        print(f"probe.py visualize: {ctx.loaded.untrained_head('class visualisation skipped')}")
        classes = []
    neurons = _neurons(model, args.neurons, probe_input)
    if not classes and not neurons:
        raise ValueError("nothing to visualise: --classes none and --neurons none")
    jitter = patch if args.jitter is None else args.jitter
    common = dict(steps=args.steps, lr=args.lr, jitter=jitter, snapshot_every=args.every)
    rows: list[dict[str, Any]] = []
    if classes:
        recipe = recipe_with(CLASS_RECIPE, blur_start=args.blur_start, jitter_from=args.jitter_from, **common)
        result = class_maximization(with_normalization(model, mean, std), classes, shape, args.target, recipe,
                                    torch.Generator().manual_seed(args.seed), ctx.device, _bar("classes"))
        known = ctx.loaded.class_names or []
        names = [known[c] if c < len(known) else f"class{c}" for c in classes]
        _write(ctx, "class", names, result, ("logit", "probability"), rows)
    for block, units in neurons.items():
        prefix = models.select_blocks(model, block)[0].num_prefix_tokens

        def hidden(x: torch.Tensor, block=block, prefix=prefix) -> torch.Tensor:
            return models.forward_until(model, x, block, site="mlp_hidden")[:, prefix:]  # (K, patches, hidden)

        recipe = recipe_with(NEURON_RECIPE, **common)
        result = neuron_maximization(with_normalization(hidden, mean, std), units, shape, recipe,
                                     torch.Generator().manual_seed(args.seed), ctx.device, _bar(f"neurons {block}"))
        _write(ctx, f"neuron/{block}", [f"unit{u}" for u in units], result, ("activation",), rows)


def _bar(desc: str):
    """A progress bar over an optimisation's step range."""
    return lambda steps: progress(steps, desc, len(steps))


def _classes(spec: str, num_classes: int) -> list[int]:
    if spec == "none":
        return []
    if spec == "all":
        if num_classes > MAX_AUTO_CLASSES:
            print(f"probe.py visualize: the model has {num_classes} classes; visualising the first "
                  f"{MAX_AUTO_CLASSES} (choose with --classes)")
        return list(range(min(num_classes, MAX_AUTO_CLASSES)))
    return parse_indices(spec, num_classes, "--classes")


def _neurons(model, specs: list[str] | None, probe_input: torch.Tensor) -> dict[str, list[int]]:
    """``--neurons`` -> {block name: hidden units}, validated against each block's MLP width."""
    if specs == ["none"]:
        return {}
    views = models.blocks(model)
    specs = specs or [f"{views[len(views) // 2].name}:0-3"]
    chosen: dict[str, list[int]] = {}
    for spec in specs:
        block, sep, units = spec.rpartition(":")
        if not sep or not block:
            raise ValueError(f"--neurons {spec!r}: expected BLOCK:UNITS such as 3:0-7 or stage1.block0:5 (or 'none')")
        try:
            view = models.select_blocks(model, block)[0]
        except ValueError as err:
            raise ValueError(f"--neurons {spec!r}: {err}") from None
        with torch.no_grad():
            width = models.forward_until(model, probe_input, view.global_index, site="mlp_hidden").shape[-1]
        chosen.setdefault(view.name, [])
        for unit in parse_indices(units, width, f"--neurons {spec!r} (MLP hidden units)"):
            if unit not in chosen[view.name]:
                chosen[view.name].append(unit)
    return chosen


PER_ROW = 8  # images in a row of the final figure
CURVE_NAMES = {"logit": "logit", "probability": "p", "activation": "activation"}


def final_figure(group: str, names: list[str], result: VisResult, final_keys: tuple[str, ...], target: float):
    """The optimisation's final images, each titled with its target and its final values (logit and probability
    of the class, or the unit's mean activation), at most :data:`PER_ROW` a row."""
    cells, titles = [], []
    for k, name in enumerate(names):
        if k % PER_ROW == 0:
            cells.append([])
            titles.append([])
        cells[-1].append(chw_to_image(result.image[k]))
        values = ", ".join(f"{CURVE_NAMES.get(key, key)} {float(result.curves[key][-1, k]):.3g}" for key in final_keys)
        titles[-1].append(f"{name}\n{values}")
    steps = next(iter(result.curves.values())).shape[0]
    what = (f"inputs driving each class's logit to {target:g}" if group == "class"
            else f"inputs maximising each MLP hidden unit of {group.removeprefix('neuron/')} (patch-token mean after GELU)")
    return image_table_figure(cells, titles=titles, title=f"{what}, after {steps} steps", panel_px=max(128, max(result.image.shape[-2:])))


def _write(ctx: ProbeContext, group: str, names: list[str], result: VisResult, final_keys: tuple[str, ...],
           rows: list[dict[str, Any]]) -> None:
    """Snapshots (slider over steps), per-step curves and a final grid of one optimisation; appends its
    ``visualize.csv`` rows to ``rows`` and rewrites the table."""
    writer = ctx.writer
    for snapshot, step in zip(result.snapshots, result.snapshot_steps):  # (K, C, H, W) per snapshot
        for name, image in zip(names, snapshot):
            writer.add_image(f"{group}/{name}", image_grid(enlarge(image[None]), ncol=1), step)
    steps = next(iter(result.curves.values())).shape[0]
    stride = max(1, steps // 200)
    for key, curve in result.curves.items():  # (steps, K)
        for step in range(0, steps, stride):
            for k, name in enumerate(names):
                writer.add_scalar(f"{group}/{name}/{key}", float(curve[step, k]), step + 1)
    writer.add_figure(f"{group}/all_final", final_figure(group, names, result, final_keys, ctx.args.target), steps)
    rows += [{"kind": group.split("/")[0], "group": group, "target": name, "steps": steps,
              **{f"final_{key}": float(result.curves[key][-1, k]) for key in final_keys}}
             for k, name in enumerate(names)]
    write_csv(ctx.out / "visualize.csv", rows, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
    writer.flush()
