"""probe.py attention: attention maps per block and head, attention rollout, attention vs patch angle (Philip et al.)."""

from __future__ import annotations

import argparse
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from vitlab import models
from vitlab.analysis.attention_geometry import DistanceStats, attention_vs_distance, merge_distance_stats, token_centres
from vitlab.analysis.rollout import attention_rollout, pool_tokens, pool_window_attention, rollout_map
from vitlab.analysis.stats import AngleStats, attention_vs_angle
from vitlab.probes.activations import add_recording_arguments, block_label, record_batches, require_attention, selected_blocks
from vitlab.probes.attention_volume import montage_figure, montage_title, query_maps, query_voxel, rollout_maps
from vitlab.probes.common import add_common_arguments
from vitlab.probes.streams import image_labels
from vitlab.outputs.figures import heatmap_figure
from vitlab.outputs.files import write_csv

HELP = """Attention maps per block and head on the image, attention rollout, attention vs patch angle (Philip et al.)
and attention vs query-key distance.

Maps: the class token's attention to the patches (models without one, e.g. Swin via its dense token x token
form: the attention each patch receives, averaged over queries), overlaid on the first --show images.
Rollout (Abnar & Zuidema 2020) through all blocks (Swin stages pooled to the last grid). Angle: mean attention
per 5-degree bin of the angle between the patch embeddings (norm1 output) of query and key, per head and
block, and the attention mass on similar (< 90 deg) vs dissimilar (> 90 deg) patches; attention_angle.csv,
attention_mass.csv.
Distance: mean attention weight per distance bin between query and key token centres, per block and head, and
the attention-weighted mean distance (Dosovitskiy et al.'s attention distance); patch tokens only, Swin pairs
within a window; attention_distance.csv, attention_distance_mean.csv. In mm for 3-D models, in pixels for 2-D.

3-D models (volumes): per block, the attention of the token holding a query voxel (--query, default
the centre voxel) drawn on the axial, coronal and sagittal slices through it (per head, head mean, and the
class token's where there is one); rollout the same way (SwinUNETR stages pooled to the last grid).

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
    group.add_argument("--query", type=int, nargs=3, metavar=("I", "J", "K"), default=None,
                       help="3-D models: query voxel (model input coordinates) whose attention is drawn (default: the centre voxel)")
    group.add_argument("--distance-bin-mm", type=float, default=5.0,
                       help="attention vs distance: bin width in mm for 3-D models (default 5); 2-D models: bins of one first-block patch (px)")


def run(ctx) -> None:
    args = ctx.args
    require_attention(ctx.model, "attention")
    if args.show < 0 or args.panel_px < 8 or args.distance_bin_mm <= 0:
        raise ValueError(f"--show must be >= 0, --panel-px >= 8 and --distance-bin-mm > 0, got {args.show}, {args.panel_px} and {args.distance_bin_mm}")
    stream = ctx.image_stream(DEFAULT_IMAGES, volumes=True)  # volumes for a 3-D model, images otherwise
    if args.query is not None and not stream.volumetric:
        raise ValueError("--query I J K: a voxel of a 3-D model's input; this model takes 2-D images")
    views = selected_blocks(ctx.model, args.blocks)
    show = min(args.show, stream.count)
    if show:
        first = stream.batch(range(show))  # pixels (S, C, H, W) or (S, C, I, J, K), the model inputs, names, labels
        draw_maps(ctx, first.pixels, first.inputs, views, stream.spacing, image_labels(first))
    token_statistics(ctx, stream, views)


# ---------------------------------------------------------------------------------------------- maps


def draw_maps(ctx, pixels: torch.Tensor, inputs: torch.Tensor, views, spacing: tuple[float, float, float] | None = None,
              row_labels: list[str] | None = None) -> None:
    """Per selected block: images x (image, heads, head mean) maps on the images; rollout through all blocks.

    3-D models (``spacing``: mm per voxel): per selected block and volume a montage of the query voxel's token's
    attention on three orthogonal slices (:mod:`vitlab.probes.attention_volume`), rollout the same way.
    """
    args = ctx.args
    everything = models.blocks(ctx.model)  # rollout needs every block, not just the selected ones
    size = tuple(models.input_size(ctx.model)[1:])  # (H, W) or (I, J, K)
    voxel = query_voxel(args.query, size) if spacing is not None else None
    with torch.no_grad(), models.record_attention(ctx.model, to_cpu=True) as rec:
        ctx.model(inputs.to(ctx.device))
    chosen = {view.name for view in views}
    last_grid = rec.grids[everything[-1].name]
    pooled, skipped = [], None
    for view in everything:
        grid, prefix = rec.grids[view.name], view.num_prefix_tokens
        if view.name in chosen and voxel is not None:
            labels, maps, token = query_maps(rec, view, voxel, size)  # (S, R, P)
            what = f"{block_label(view)}: attention of the query token to every token"
            for s, volume in enumerate(pixels):
                fig = montage_figure(volume, maps[s], labels, grid, token, voxel, spacing, montage_title(what, voxel, token, grid, size, spacing, f"volume {s}"))
                ctx.writer.add_figure(f"attention_query/{view.name} volume {s} (rows: {', '.join(labels)}; columns: axial, coronal, sagittal)", fig, view.global_index)
        elif view.name in chosen:
            dense = rec.dense(view.name)  # (S, H, N, N), original token order
            maps = rollout_map(dense.flatten(0, 1), prefix, grid).reshape(dense.shape[0], dense.shape[1], *grid)  # (S, H, gh, gw)
            columns = [f"head {h}" for h in range(dense.shape[1])] + ["head mean"]
            what = "class token's attention to each patch" if prefix else "attention each patch receives, mean over queries"
            fig = map_figure(pixels, torch.cat([maps, maps.mean(1, keepdim=True)], 1), columns, row_labels, f"{block_label(view)}: {what}",
                             args.panel_px)
            ctx.writer.add_figure(f"attention_map/{view.name} (rows: images; columns: image, heads 0-{dense.shape[1] - 1}, head mean)", fig,
                                  view.global_index)
        factor = grid[0] // last_grid[0]
        if factor < 1 or tuple(grid) != tuple(factor * g for g in last_grid) or (factor > 1 and prefix):
            skipped = f"{view.name} has grid {grid}, not a multiple of the last grid {last_grid}"
        elif skipped is None and view.window_size is not None:  # Swin: pooled from the windows, no N x N matrix
            pooled.append(pool_window_attention(*rec.patch_windows(view.name), grid, factor))
        elif skipped is None:
            dense = rec.attentions[view.name]  # (S, H, N, N) as recorded
            pooled.append(pool_tokens(dense, grid, factor) if factor > 1 else dense)
    if skipped is not None:
        print(f"probe.py attention: no rollout: {skipped}")
        return
    rollout = attention_rollout(pooled, residual_weight=args.residual_weight, head_fusion=args.head_fusion)  # (S, N, N)
    prefix = everything[-1].num_prefix_tokens
    if voxel is not None:
        labels, maps, token = rollout_maps(rollout, last_grid, prefix, voxel, size)
        what = f"attention rollout through all {len(everything)} blocks" + (" (stages pooled to the last grid)" if len(set(rec.grids.values())) > 1 else "")
        for s, volume in enumerate(pixels):
            fig = montage_figure(volume, maps[s], labels, last_grid, token, voxel, spacing, montage_title(what, voxel, token, last_grid, size, spacing, f"volume {s}"),
                                 colour_label="rollout weight")
            ctx.writer.add_figure(f"attention_rollout/volume {s} (rows: {', '.join(labels)}; columns: axial, coronal, sagittal)", fig, 0)
    else:
        maps = rollout_map(rollout, prefix, last_grid)  # (S, gh, gw)
        what = f"attention rollout through all {len(everything)} blocks" + (", class token's row" if prefix else ", mean over queries")
        fig = map_figure(pixels, maps[:, None], ["rollout"], row_labels, what, args.panel_px, colour_label="rollout weight")
        ctx.writer.add_figure("attention_rollout (rows: images; columns: image, rollout)", fig, 0)
    ctx.writer.flush()


def map_figure(pixels: torch.Tensor, maps: torch.Tensor, columns: list[str], row_labels: list[str] | None, title: str, size: int,
               colour_label: str = "attention weight"):
    """One row per image: the image, then each map drawn over it (one block per token), with a colour bar per row.

    A row shares one colour scale, from 0 to the row's largest weight, so that its heads compare; the bar gives
    the weights. Args: ``pixels`` (S, C, H, W) images in [0, 1]; ``maps`` (S, M, gh, gw) on the token grid;
    ``columns`` M titles; ``row_labels`` S labels (None: the image's index); ``size`` each panel's side in pixels.
    """
    rows, cols = maps.shape[0], maps.shape[1] + 1
    dpi, panel = 72, size / 72
    left, right, top, bottom, gap = 0.8, 1.05, 0.6, 0.1, 0.08
    width, height = left + cols * panel + (cols - 1) * gap + right, top + rows * panel + (rows - 1) * gap + bottom
    fig = plt.figure(figsize=(width, height), dpi=dpi)  # placed by hand: constrained layout is 10x slower
    for r in range(rows):
        grey = grey_rgb(pixels[r], size).permute(1, 2, 0).numpy()
        heat = maps[r].double().cpu()
        vmax = max(float(heat.max()), 1e-12)
        y0 = (bottom + (rows - 1 - r) * (panel + gap)) / height
        for c in range(cols):
            ax = fig.add_axes(((left + c * (panel + gap)) / width, y0, panel / width, panel / height))
            ax.imshow(grey, interpolation="bilinear")
            if c:
                im = ax.imshow(heat[c - 1].numpy(), cmap="inferno", vmin=0.0, vmax=vmax, alpha=0.6, interpolation="nearest",
                               extent=(-0.5, size - 0.5, size - 0.5, -0.5))
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title("image" if c == 0 else columns[c - 1], fontsize=9, pad=2)
            if c == 0:
                ax.set_ylabel(row_labels[r] if row_labels else f"#{r}", fontsize=8, labelpad=2)
        cax = fig.add_axes(((left + cols * (panel + gap)) / width, y0, 0.1 / width, panel / height), label="<colorbar>")
        bar = fig.colorbar(im, cax=cax)
        bar.ax.tick_params(labelsize=7)
        bar.set_label(colour_label, fontsize=8, labelpad=2)
    fig.suptitle(title, fontsize=9, y=1 - 0.06 / height, va="top")
    return fig


def grey_rgb(image: torch.Tensor, size: int) -> torch.Tensor:
    """(C, H, W) in [0, 1] -> (3, size, size): RGB kept, other channel counts averaged to grey."""
    image = image.float().cpu()
    rgb = image if image.shape[0] == 3 else image.mean(0, keepdim=True).expand(3, -1, -1)
    return F.interpolate(rgb[None], size=(size, size), mode="bilinear", align_corners=False)[0].clamp(0, 1)


# ---------------------------------------------------------------------------------------------- angle and distance


def token_statistics(ctx, stream, views) -> None:
    """One streamed pass over all images (memory: one batch): attention vs patch angle and vs token distance."""
    args = ctx.args
    size = tuple(models.input_size(ctx.model)[1:])  # (H, W) or (I, J, K)
    unit_size = stream.spacing or (1.0,) * len(size)  # mm per voxel (3-D) or one pixel (2-D)
    unit = "mm" if stream.volumetric else "px"
    parts: dict[str, list[tuple[AngleStats, int]]] = {view.name: [] for view in views}
    distances: dict[str, list[DistanceStats]] = {view.name: [] for view in views}
    edges = None
    for rec in record_batches(ctx.model, stream.batches(args.batch_size), ["qkv_input"], views, args.batch_size, ctx.device,
                              "attention: angles and distances", attention=True, total=stream.count):
        if edges is None:
            edges = distance_bins(size, unit_size, [rec.attention.grids[v.name] for v in views], args.distance_bin_mm if stream.volumetric else None)
        for view in views:
            probs, slots = rec.attention.patch_windows(view.name)  # (b*G, H, T, T), (G, T)
            h = rec.capture[view.name, "qkv_input"]  # (b, P, C) patch tokens
            padded = torch.cat([h, h.new_zeros(h.shape[0], 1, h.shape[2])], 1)  # pad slots -> zero vector
            groups = padded[:, slots.reshape(-1)].reshape(-1, slots.shape[1], h.shape[2])  # (b*G, T, C)
            parts[view.name].append((attention_vs_angle(probs, groups, args.bin_degrees), probs.shape[0]))
            grid = rec.attention.grids[view.name]
            token_size = [n * u / g for n, u, g in zip(size, unit_size, grid)]  # mm or px
            centres = token_centres(grid, token_size)  # (P, D)
            centres = torch.cat([centres, centres.new_zeros(1, centres.shape[1])])  # pad slot -> row P
            reach = None if view.window_size is None else [(w - 0.5) * t for w, t in zip(view.window_size, token_size)]  # Swin: not masked apart
            distances[view.name].append(attention_vs_distance(probs, centres[slots], edges, slots < centres.shape[0] - 1, reach=reach))
    count = stream.count
    distance_outputs(ctx, views, {name: merge_distance_stats(p) for name, p in distances.items()}, unit, count)
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


def distance_bins(size, unit_size, grids, width: float | None) -> torch.Tensor:
    """Bin edges 0, w, 2w, ... covering the input's diagonal; ``width`` None (2-D): one patch of the finest grid."""
    if width is None:
        width = min(n * u / g for grid in grids for n, u, g in zip(size, unit_size, grid))
    diagonal = math.sqrt(sum((n * u) ** 2 for n, u in zip(size, unit_size)))
    return torch.arange(math.ceil(diagonal / width) + 1, dtype=torch.float64) * width


def distance_outputs(ctx, views, stats: dict[str, DistanceStats], unit: str, count: int) -> None:
    """attention_distance.csv (per bin) and attention_distance_mean.csv (per head), a figure per block, a blocks x heads heatmap."""
    bins, means = [], []
    for view in views:
        s = stats[view.name]
        mean_attention, mean_distance = s.mean_attention, s.mean_distance  # (H, bins), (H,)
        for head in range(mean_attention.shape[0]):
            means.append({"layer": view.name, "block_index": view.global_index, "head": head, "unit": unit,
                          "mean_attention_distance": float(mean_distance[head]), "attention_mass": float(s.mass[head]), "n_images": count})
            for b in range(s.pair_counts.numel()):
                if s.pair_counts[b] > 0:
                    bins.append({"layer": view.name, "block_index": view.global_index, "head": head, "unit": unit, "bin_low": float(s.bin_edges[b]),
                                 "bin_high": float(s.bin_edges[b + 1]), "pairs": int(s.pair_counts[b]), "mean_attention": float(mean_attention[head, b])})
        ctx.writer.add_scalar(f"attention_distance/mean_distance_{unit} (head mean)", float(mean_distance.mean()), view.global_index)
        ctx.writer.add_figure(f"attention_distance/{view.name} (x: query-key distance in {unit}; lines: heads)", distance_figure(view, s, unit, count), view.global_index)
    write_csv(ctx.out / "attention_distance.csv", bins)
    write_csv(ctx.out / "attention_distance_mean.csv", means)
    heads = max(stats[v.name].mass.numel() for v in views)
    grid = torch.full((len(views), heads), float("nan"))
    for i, view in enumerate(views):
        grid[i, : stats[view.name].mass.numel()] = stats[view.name].mean_distance.float()
    fig = heatmap_figure(grid, title=f"mean attention distance, N = {count}", xlabel="head", ylabel="block",
                         xticklabels=[str(h) for h in range(heads)], yticklabels=[v.name for v in views], cmap="viridis",
                         colorbar_label=f"mean attention distance ({unit})")
    ctx.writer.add_figure(f"attention_distance/mean distance (blocks x heads, {unit})", fig, 0)
    print(f"probe.py attention: mean attention distance ({unit}), head mean per block ({count} images): "
          + ", ".join(f"{v.name} {float(stats[v.name].mean_distance.mean()):.1f}" for v in views))


def distance_figure(view, stats: DistanceStats, unit: str, count: int):
    """Mean attention weight per distance bin, one line per head (legend: the head's mean attention distance)."""
    fig, ax = plt.subplots(figsize=(5.8, 3.6), dpi=90)
    filled = stats.pair_counts > 0
    centres = (0.5 * (stats.bin_edges[1:] + stats.bin_edges[:-1]))[filled].numpy()
    for head in range(stats.mass.numel()):
        ax.plot(centres, stats.mean_attention[head, filled].numpy(), marker=".", label=f"head {head}: mean {float(stats.mean_distance[head]):.1f} {unit}")
    ax.set_xlabel(f"distance between query and key token centres ({unit})")
    ax.set_ylabel("mean attention weight")
    ax.set_title(f"{block_label(view)}: attention vs distance, N = {count}", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig
