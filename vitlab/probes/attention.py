"""probe.py attention: attention maps per block and head, attention rollout, attention vs patch angle (Philip et al.)."""

from __future__ import annotations

import argparse

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from vitlab import models
from vitlab.analysis.rollout import attention_rollout, pool_tokens, rollout_map
from vitlab.analysis.stats import AngleStats, attention_vs_angle
from vitlab.probes.activations import add_recording_arguments, block_label, record_batches, require_attention, selected_blocks
from vitlab.probes.common import add_common_arguments
from vitlab.outputs.images import hstack_panels, vstack_panels
from vitlab.outputs.figures import heatmap_figure
from vitlab.outputs.files import write_csv

HELP = """Attention maps per block and head on the image, attention rollout, and attention vs patch angle (Philip et al.).

Maps: the class token's attention to the patches (models without one, e.g. Swin via its dense token x token
form: the attention each patch receives, averaged over queries), overlaid on the first --show images.
Rollout (Abnar & Zuidema 2020) through all blocks (Swin stages pooled to the last grid). Angle: mean attention
per 5-degree bin of the angle between the patch embeddings (norm1 output) of query and key, per head and
block, and the attention mass on similar (< 90 deg) vs dissimilar (> 90 deg) patches; attention_angle.csv,
attention_mass.csv.

example:
  python probe.py attention --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt --num-images 64 --show 4
"""
DEFAULT_IMAGES = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    group = add_recording_arguments(parser, batch_size=8)
    group.add_argument("--show", type=int, default=4, help="images drawn with their attention maps and rollout (default 4)")
    group.add_argument("--panel-px", type=int, default=112, help="side of each drawn panel in pixels (default 112)")
    group.add_argument("--bin-degrees", type=float, default=5.0, help="angle bin width in degrees (default 5)")
    group.add_argument("--residual-weight", type=float, default=0.5, help="rollout: weight of the identity (residual) in each layer (default 0.5)")
    group.add_argument("--head-fusion", default="mean", choices=["mean", "max", "min"], help="rollout: how heads are combined (default mean)")


def run(ctx) -> None:
    args = ctx.args
    require_attention(ctx.model, "attention")
    if args.show < 0 or args.panel_px < 8:
        raise ValueError(f"--show must be >= 0 and --panel-px >= 8, got {args.show} and {args.panel_px}")
    batch = ctx.images(DEFAULT_IMAGES)
    views = selected_blocks(ctx.model, args.blocks)
    if args.show:
        draw_maps(ctx, batch.pixels[: args.show], batch.inputs[: args.show], views)
    angle_statistics(ctx, batch.inputs, views)


# ---------------------------------------------------------------------------------------------- maps


def draw_maps(ctx, pixels: torch.Tensor, inputs: torch.Tensor, views) -> None:
    """Per selected block: images x (image, heads, head mean) map panels; rollout through all blocks."""
    args = ctx.args
    everything = models.blocks(ctx.model)  # rollout needs every block, not just the selected ones
    with torch.no_grad(), models.record_attention(ctx.model, to_cpu=True) as rec:
        ctx.model(inputs.to(ctx.device))
    chosen = {view.name for view in views}
    last_grid = rec.grids[everything[-1].name]
    pooled, skipped = [], None
    for view in everything:
        dense = rec.dense(view.name)  # (S, H, N, N), original token order
        grid, prefix = rec.grids[view.name], view.num_prefix_tokens
        if view.name in chosen:
            maps = rollout_map(dense.flatten(0, 1), prefix, grid).reshape(dense.shape[0], dense.shape[1], *grid)  # (S, H, gh, gw)
            panel = map_panel(pixels, torch.cat([maps, maps.mean(1, keepdim=True)], 1), args.panel_px)
            ctx.writer.add_image(f"attention_map/{view.name} (rows: images; columns: image, heads 0-{dense.shape[1] - 1}, head mean)", panel, view.global_index)
        factor = grid[0] // last_grid[0]
        if factor < 1 or grid != (factor * last_grid[0], factor * last_grid[1]) or (factor > 1 and prefix):
            skipped = f"{view.name} has grid {grid}, not a multiple of the last grid {last_grid}"
        elif skipped is None:
            pooled.append(pool_tokens(dense, grid, factor) if factor > 1 else dense)
    if skipped is not None:
        print(f"probe.py attention: no rollout: {skipped}")
        return
    rollout = attention_rollout(pooled, residual_weight=args.residual_weight, head_fusion=args.head_fusion)  # (S, N, N)
    maps = rollout_map(rollout, everything[-1].num_prefix_tokens, last_grid)  # (S, gh, gw)
    ctx.writer.add_image("attention_rollout (rows: images; columns: image, rollout)", map_panel(pixels, maps[:, None], args.panel_px), 0)
    ctx.writer.flush()


def map_panel(pixels: torch.Tensor, maps: torch.Tensor, size: int) -> np.ndarray:
    """CHW uint8 grid: one row per image, the image then each map overlaid on it.

    Args:
        pixels: (S, C, H, W) images in [0, 1].
        maps: (S, M, gh, gw) maps on the token grid.
        size: Panel side in pixels.
    """
    rows = []
    for image, image_maps in zip(pixels, maps):
        base = grey_rgb(image, size)  # (3, size, size) float in [0, 1]
        panels = [to_uint8(base)] + [to_uint8(overlay(base, m)) for m in image_maps]
        rows.append(hstack_panels(panels, gap=2))
    return vstack_panels(rows, gap=2)


def grey_rgb(image: torch.Tensor, size: int) -> torch.Tensor:
    """(C, H, W) in [0, 1] -> (3, size, size): RGB kept, other channel counts averaged to grey."""
    image = image.float().cpu()
    rgb = image if image.shape[0] == 3 else image.mean(0, keepdim=True).expand(3, -1, -1)
    return F.interpolate(rgb[None], size=(size, size), mode="bilinear", align_corners=False)[0].clamp(0, 1)


def overlay(base: torch.Tensor, heat: torch.Tensor, alpha: float = 0.6) -> torch.Tensor:
    """Blend a token-grid map (min-max scaled, inferno colours, one block per token) onto a (3, S, S) image."""
    heat = heat.double().cpu()
    lo, hi = heat.min(), heat.max()
    scaled = ((heat - lo) / (hi - lo) if hi > lo else torch.zeros_like(heat)).float()
    up = F.interpolate(scaled[None, None], size=base.shape[-2:], mode="nearest")[0, 0]  # (S, S)
    colour = torch.from_numpy(matplotlib.colormaps["inferno"](up.numpy())[..., :3]).permute(2, 0, 1).float()
    return (1 - alpha) * base + alpha * colour


def to_uint8(image: torch.Tensor) -> np.ndarray:
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------------- angle


def angle_statistics(ctx, inputs: torch.Tensor, views) -> None:
    """Attention against the angle between query and key patch embeddings, merged over all images."""
    args = ctx.args
    parts: dict[str, list[tuple[AngleStats, int]]] = {view.name: [] for view in views}
    for rec in record_batches(ctx.model, inputs, ["qkv_input"], views, args.batch_size, ctx.device, "attention: angles", attention=True):
        for view in views:
            probs, slots = rec.attention.patch_windows(view.name)  # (b*G, H, T, T), (G, T)
            h = rec.capture[view.name, "qkv_input"]  # (b, P, C) patch tokens
            padded = torch.cat([h, h.new_zeros(h.shape[0], 1, h.shape[2])], 1)  # pad slots -> zero vector
            groups = padded[:, slots.reshape(-1)].reshape(-1, slots.shape[1], h.shape[2])  # (b*G, T, C)
            parts[view.name].append((attention_vs_angle(probs, groups, args.bin_degrees), probs.shape[0]))
    count = inputs.shape[0]
    merged = {view.name: combine_angle_stats(parts[view.name]) for view in views}
    bins, masses = [], []
    for view in views:
        s = merged[view.name]
        for head in range(s.mean_attention.shape[0]):
            masses.append({"layer": view.name, "block_index": view.global_index, "head": head, "mass_below_90": float(s.mass_below_90[head]),
                           "mass_above_90": float(s.mass_above_90[head]), "self_attention": float(s.self_attention[head]), "n_images": count})
            for b in range(s.bin_counts.numel()):
                bins.append({"layer": view.name, "head": head, "bin_low_deg": float(s.bin_edges[b]), "bin_high_deg": float(s.bin_edges[b + 1]),
                             "pairs": int(s.bin_counts[b]), "mean_attention": float(s.mean_attention[head, b])})
        for key in ("mass_below_90", "mass_above_90", "self_attention"):
            ctx.writer.add_scalar(f"attention_angle/{key}", float(getattr(s, key).mean()), view.global_index)
        ctx.writer.add_figure(f"attention_angle/{view.name}", angle_figure(view, s, count), view.global_index)
    write_csv(ctx.out / "attention_angle.csv", bins)
    write_csv(ctx.out / "attention_mass.csv", masses)
    heads = max(merged[v.name].mean_attention.shape[0] for v in views)
    grid = torch.full((len(views), heads), float("nan"))
    for i, view in enumerate(views):
        grid[i, : merged[view.name].mass_above_90.numel()] = merged[view.name].mass_above_90.float()
    fig = heatmap_figure(grid, title="attention mass on dissimilar patches (angle > 90 deg)", xlabel="head", ylabel="block",
                         xticklabels=[str(h) for h in range(heads)], yticklabels=[v.name for v in views], cmap="coolwarm", colorbar_label="share of attention")
    ctx.writer.add_figure("attention_angle/mass_above_90 (blocks x heads)", fig, 0)
    print(f"probe.py attention: attention mass on patches at > 90 deg, head mean per block ({count} images): "
          + ", ".join(f"{v.name} {float(merged[v.name].mass_above_90.mean()):.3f}" for v in views))


def combine_angle_stats(parts: list[tuple[AngleStats, int]]) -> AngleStats:
    """Merge :class:`AngleStats` of disjoint batches exactly.

    Args:
        parts: (stats, number of attention groups B*G in that batch) pairs; all with the same bins and T.

    Returns:
        The statistics of all batches together.
    """
    first = parts[0][0]
    sums = torch.zeros_like(first.mean_attention)  # (H, bins) attention summed per bin
    counts = torch.zeros_like(first.bin_counts)
    self_sum = torch.zeros_like(first.self_attention)
    below = torch.zeros_like(first.self_attention)
    above = torch.zeros_like(first.self_attention)
    groups = 0
    for stats, weight in parts:
        part_sums = torch.nan_to_num(stats.mean_attention) * stats.bin_counts  # empty bins: NaN -> 0
        total = part_sums.sum(1)  # (H,) off-diagonal attention mass of the batch
        sums += part_sums
        counts += stats.bin_counts
        self_sum += stats.self_attention * weight
        below += stats.mass_below_90 * total
        above += stats.mass_above_90 * total
        groups += weight
    total = sums.sum(1)
    return AngleStats(first.bin_edges, counts, sums / counts, self_sum / groups, below / total, above / total)


def angle_figure(view, stats: AngleStats, count: int):
    """Mean attention per angle bin, one line per head, with the pair count per bin."""
    fig, ax = plt.subplots(figsize=(5.8, 3.6), dpi=90)
    centres = (0.5 * (stats.bin_edges[1:] + stats.bin_edges[:-1])).numpy()
    for head in range(stats.mean_attention.shape[0]):
        ax.plot(centres, stats.mean_attention[head].numpy(), marker=".", label=f"head {head}: {100 * float(stats.mass_above_90[head]):.0f}% > 90")
    ax.axvline(90.0, color="k", lw=0.6)
    ax.set_xlabel("angle between query and key patch embeddings (deg)")
    ax.set_ylabel("mean attention weight")
    twin = ax.twinx()
    twin.bar(centres, stats.bin_counts.numpy(), width=float(stats.bin_edges[1] - stats.bin_edges[0]), color="grey", alpha=0.2)
    twin.set_ylabel("token pairs")
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_title(f"{block_label(view)}: attention vs patch angle, N = {count} images", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig
