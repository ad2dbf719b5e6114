"""probe.py invert: layer representation inversion (Attentionless article), and the survey shared by ablate / transplant.

A *survey* inverts the same images through several model variants (intact / ablated / transplanted) at
each chosen layer and writes, per layer as it finishes: a labelled figure (rows: images; columns: original, then
one inversion per variant), scalars of every figure vs depth (one curve per variant; overlaid in the
Custom Scalars tab), the optimisation curves, ``summary.csv`` (means over images) and
``inversion_images.csv`` (per image). Only blocks up to the inverted layer run (``models.forward_until``).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from vitlab import models
from vitlab.analysis.inversion import SEED_SIGMAS, InversionResult, invert, sigma_label, with_normalization
from vitlab.probes.common import ProbeContext, add_common_arguments, progress
from vitlab.probes.streams import ImageBatch, image_labels
from vitlab.outputs.figures import chw_to_image, image_table_figure
from vitlab.outputs.files import write_csv, write_json

HELP = """Invert layer representations (Attentionless article): find an image whose layer output matches the original's.

Per layer: input error ||a-a_g||/||a||, feature error ||O(a)-O(a_g)||/||O(a)||, the noise baseline
||O(a)-O(a')|| (a' = a + N(0, sigma^2), sigma 1/18 and 1/20, mean of 8 draws), pass/fail and steps to pass.
Adam + cosine learning rate, TV regulariser, early stop when the criterion holds; only blocks up to the layer run.

example:
  python probe.py invert --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt --layers embed,0,5,11
"""
DISPLAY_MIN_SIDE = 128  # images smaller than this are drawn larger (nearest) in the figures


def add_inversion_arguments(parser: argparse.ArgumentParser, default_layers: str = "all") -> None:
    """``--layers`` and the inversion settings (shared by invert, ablate and transplant)."""
    group = parser.add_argument_group("inversion (Mahendran & Vedaldi 2015; the Attentionless article's criterion)")
    group.add_argument("--layers", default=default_layers,
                       help=f"layers to invert, comma-separated: 'embed' (after patch + position embedding), block "
                            f"indices or names (stage1.block0), 'all' = every block (default {default_layers})")
    group.add_argument("--steps", type=int, default=300, help="maximum Adam steps per layer (default 300)")
    group.add_argument("--lr", type=float, default=0.05, help="initial learning rate in pixel units, cosine-decayed")
    group.add_argument("--tv-weight", type=float, default=0.01, help="weight of the squared total-variation penalty")
    group.add_argument("--sigma", type=parse_fraction, default=Fraction(1, 18),
                       help="noise std of the early-stop criterion in pixel units (default 1/18; "
                            "1/18 and 1/20 are always reported)")
    group.add_argument("--noise-draws", type=int, default=8, help="noise draws averaged for the baseline (default 8)")
    group.add_argument("--no-early-stop", action="store_true", help="run every step even after the criterion holds")
    group.add_argument("--check-every", type=int, default=10, help="steps between early-stop checks (default 10)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_inversion_arguments(parser)


def parse_fraction(text: str) -> Fraction:
    """``"1/18"`` or ``"0.05"`` -> a positive number (argparse type)."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a positive number such as 1/18 or 0.05, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number such as 1/18 or 0.05, got {text!r}")
    return value


@dataclass(frozen=True)
class Layer:
    """An inverted layer: ``name`` (``embed`` or a block name), ``ref`` for forward_until, ``depth`` (embed 0)."""

    name: str
    ref: int | str
    depth: int


def resolve_layers(model: nn.Module, spec: str) -> list[Layer]:
    """Parses ``--layers`` against ``model``; raises a one-line ValueError naming the valid layers."""
    views = models.blocks(model)
    chosen: dict[int, Layer] = {}
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--layers is empty: give 'embed', 'all', block indices 0-{len(views) - 1} or names")
    for item in items:
        if item == "all":
            chosen.update({v.global_index + 1: Layer(v.name, v.global_index, v.global_index + 1) for v in views})
        elif item == "embed":
            chosen[0] = Layer("embed", "embed", 0)
        else:
            try:
                view = models.select_blocks(model, item)[0]
            except ValueError as err:
                raise ValueError(f"--layers: {err}; also 'embed' or 'all'") from None
            chosen[view.global_index + 1] = Layer(view.name, view.global_index, view.global_index + 1)
    return [chosen[depth] for depth in sorted(chosen)]


@dataclass
class Variant:
    """One model variant of a survey: a name, the model and a context entered around its forwards."""

    name: str
    model: nn.Module
    context: Callable[[], ContextManager[Any]] = field(default=contextlib.nullcontext)

    @property
    def tag(self) -> str:
        """The name as a TensorBoard tag component."""
        return re.sub(r"[^0-9A-Za-z_.-]+", "_", self.name).strip("_")


def invert_layer(variant: Variant, layer: Layer, pixels: torch.Tensor, args: argparse.Namespace) -> InversionResult:
    """Runs :func:`~vitlab.analysis.inversion.invert` for one variant and layer with the CLI settings."""
    mean, std = models.normalization(variant.model)
    with variant.context():
        features = with_normalization(lambda x: models.forward_until(variant.model, x, layer.ref), mean, std)
        return invert(features, pixels, steps=args.steps, lr=args.lr, tv_weight=args.tv_weight, sigma=float(args.sigma),
                      report_sigmas=SEED_SIGMAS, noise_draws=args.noise_draws, early_stop=not args.no_early_stop,
                      check_every=args.check_every, generator=torch.Generator().manual_seed(args.seed),
                      progress=lambda steps: progress(steps, f"{variant.name} @ {layer.name}", len(steps)))


def run_survey(ctx: ProbeContext, images: ImageBatch, variants: list[Variant], layers: list[Layer]) -> list[dict[str, Any]]:
    """Inverts ``images`` at every layer through every variant, writing results as each layer finishes.

    Returns:
        The ``summary.csv`` rows (one per variant and layer; means over images).
    """
    args, writer = ctx.args, ctx.writer
    if args.steps < 0 or args.lr <= 0 or args.tv_weight < 0 or args.noise_draws < 1 or args.check_every < 1:
        raise ValueError(f"need --steps >= 0, --lr > 0, --tv-weight >= 0, --noise-draws >= 1, --check-every >= 1 "
                         f"(got {args.steps}, {args.lr}, {args.tv_weight}, {args.noise_draws}, {args.check_every})")
    sigmas = list(dict.fromkeys([float(args.sigma), *SEED_SIGMAS]))
    write_json(ctx.out / "inversion.json", {
        "variants": [v.name for v in variants], "layers": [layer.name for layer in layers], "images": images.names,
        "steps": args.steps, "lr": args.lr, "tv_weight": args.tv_weight, "sigma": float(args.sigma),
        "sigmas_reported": sigmas, "noise_draws": args.noise_draws, "early_stop": not args.no_early_stop,
        "parametrization": "clamp (projected Adam in pixel units [0, 1])", "seed": args.seed})
    writer.add_custom_scalars(_layout(variants, sigmas))
    pixels = images.pixels.to(ctx.device)  # (N, C, H, W)
    summary: list[dict[str, Any]] = []
    per_image: list[dict[str, Any]] = []
    for layer in progress(layers, desc="inverting layers", total=len(layers)):
        columns, results = [images.pixels], []
        for variant in variants:
            result = invert_layer(variant, layer, pixels, args)
            columns.append(result.image.cpu())
            rows = result.per_image()
            results.append(rows)
            per_image += [{"variant": variant.name, "layer": layer.name, "depth": layer.depth, "image": name, **row}
                          for name, row in zip(images.names, rows)]
            summary.append({"variant": variant.name, "layer": layer.name, "depth": layer.depth, **_mean_row(rows)})
            _log_layer(writer, variant, layer, result, summary[-1])
        writer.add_figure(f"inversion/depth{layer.depth:02d}_{layer.name}",
                          inversion_figure(layer, images, variants, columns, results, float(args.sigma)), layer.depth)
        write_csv(ctx.out / "summary.csv", summary)
        write_csv(ctx.out / "inversion_images.csv", per_image)
        writer.flush()
    if summary:
        writer.add_figure("inversion/curves_vs_depth", _depth_figure(summary, sigmas))
        print_summary(summary, sigmas)
    return summary


def inversion_figure(layer: Layer, images: ImageBatch, variants: list[Variant], columns: list[torch.Tensor],
                     results: list[list[dict[str, Any]]], sigma: float):
    """One row per image: the original, then each variant's inversion at ``layer``, each under its feature error
    against the noise baseline at ``sigma`` and whether it passed (the criterion: feature error below the baseline).

    ``columns``: the originals and each variant's inversions, (N, C, H, W) in [0, 1]; ``results``: each variant's
    :meth:`~vitlab.analysis.inversion.InversionResult.per_image` rows.
    """
    label = sigma_label(sigma)
    cells = [[chw_to_image(column[i]) for column in columns] for i in range(len(images.names))]
    notes = [[""] + [_note(rows[i], label) for rows in results] for i in range(len(images.names))]
    side = max(images.pixels.shape[-2:])
    title = (f"inversions at {layer.name} (depth {layer.depth}); under each, its relative feature and input errors "
             f"and the noise baseline at sigma {label.removeprefix('sigma_').replace('_', '/')}")
    return image_table_figure(cells, columns=["original", *[v.name for v in variants]], row_labels=image_labels(images),
                              notes=notes, title=title, panel_px=max(DISPLAY_MIN_SIDE, side))


def _note(row: dict[str, Any], label: str) -> str:
    """An inversion's figures under it: feature error against the noise baseline (passed: below it), input error."""
    passed = row[f"passed_{label}"]
    return (f"feature error {row['feature_error']:.3f}\n{'<' if passed else '>='} noise {row[f'noise_error_{label}']:.3f}: "
            f"{'passed' if passed else 'not passed'}\ninput error {row['input_error']:.3f}")


def enlarge(images: torch.Tensor, min_side: int = DISPLAY_MIN_SIDE) -> torch.Tensor:
    """Nearest-neighbour upscaling by an integer factor so small images are visible in TensorBoard: (N, C, H, W)."""
    factor = max(1, min_side // max(1, min(images.shape[-2:])))
    return F.interpolate(images, scale_factor=factor, mode="nearest") if factor > 1 else images


def _mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-image rows -> means; ``passed_*`` become fractions; ``steps_to_pass_*`` average the images that passed."""
    result: dict[str, Any] = {"images": len(rows)}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key.startswith("steps_to_pass_"):
            hits = [v for v in values if v >= 0]
            result[key] = sum(hits) / len(hits) if hits else ""
        else:
            result[key] = sum(float(v) for v in values) / len(values)
    return result


def _log_layer(writer, variant: Variant, layer: Layer, result: InversionResult, row: dict[str, Any]) -> None:
    for key, value in row.items():
        if key not in ("variant", "layer", "depth", "images", "steps_run") and value != "":
            writer.add_scalar(f"{variant.tag}/{key}", float(value), layer.depth)
    stride = max(1, result.steps_run // 100)  # <= ~100 points per optimisation curve, the last one included
    for step in sorted({*range(0, result.steps_run + 1, stride), result.steps_run}):
        for name, curve in (("feature_error", result.feature_error), ("input_error", result.input_error)):
            writer.add_scalar(f"{variant.tag}/optimisation/{layer.name}/{name}", float(curve[step].mean()), step)


def _layout(variants: list[Variant], sigmas: list[float]) -> dict[str, Any]:
    """Custom Scalars charts overlaying the variants (and noise baselines) against depth."""
    noise = [f"{v.tag}/noise_error_{sigma_label(s)}" for v in variants for s in sigmas]
    charts = {
        "input error ||a-a_g||/||a||": ["Multiline", [f"{v.tag}/input_error" for v in variants]],
        "feature error vs noise baseline": ["Multiline", [f"{v.tag}/feature_error" for v in variants] + noise],
    }
    for s in sigmas:
        label = sigma_label(s)
        charts[f"fraction passed ({label})"] = ["Multiline", [f"{v.tag}/passed_{label}" for v in variants]]
        charts[f"steps to pass ({label})"] = ["Multiline", [f"{v.tag}/steps_to_pass_{label}" for v in variants]]
    return {"inversion vs depth (x = depth: 0 embed, l+1 after block l)": charts}


def _depth_figure(summary: list[dict[str, Any]], sigmas: list[float]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=90)
    for name in dict.fromkeys(row["variant"] for row in summary):
        rows = [row for row in summary if row["variant"] == name]
        depth = [row["depth"] for row in rows]
        line, = axes[0].plot(depth, [row["input_error"] for row in rows], "o-", label=name)
        axes[1].plot(depth, [row["feature_error"] for row in rows], "o-", color=line.get_color(), label=name)
        for s, style in zip(sigmas, (":", "--", "-.")):
            axes[1].plot(depth, [row[f"noise_error_{sigma_label(s)}"] for row in rows], style, color=line.get_color(),
                         alpha=0.6, label=f"{name} noise {sigma_label(s)}")
        label = sigma_label(sigmas[0])
        axes[2].plot(depth, [row[f"passed_{label}"] for row in rows], "o-", color=line.get_color(), label=name)
    titles = ("input error ||a-a_g||/||a||", "feature error (solid) vs noise baseline",
              f"fraction passed ({sigma_label(sigmas[0])})")
    for ax, title, ylabel in zip(axes, titles, ("relative error", "relative error", "fraction of the images")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("depth (0 = embed, l+1 = after block l)")
        ax.set_ylabel(ylabel)
    axes[1].set_yscale("log")
    axes[2].set_ylim(-0.05, 1.05)
    axes[1].legend(fontsize=6)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def print_summary(summary: list[dict[str, Any]], sigmas: list[float]) -> None:
    """A console table of the survey."""
    from rich.console import Console
    from rich.table import Table

    labels = [sigma_label(s) for s in sigmas]
    short = [label.removeprefix("sigma_").replace("_", "/") for label in labels]
    table = Table(title="inversion (means over images; noise = ||O(a)-O(a')||/||O(a)|| at sigma)")
    columns = ("variant", "layer", "input err", "feature err", *[f"noise {s}" for s in short], *[f"pass {s}" for s in short])
    for column in (*columns, "steps"):
        table.add_column(column, justify="left" if column in ("variant", "layer") else "right", no_wrap=True)
    for row in summary:
        table.add_row(row["variant"], row["layer"], f"{row['input_error']:.3g}", f"{row['feature_error']:.3g}",
                      *[f"{row[f'noise_error_{lab}']:.3g}" for lab in labels], *[f"{row[f'passed_{lab}']:.0%}" for lab in labels],
                      f"{row['steps_run']:.0f}")
    Console(width=max(Console().width, 140)).print(table)


def run(ctx: ProbeContext) -> None:
    layers = resolve_layers(ctx.model, ctx.args.layers)
    images = ctx.images(default_count=4)
    run_survey(ctx, images, [Variant("model", ctx.model)], layers)
