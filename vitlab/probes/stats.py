"""probe.py stats: excess kurtosis of every neuron and activation histograms, per block and sub-layer (Philip et al.)."""

from __future__ import annotations

import argparse
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from vitlab.analysis.moments import Moments, central_moments, merge_moments
from vitlab.probes.activations import SITE_CHOICES, add_recording_arguments, canonical_sites, record_batches, selected_blocks
from vitlab.probes.common import add_common_arguments
from vitlab.outputs.files import write_csv

HELP = """Excess kurtosis of every neuron and activation histograms, per block and sub-layer (Philip et al.).

A neuron is one (channel, token) of a sub-layer output over N images; its excess kurtosis m4/m2^2 - 3 (scipy's
convention: 0 for a Gaussian, > 0 for heavy tails) is accumulated batch by batch, so N is not limited by memory.
Writes per block and sub-layer a histogram of the neurons' kurtosis and of sampled activations, depth curves of
the median / 95th-percentile kurtosis, a distribution figure per sub-layer, and stats.csv.
3-D checkpoints (ViT-3D, UNETR, SwinUNETR): the same over volumes (neurons are (channel, token) of the 3-D token
grid; nothing here is spatial, so no distances). Tokens over a volume's padding can be constant: counted in
constant_neurons, left out of the kurtosis summaries.

example:
  python probe.py stats --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt --sublayers attn mlp mlp_hidden
"""
DEFAULT_IMAGES = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    group = add_recording_arguments(parser)
    group.add_argument("--sublayers", nargs="+", default=["attn", "mlp"], choices=SITE_CHOICES, metavar="SITE", help=f"sub-layer outputs to describe (default: attn mlp; any of {', '.join(SITE_CHOICES)})")
    group.add_argument("--histogram-values", type=int, default=100_000, help="activations sampled per block and sub-layer for the histograms (default 100000)")


def run(ctx) -> None:
    args = ctx.args
    stream = ctx.image_stream(DEFAULT_IMAGES, volumes=True)  # a batch at a time (moments merged per batch); 3-D: volumes
    count = stream.count
    if count < 4:
        raise ValueError(f"probe.py stats: {count} images are too few for kurtosis (need at least 4; use --num-images or more images)")
    if args.histogram_values < 1:
        raise ValueError(f"--histogram-values must be >= 1, got {args.histogram_values}")
    views = selected_blocks(ctx.model, args.blocks)
    sites = canonical_sites(args.sublayers)
    moments, samples = accumulate(ctx, stream.batches(args.batch_size), views, sites, count)

    rows = []
    for view in views:
        for site in sites:
            m = moments[(view.name, site)]
            row = summary_row(view, site, m, count)
            rows.append(row)
            kurt = m.excess_kurtosis.flatten()
            kurt = kurt[torch.isfinite(kurt)]
            if kurt.numel():
                ctx.writer.add_histogram(f"kurtosis/{site}/{view.name}", kurt.float(), view.global_index)
            ctx.writer.add_histogram(f"activations/{site}/{view.name}", samples[(view.name, site)], view.global_index)
            for key in ("kurtosis_median", "kurtosis_p95", "kurtosis_mean"):
                ctx.writer.add_scalar(f"{key}/{site}", row[key], view.global_index)
    write_csv(ctx.out / "stats.csv", rows)
    for site in sites:
        ctx.writer.add_figure(f"kurtosis_vs_depth/{site}", depth_figure(site, [r for r in rows if r["sublayer"] == site], count), 0)
        ctx.writer.add_figure(f"activation_distributions/{site}", distribution_figure(site, views, samples), 0)
    print_summary(rows, count)


def accumulate(ctx, inputs, views, sites: list[str], total: int) -> tuple[dict[tuple[str, str], Moments], dict[tuple[str, str], torch.Tensor]]:
    """Per (block, site): moments of every neuron over all ``total`` images (a tensor or a stream of batches),
    and a random sample of activation values."""
    generator = torch.Generator().manual_seed(ctx.args.seed)
    moments: dict[tuple[str, str], Moments] = {}
    samples: dict[tuple[str, str], list[torch.Tensor]] = {}
    for rec in record_batches(ctx.model, inputs, sites, views, ctx.args.batch_size, ctx.device, "stats: recording", total=total):
        for view in views:
            for site in sites:
                acts = rec.capture[view.name, site]  # (b, T, C)
                key = (view.name, site)
                moments[key] = merge_moments(moments.get(key), central_moments(acts, dim=0))  # (T, C) per neuron
                quota = math.ceil(ctx.args.histogram_values * acts.shape[0] / total)
                flat = acts.reshape(-1)
                pick = torch.randint(flat.numel(), (min(quota, flat.numel()),), generator=generator)
                samples.setdefault(key, []).append(flat[pick].float())
    return moments, {k: torch.cat(v)[: ctx.args.histogram_values] for k, v in samples.items()}


def summary_row(view, site: str, m: Moments, count: int) -> dict[str, object]:
    """stats.csv row: kurtosis summary over the neurons, activation mean and spread over all of them."""
    kurt = m.excess_kurtosis.flatten()
    finite = kurt[torch.isfinite(kurt)]
    nan = math.nan
    q = torch.quantile(finite, torch.tensor([0.5, 0.95], dtype=finite.dtype)).tolist() if finite.numel() else [nan, nan]
    mean = m.mean.mean()
    pooled_var = (m.variance + m.mean.square()).mean() - mean.square()  # variance over all neurons' values
    return {"layer": view.name, "block_index": view.global_index, "sublayer": site, "neurons": kurt.numel(),
            "constant_neurons": int((~torch.isfinite(kurt)).sum()), "kurtosis_mean": float(finite.mean()) if finite.numel() else nan,
            "kurtosis_median": q[0], "kurtosis_p95": q[1], "kurtosis_max": float(finite.max()) if finite.numel() else nan,
            "share_kurtosis_above_1": float((finite > 1).double().mean()) if finite.numel() else nan,
            "activation_mean": float(mean), "activation_std": float(pooled_var.clamp_min(0).sqrt()),
            "neuron_std_median": float(m.variance.sqrt().flatten().median()), "n_images": count}


def depth_figure(site: str, rows: list[dict[str, object]], count: int):
    """Median and 95th-percentile kurtosis of the neurons against block depth."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=90)
    depth = [r["block_index"] for r in rows]
    ax.plot(depth, [r["kurtosis_median"] for r in rows], marker="o", label="median")
    ax.plot(depth, [r["kurtosis_p95"] for r in rows], marker="s", label="95th percentile")
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xlabel("block (global index)")
    ax.set_ylabel("excess kurtosis of the neurons")
    ax.set_title(f"{site}: kurtosis per neuron over N = {count} images", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def distribution_figure(site: str, views, samples: dict[tuple[str, str], torch.Tensor]):
    """Standardised activation densities per block (log scale) beside the standard normal."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(views), 1)))
    edges = np.linspace(-8, 8, 81)
    for color, view in zip(colors, views):
        values = samples[(view.name, site)].double()
        z = ((values - values.mean()) / values.std().clamp_min(1e-12)).numpy()
        density, _ = np.histogram(z, bins=edges, density=True)
        ax.semilogy(0.5 * (edges[1:] + edges[:-1]), np.where(density > 0, density, np.nan), color=color, label=view.name)
    grid = np.linspace(-8, 8, 400)
    ax.semilogy(grid, np.exp(-grid**2 / 2) / math.sqrt(2 * math.pi), "k--", lw=0.8, label="N(0, 1)")
    ax.set_ylim(1e-6, 1)
    ax.set_xlabel("activation, standardised per block")
    ax.set_ylabel("density")
    ax.set_title(f"{site}: activation distribution per block", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def print_summary(rows: list[dict[str, object]], count: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"excess kurtosis of the neurons ({count} images; 0 = Gaussian)")
    cols = {"layer": "layer", "sublayer": "sublayer", "neurons": "neurons", "kurtosis_median": "median", "kurtosis_p95": "95th pct",
            "kurtosis_max": "max", "share_kurtosis_above_1": "share > 1"}
    for key, title in cols.items():
        table.add_column(title, justify="left" if key in ("layer", "sublayer") else "right")
    for row in rows:
        table.add_row(*(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols))
    Console(width=max(100, Console().width)).print(table)
