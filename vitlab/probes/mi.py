"""probe.py mi: mutual information between neurons against spatial distance (Philip et al., Fig. 4)."""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from vitlab import models
from vitlab.analysis.mi import binned_mi, centre_token, gaussian_copula_mi, ksg_mi, mi_vs_distance, token_offsets, token_size_mm
from vitlab.probes.activations import SITE_CHOICES, add_recording_arguments, canonical_sites, block_label, record_batches, selected_blocks
from vitlab.probes.common import add_common_arguments, progress
from vitlab.outputs.files import write_csv

HELP = """Mutual information between neurons against spatial distance, per block and sub-layer (Philip et al., Fig. 4).

A neuron is one (channel, token) of a sub-layer output over N images. The centre token's neuron of each of K
centre channels is paired with the same channel at every token (mi_same) and with other channels (mi_cross);
MI in nats, averaged over the tokens at each distance and over the centre channels. Gaussian-copula estimate,
with equal-frequency bins + Miller-Madow beside it (flag_nonmonotone where binned exceeds it by > 0.05 nats) and KSG
(sklearn) on a few random pairs. Writes a figure per block, mi.csv and mi_ksg.csv.
3-D checkpoints (ViT-3D, UNETR, SwinUNETR): the centre token of the (I, J, K) grid, distances in millimetres between
token centres (token size = input voxels x voxel size / tokens along each axis; column distance_mm instead of distance).
Memory stays bounded: images are read one batch at a time and the kept neurons (N x tokens x (K + C') channels
per block and sub-layer, fp16; 1.5 GB for ViT-B/16 at N = 2000) wait in a temporary file inside --out.
On a CPU with native bf16 the forward runs under bf16 autocast (about 3x faster; --precision fp32 to turn it off).

example:
  python probe.py mi --checkpoint runs/medical_swin/version_0/checkpoints/last.ckpt --images /data/scans --num-images 2000
"""
DEFAULT_IMAGES = 2000
WARN_BELOW = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    group = add_recording_arguments(parser, batch_size=64)
    group.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                       help="forward precision: bf16 autocast (matrix products in bf16, about 3x faster on CPUs with native bf16) or fp32; "
                            "auto (default): bf16 on a CPU with avx512_bf16 / amx_bf16, else fp32. On ViT-B/16 bf16 moved the MI curves by at most "
                            "0.01 nats (N = 256 and 600) against fp32 on the same images, far inside their sampling error (benchmarks/bench_probe_memory.py)")
    group.add_argument("--sublayers", nargs="+", default=["attn", "mlp"], choices=SITE_CHOICES, metavar="SITE", help=f"sub-layer outputs whose neurons are paired (default: attn mlp; any of {', '.join(SITE_CHOICES)})")
    est = parser.add_argument_group("estimators")
    est.add_argument("--centre-channels", type=int, default=64, help="K centre channels (a random subset when the layer has more; default 64)")
    est.add_argument("--cross-channels", type=int, default=16, help="other channels paired with each centre neuron for mi_cross (default 16)")
    est.add_argument("--bins", type=int, default=None, help="equal-frequency bins per neuron for the binned estimate (default: sqrt(N / 8) in [2, 16], i.e. 16 at N = 2000)")
    est.add_argument("--binned-channels", type=int, default=16, help="centre channels of the binned check (0: no binned estimate; default 16)")
    est.add_argument("--binned-cross-channels", type=int, default=4, help="cross channels of the binned check (default 4)")
    est.add_argument("--disagreement", type=float, default=0.05, help="flag distances where the binned MI exceeds the copula MI on the same channels by more (nats; default 0.05)")
    est.add_argument("--ksg-pairs", type=int, default=32, help="random neuron pairs per block and sub-layer checked with KSG (0: none; default 32)")


def load_neurons(ctx):
    """The image stream for MI, with the count rules: an explicit --num-images must be met; warn below 500."""
    requested = ctx.args.num_images
    stream = ctx.image_stream(requested or DEFAULT_IMAGES, volumes=True)  # a 3-D model: volumes, voxel size in mm
    count = stream.count
    if requested is not None and count < requested:
        raise ValueError(f"--num-images {requested}: the image source has only {count} images; lower --num-images or add images")
    minimum = max(8, (ctx.args.bins or 2) if ctx.args.binned_channels else 0)
    if count < minimum:
        raise ValueError(f"probe.py mi: {count} images are too few for MI estimates (need at least {minimum}; Philip et al. used thousands)")
    if count < WARN_BELOW:
        warnings.warn(f"probe.py mi: only {count} images: MI estimates are noisy below {WARN_BELOW} (default {DEFAULT_IMAGES} when the data has them)", stacklevel=2)
    return stream, count


def default_bins(count: int) -> int:
    """Bins per neuron for N samples: sqrt(N / 8) in [2, 16] (16 at N = 2000; fewer keep the plug-in bias low)."""
    return int(min(16, max(2, round(math.sqrt(count / 8)))))


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (x86 avx512_bf16 / amx_bf16, Arm bf16), from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def forward_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the recording forward for ``--precision`` (None: plain fp32)."""
    if precision == "bf16" or (precision == "auto" and torch.device(device).type == "cpu" and native_bf16_cpu()):
        return torch.bfloat16
    return None


def run(ctx) -> None:
    args = ctx.args
    if args.centre_channels < 1 or (args.bins is not None and args.bins < 2):
        raise ValueError(f"--centre-channels must be >= 1 and --bins >= 2, got {args.centre_channels} and {args.bins}")
    for name in ("cross_channels", "binned_channels", "binned_cross_channels", "ksg_pairs"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    stream, count = load_neurons(ctx)
    args.bins = args.bins or default_bins(count)
    views = selected_blocks(ctx.model, args.blocks)
    sites = canonical_sites(args.sublayers)
    with tempfile.TemporaryDirectory(prefix=".mi-neurons-", dir=ctx.out) as spill, NeuronStore(Path(spill), count) as neurons:
        grids = record_neurons(ctx, stream, views, sites, args.centre_channels + args.cross_channels, neurons)
        sizes = token_sizes(ctx.model, grids, stream.spacing)
        estimate_all(ctx, neurons, grids, views, sites, count, sizes)


def token_sizes(model, grids: dict[str, tuple[int, ...]], spacing: tuple[float, ...] | None) -> dict[str, tuple[float, ...] | None]:
    """Per block, the token size in mm along i, j, k of a 3-D model's volumes (None for images: distances in tokens)."""
    if spacing is None:
        return {name: None for name in grids}
    volume = tuple(models.input_size(model))[1:]  # (I, J, K) voxels
    return {name: token_size_mm(volume, spacing, grid) for name, grid in grids.items()}


def estimate_all(ctx, neurons: "NeuronStore", grids: dict[str, tuple[int, ...]], views, sites: list[str], count: int,
                 sizes: dict[str, tuple[float, ...] | None] | None = None) -> None:
    """Estimate, write and draw block by block, reading one (block, site) table back at a time."""
    args = ctx.args
    sizes = sizes or {}

    rows: list[dict[str, object]] = []
    checks: list[dict[str, object]] = []
    by_stage: dict[tuple[str, int], list[tuple[str, object]]] = defaultdict(list)
    flagged = 0
    for view in progress(views, "mi: estimating", total=len(views)):
        results = {}
        for site in sites:
            acts, channels = neurons.pop((view.name, site))  # (N, T, U) fp16, (U,) original channel ids
            acts = acts.to(ctx.device)
            seed = args.seed * 1000 + view.global_index
            result = estimate(acts, grids[view.name], args, seed, sizes.get(view.name))
            results[site] = result
            block_rows = result_rows(view, site, result, count, args.disagreement)
            flagged += sum(int(r["flag_nonmonotone"]) for r in block_rows)
            rows += block_rows
            checks += ksg_check(acts, grids[view.name], channels, args.ksg_pairs, seed, args.bins, view.name, site, sizes.get(view.name))
            by_stage[(site, view.stage)].append((view.name, result))
            write_scalars(ctx.writer, view, site, result)
        ctx.writer.add_figure(f"mi/{view.name}", block_figure(view, results, count), view.global_index)
        write_csv(ctx.out / "mi.csv", rows)  # rewritten per block: an interrupted run keeps what is finished
        if checks:
            write_csv(ctx.out / "mi_ksg.csv", checks)
        ctx.writer.flush()
    for (site, stage), curves in by_stage.items():
        ctx.writer.add_figure(f"mi_layers/{site}/stage{stage}", layers_figure(site, stage, curves, count), 0)
    report(checks, flagged, args.disagreement, count)


class NeuronStore:
    """The kept neurons, ``{(block, site): (N, T, U) fp16}``, in a temporary file: memory holds one table at a time.

    Recording writes each batch's rows where they belong; :meth:`pop` reads one table back (the estimators
    need all N images of a neuron at once, so a table is whole; the file replaces N x blocks x sites in RAM).
    """

    def __init__(self, folder: Path, total: int):
        self.total = total
        self.file = open(folder / "neurons.f16", "w+b")
        self.tables: dict[tuple[str, str], tuple[int, tuple[int, int], torch.Tensor]] = {}  # key -> (offset, (T, U), channel ids)
        self.size = 0

    def add(self, key: tuple[str, str], tokens: int, channels: torch.Tensor) -> None:
        self.tables[key] = (self.size, (tokens, channels.numel()), channels)
        self.size += self.total * tokens * channels.numel() * 2

    def write(self, key: tuple[str, str], start: int, acts: torch.Tensor) -> None:
        offset, (tokens, width), _ = self.tables[key]
        if tuple(acts.shape[1:]) != (tokens, width):
            raise RuntimeError(f"mi: {key} recorded {tuple(acts.shape[1:])} tokens x channels, expected {(tokens, width)}")
        self.file.seek(offset + start * tokens * width * 2)
        self.file.write(acts.contiguous().numpy().tobytes())

    def pop(self, key: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
        offset, (tokens, width), channels = self.tables.pop(key)
        table = torch.empty(self.total, tokens, width, dtype=torch.float16)
        self.file.flush()
        self.file.seek(offset)
        if self.file.readinto(table.numpy()) != table.numel() * 2:
            raise RuntimeError(f"mi: the neuron table of {key} is incomplete")
        return table, channels

    def __enter__(self) -> "NeuronStore":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def record_neurons(ctx, stream, views, sites: list[str], channels_kept: int, neurons: NeuronStore) -> dict[str, tuple[int, ...]]:
    """Record the sub-layers over all images in batches, keeping a random subset of channels (fp16).

    The images are streamed (one batch in memory) and only the kept channels are copied out of the model.

    Fills ``neurons`` (``{(block, site): ((N, T, U) fp16, (U,) channel ids)}``) and returns ``{block: grid}``
    ((H, W); volumes: (I, J, K)).
    """
    generator = torch.Generator().manual_seed(ctx.args.seed)
    autocast = forward_dtype(ctx.args.precision, ctx.device)
    if autocast is not None:
        print(f"probe.py mi: forward in bf16 autocast ({'this CPU multiplies bf16 natively; ' if ctx.args.precision == 'auto' else ''}--precision fp32 for an fp32 forward)")
    keeps: dict[tuple[str, str], torch.Tensor] = {}
    first = next(stream.batches(1))  # one image, recorded in full: the widths, to draw the channels as before
    for rec in record_batches(ctx.model, first, sites, views, 1, ctx.device, "mi: widths", dtype=torch.float16, autocast=autocast):
        for view in views:
            for site in sites:
                acts = rec.capture[view.name, site]  # (1, T, C)
                width = acts.shape[-1]
                keep = torch.randperm(width, generator=generator)[:channels_kept].sort().values if width > channels_kept else torch.arange(width)
                keeps[(view.name, site)] = keep
                neurons.add((view.name, site), acts.shape[1], keep)
    note_large_tables(neurons)
    grids: dict[str, tuple[int, ...]] = {}
    batches = stream.batches(ctx.args.batch_size)
    for rec in record_batches(ctx.model, batches, sites, views, ctx.args.batch_size, ctx.device, "mi: recording", dtype=torch.float16, channels=keeps, total=stream.count, autocast=autocast):
        for view in views:
            grids[view.name] = tuple(rec.capture.grids[view.name])
            for site in sites:
                neurons.write((view.name, site), rec.start, rec.capture[view.name, site])  # (b, T, U) fp16
    return grids


LARGE_TABLE_BYTES = 2 << 30


def note_large_tables(neurons: "NeuronStore") -> None:
    """One line when a (block, site) table is large (a 3-D model's early stages: SwinUNETR's first grid at a 96^3 input
    has 48^3 tokens): the estimate holds that table and about twice it as normal scores in memory at once."""
    key, (_, (tokens, width), _) = max(neurons.tables.items(), key=lambda item: item[1][1][0] * item[1][1][1])
    size = neurons.total * tokens * width * 2
    if size > LARGE_TABLE_BYTES:
        print(f"probe.py mi: {key[0]} {key[1]} keeps {neurons.total} images x {tokens} tokens x {width} channels = {size / 2**30:.1f} GiB (fp16, "
              f"in a file); its estimate needs about 3x that in memory: --blocks (later stages have fewer tokens), fewer --num-images "
              "or --centre-channels / --cross-channels lower it")


def estimate(acts: torch.Tensor, grid: tuple[int, ...], args: argparse.Namespace, seed: int,
             token_size: tuple[float, ...] | None = None) -> dict[str, object]:
    """Copula curves on K centre channels; binned curves and the copula on the same (smaller) channel set
    (``token_size``: mm per token along each axis of a volume's grid, distances in mm)."""
    copula = mi_vs_distance(acts, grid, args.centre_channels, "copula", torch.Generator().manual_seed(seed), args.cross_channels, token_size=token_size)
    result: dict[str, object] = {"copula": copula, "binned": None, "matched": None}
    if args.binned_channels > 0:
        pick = dict(centre_channels=args.binned_channels, cross_channels=args.binned_cross_channels, token_size=token_size)
        result["binned"] = mi_vs_distance(acts, grid, estimator="binned", generator=torch.Generator().manual_seed(seed + 1), bins=args.bins, **pick)
        result["matched"] = mi_vs_distance(acts, grid, estimator="copula", generator=torch.Generator().manual_seed(seed + 1), **pick)
    return result


def result_rows(view, site: str, result: dict[str, object], count: int, threshold: float) -> list[dict[str, object]]:
    """mi.csv rows of one block and sub-layer, one per distance (``distance`` in tokens; volumes: ``distance_mm``)."""
    copula, binned, matched = result["copula"], result["binned"], result["matched"]
    column = distance_column(copula.token_size)
    rows = []
    for i, distance in enumerate(copula.distances.tolist()):
        row = {"layer": view.name, "block_index": view.global_index, "sublayer": site, column: distance, "tokens": int(copula.counts[i]),
               "mi_same": float(copula.mi_same[i]), "mi_cross": float(copula.mi_cross[i]), "mi_same_binned": math.nan, "mi_cross_binned": math.nan,
               "binned_minus_copula": math.nan, "flag_nonmonotone": 0, "n_images": count}
        if binned is not None:
            # binned above copula = dependence the Gaussian copula cannot see (non-monotone, or another
            # non-Gaussian copula); binned below copula is the coarse-bin bias of strong dependence: not flagged
            diffs = [float(binned.mi_same[i] - matched.mi_same[i]), float(binned.mi_cross[i] - matched.mi_cross[i])]
            largest = max((d for d in diffs if not math.isnan(d)), default=math.nan)
            row.update(mi_same_binned=float(binned.mi_same[i]), mi_cross_binned=float(binned.mi_cross[i]), binned_minus_copula=largest,
                       flag_nonmonotone=int(largest > threshold))
        rows.append(row)
    return rows


def distance_column(token_size: tuple[float, ...] | None) -> str:
    """The CSV column of the distance: ``distance`` (tokens, images) or ``distance_mm`` (volumes)."""
    return "distance" if token_size is None else "distance_mm"


def ksg_check(acts: torch.Tensor, grid: tuple[int, ...], channels: torch.Tensor, pairs: int, seed: int, bins: int, block: str, site: str,
              token_size: tuple[float, ...] | None = None) -> list[dict[str, object]]:
    """Copula, binned and KSG MI of ``pairs`` random (centre neuron, other neuron) pairs (half same-channel)."""
    if pairs <= 0:
        return []
    n, tokens, width = acts.shape
    g = torch.Generator().manual_seed(seed + 2)
    t0 = centre_token(grid)
    offsets = token_offsets(grid).double() * torch.tensor(token_size or [1.0] * len(grid), dtype=torch.float64)  # (T, A) tokens or mm
    others = torch.tensor([t for t in range(tokens) if t != t0])
    out = []
    for p in range(pairs):
        c0 = int(torch.randint(width, (1,), generator=g))
        c1 = c0 if p % 2 == 0 or width == 1 else int(torch.randint(width, (1,), generator=g))
        t = int(others[torch.randint(others.numel(), (1,), generator=g)]) if others.numel() else t0
        x, y = acts[:, t0, c0].float().cpu(), acts[:, t, c1].float().cpu()  # (N,), (N,)
        distance = math.hypot(*offsets[t].tolist())
        out.append({"layer": block, "sublayer": site, "centre_channel": int(channels[c0]), "channel": int(channels[c1]), "token": t, distance_column(token_size): distance,
                    "mi_copula": float(gaussian_copula_mi(x, y)), "mi_binned": float(binned_mi(x, y, min(bins, n))), "mi_ksg": float(ksg_mi(x, y)), "n_images": n})
    return out


def write_scalars(writer, view, site: str, result: dict[str, object]) -> None:
    """Depth curves: MI with the nearest neighbours and the mean over all distances (step = block index)."""
    curves = result["copula"]
    nearest = 1 if curves.distances.numel() > 1 else 0
    writer.add_scalar(f"mi_nearest_same/{site}", float(curves.mi_same[nearest]), view.global_index)
    writer.add_scalar(f"mi_nearest_cross/{site}", float(curves.mi_cross[nearest]), view.global_index)
    weights = curves.counts.double()[1:]
    if weights.numel():
        writer.add_scalar(f"mi_mean_same/{site}", float((curves.mi_same[1:] * weights).sum() / weights.sum()), view.global_index)


def block_figure(view, results: dict[str, dict[str, object]], count: int):
    """MI against distance for each sub-layer of one block: same / cross channel, copula and binned."""
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), dpi=90, squeeze=False)
    styles = (("copula", "-", 3, "copula"), ("binned", ":", 2, "binned (Miller-Madow)"), ("matched", "--", 0, "copula, the binned's channels"))
    for ax, (site, result) in zip(axes[0], results.items()):
        for key, style, marker_size, label in styles:
            curves = result[key]
            if curves is None:
                continue
            d = curves.distances.cpu().numpy()
            ax.plot(d, curves.mi_same.cpu().numpy(), style, color="C0", marker="o", ms=marker_size, lw=1.4 if key == "copula" else 0.9, label=f"same channel, {label}")
            ax.plot(d, curves.mi_cross.cpu().numpy(), style, color="C1", marker="s", ms=marker_size, lw=1.4 if key == "copula" else 0.9, label=f"cross channel, {label}")
        ax.set_title(f"{site}", fontsize=9)
        ax.set_xlabel(distance_label(result["copula"].token_size))
        ax.set_ylabel("MI (nats)")
        ax.legend(fontsize=6)
    size = next(iter(results.values()))["copula"].token_size if results else None
    fig.suptitle(f"{block_label(view)}: MI with the centre neuron, N = {count} {'volumes' if size else 'images'}{token_note(size)}", fontsize=10)
    fig.tight_layout()
    return fig


def distance_label(token_size: tuple[float, ...] | None) -> str:
    """x-axis label: tokens for images, mm for volumes."""
    return "distance from the centre token (tokens)" if token_size is None else "distance from the centre token (mm)"


def token_note(token_size: tuple[float, ...] | None) -> str:
    """``, token 11.2 x 11.2 x 10 mm`` for a title (nothing for images)."""
    return "" if token_size is None else f", token {' x '.join(f'{v:.3g}' for v in token_size)} mm"


def layers_figure(site: str, stage: int, curves: list[tuple[str, dict[str, object]]], count: int):
    """Philip et al.'s Fig. 4: the same-channel MI curve of every block of a stage, coloured by depth."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(curves), 1)))
    for color, (name, result) in zip(colors, curves):
        c = result["copula"]
        ax.plot(c.distances.cpu().numpy(), c.mi_same.cpu().numpy(), marker="o", ms=3, color=color, label=name.split(".", 1)[1])
    ax.set_xlabel(distance_label(curves[0][1]["copula"].token_size) if curves else "distance from the centre token")
    ax.set_ylabel("MI (nats), same channel")
    size = curves[0][1]["copula"].token_size if curves else None
    ax.set_title(f"{site}, stage {stage}: MI vs distance per block (N = {count}{token_note(size)})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def report(checks: list[dict[str, object]], flagged: int, threshold: float, count: int) -> None:
    """One summary line per check on stdout."""
    if checks:
        diff = np.array([abs(r["mi_copula"] - r["mi_ksg"]) for r in checks])
        print(f"probe.py mi: {count} images; copula vs KSG on {len(checks)} random pairs: mean |diff| {diff.mean():.4f} nats, max {diff.max():.4f}")
    if flagged:
        print(f"probe.py mi: binned MI exceeds the copula MI by > {threshold} nats at {flagged} (block, sub-layer, distance) rows: "
              "dependence the Gaussian copula misses (non-monotone); see flag_nonmonotone in mi.csv")
