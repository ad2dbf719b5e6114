"""probe.py filters: patch-embedding filters, their PCA and the position-embedding similarity (Attentionless article)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitlab import models
from vitlab.probes.common import ProbeContext, add_common_arguments, add_model_arguments
from vitlab.probes.streams import planar_input
from vitlab.probes.invert import enlarge
from vitlab.outputs.figures import chw_to_image, image_table_figure
from vitlab.outputs.images import image_grid
from vitlab.outputs.files import write_csv, write_json

HELP = """Patch-embedding filters (min-max grid, top PCA components) and position-embedding similarity (Attentionless article).

Each filter is scaled by its own min and max; the PCA runs over the (filters, C*P*P) matrix; the position grid shows,
at each patch, the cosine similarity of its position embedding to all others. --compare puts a second model beside
it: the one given with --second-checkpoint / --second-config / --second-model, else the untrained model of the same
architecture. Writes TensorBoard figures, pca.csv and filters.json.

example:
  python probe.py filters --model vit_base_patch32_224 --pretrained --compare
  python probe.py filters --checkpoint runs/ft/version_0/checkpoints/last.ckpt \\
                          --compare --second-model vit_base_patch32_224 --second-pretrained
"""
MIN_TILE_PIXELS = 16  # small patches are enlarged (nearest) to at least this many pixels per filter
PCA_PER_ROW = 8  # components in a row of the PCA figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, images=False)
    group = parser.add_argument_group("filters")
    group.add_argument("--components", type=int, default=16, help="PCA components shown (default 16)")
    group.add_argument("--max-filters", type=int, default=256, help="filters shown in the grid (default 256; all in the tables)")
    group.add_argument("--compare", action="store_true",
                       help="show a second model beside it: --second-* options, else the untrained same architecture")
    add_model_arguments(parser.add_argument_group("second model (with --compare)"), prefix="second-")


def minmax(x: torch.Tensor) -> torch.Tensor:
    """Scales each item of a batch (N, ...) to [0, 1] by its own min and max (constant items -> 0.5)."""
    flat = x.flatten(1)
    low, high = flat.min(1).values, flat.max(1).values
    scaled = (flat - low[:, None]) / (high - low).clamp_min(1e-12)[:, None]
    scaled[high - low <= 1e-12] = 0.5
    return scaled.view_as(x)


def filter_pca(weight: torch.Tensor, components: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the filters as images.

    Args:
        weight: Filters (D, C, P, P).
        components: How many to return.

    Returns:
        (components (k, C, P, P) unit-norm, explained variance ratio of all components (min(D, C*P*P),)).
    """
    flat = weight.detach().double().flatten(1)  # (D, C*P*P)
    centred = flat - flat.mean(0, keepdim=True)
    _, singular, right = torch.linalg.svd(centred, full_matrices=False)  # right: (r, C*P*P)
    variance = singular.square()
    ratio = variance / variance.sum().clamp_min(1e-300)
    k = min(components, right.shape[0])
    return right[:k].float().view(k, *weight.shape[1:]), ratio.float()


def position_similarity(pos_embed: torch.Tensor) -> torch.Tensor:
    """Cosine similarity between the position embeddings of all patch tokens: (N, D) -> (N, N)."""
    unit = F.normalize(pos_embed.detach().double(), dim=1)
    return (unit @ unit.T).float()


def similarity_mosaic(similarity: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Arranges row i of an (N, N) similarity as an (H, W) map at grid cell i, one NaN gap between cells.

    Returns:
        (H*(H+1)-1, W*(W+1)-1) float with NaN separators (the ViT paper's position-embedding figure).
    """
    height, width = grid
    maps = similarity.view(height, width, height, width)  # (row_i, col_i, row_j, col_j)
    mosaic = torch.full((height * (height + 1) - 1, width * (width + 1) - 1), float("nan"))
    for r in range(height):
        for c in range(width):
            mosaic[r * (height + 1):r * (height + 1) + height, c * (width + 1):c * (width + 1) + width] = maps[r, c]
    return mosaic


def _filter_images(weight: torch.Tensor) -> torch.Tensor:
    """(D, C, P, P) -> displayable (D, 1|3, P', P') in [0, 1]: min-max per filter, enlarged; other C -> channel mean."""
    if weight.shape[1] not in (1, 3):
        weight = weight.mean(1, keepdim=True)
    return enlarge(minmax(weight.float()), MIN_TILE_PIXELS)


def report(ctx: ProbeContext, label: str, model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """Writes the filter grid, PCA and position-embedding similarity of one model; returns its figures' parts +
    summary."""
    emb = models.embeddings(model)
    weight = emb.patch_weight.detach().cpu()  # (D, C, P, P)
    writer = ctx.writer
    components, ratio = filter_pca(weight, args.components)
    shown = min(args.max_filters, weight.shape[0])
    parts: dict[str, Any] = {
        "patch_filters": (grid_image(image_grid(_filter_images(weight[:shown]))),
                          f"{label}: {shown} of {weight.shape[0]} filters ({weight.shape[1]}x{emb.patch_size[0]}x{emb.patch_size[1]})"),
        "pca": ([chw_to_image(tile) for tile in _filter_images(components)], ratio[: len(components)].tolist()),
    }
    summary: dict[str, Any] = {
        "label": label, "filters": weight.shape[0], "in_chans": weight.shape[1], "patch_size": list(emb.patch_size),
        "pca_explained_top": [round(float(v), 6) for v in ratio[: args.components]],
        "pca_components_for_90pct": int((ratio.cumsum(0) < 0.9).sum()) + 1,
    }
    if emb.pos_embed is not None:
        similarity = position_similarity(emb.pos_embed.cpu())  # (N, N)
        parts["pos_similarity"] = (similarity_mosaic(similarity, emb.grid).numpy(), tuple(emb.grid))
        summary["pos_neighbour_cosine"] = _neighbour_cosine(similarity, emb.grid)
        summary["pos_mean_cosine"] = float(similarity[~torch.eye(len(similarity), dtype=torch.bool)].mean())
    else:
        summary["pos_embed"] = "none (this family has no absolute position embedding)"
    for name, part in parts.items():
        writer.add_figure(f"{label}/{name}", FIGURES[name]({label: part}), 0)
    writer.add_histogram(f"{label}/filter_norms", weight.flatten(1).norm(dim=1), 0)
    rows = [{"model": label, "component": i, "explained_variance_ratio": float(v), "cumulative": float(c)}
            for i, (v, c) in enumerate(zip(ratio, ratio.cumsum(0)))]
    return {"parts": parts, "summary": summary, "rows": rows, "weight": weight}


def grid_image(grid: np.ndarray) -> np.ndarray:
    """A (3, H, W) uint8 grid -> (H, W, 3) floats in [0, 1]."""
    return grid.transpose(1, 2, 0).astype(float) / 255.0


def filters_figure(parts: dict[str, tuple[np.ndarray, str]]):
    """Each model's filter grid side by side, titled with the model's label and the filters' shape."""
    side = max(max(image.shape[:2]) for image, _ in parts.values())
    return image_table_figure([[image for image, _ in parts.values()]], columns=[name for _, name in parts.values()],
                              title="patch-embedding filters, each scaled from its own minimum (black) to its maximum (white)",
                              panel_px=max(side, 200))


def pca_figure(parts: dict[str, tuple[list[np.ndarray], list[float]]]):
    """A row of principal components per model, each titled with its share of the filters' variance."""
    cells, titles, labels = [], [], []
    for name, (tiles, shares) in parts.items():
        for start in range(0, len(tiles), PCA_PER_ROW):
            cells.append(tiles[start:start + PCA_PER_ROW])
            titles.append([f"PC{k + 1}\n{shares[k]:.1%}" for k in range(start, min(start + PCA_PER_ROW, len(tiles)))])
            labels.append(name if start == 0 else "")
    return image_table_figure(cells, titles=titles, row_labels=labels, panel_px=64,
                              title="principal components of the patch-embedding filters (over the filters' C*P*P "
                                    "values, centred), each scaled from its minimum (black) to its maximum (white); "
                                    "over each, its share of the variance")


def similarity_figure(parts: dict[str, tuple[np.ndarray, tuple[int, int]]]):
    """Each model's position-embedding similarity mosaic (the ViT paper's figure) with one colour bar, -1 to 1."""
    import matplotlib

    from vitlab.outputs.figures import new_figure

    count = len(parts)
    fig = new_figure((4.2 * count + 1.0, 4.6), dpi=90)
    axes = fig.subplots(1, count, squeeze=False)[0]
    colormap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    for ax, (name, (mosaic, grid)) in zip(axes, parts.items()):
        im = ax.imshow(np.ma.masked_invalid(mosaic), cmap=colormap, vmin=-1.0, vmax=1.0, interpolation="nearest")
        height, width = grid
        ax.set_xticks([c * (width + 1) + (width - 1) / 2 for c in range(width)], labels=[str(c) for c in range(width)], fontsize=6)
        ax.set_yticks([r * (height + 1) + (height - 1) / 2 for r in range(height)], labels=[str(r) for r in range(height)], fontsize=6)
        ax.set_xlabel("patch column")
        ax.set_ylabel("patch row")
        ax.set_title(f"{name} ({height} x {width} patches)", fontsize=9)
    bar = fig.colorbar(im, ax=list(axes), fraction=0.04 if count > 1 else 0.05)
    bar.set_label("cosine similarity of the position embeddings")
    fig.suptitle("position-embedding similarity: the tile at patch (row, column) shows that patch's cosine to every "
                 "patch", fontsize=9)
    return fig


FIGURES = {"patch_filters": filters_figure, "pca": pca_figure, "pos_similarity": similarity_figure}


def _neighbour_cosine(similarity: torch.Tensor, grid: tuple[int, int]) -> float:
    """Mean cosine between position embeddings of 4-neighbour patches (learned 2-D structure -> high)."""
    height, width = grid
    index = torch.arange(height * width).view(height, width)
    pairs = torch.cat([torch.stack([index[:, :-1].flatten(), index[:, 1:].flatten()]),
                       torch.stack([index[:-1].flatten(), index[1:].flatten()])], dim=1)  # (2, pairs)
    return float(similarity[pairs[0], pairs[1]].mean()) if pairs.shape[1] else float("nan")


def _second_model(ctx: ProbeContext, given: bool) -> tuple[str, torch.nn.Module]:
    """The --second-* model when given, else the untrained model of the same architecture."""
    if given:
        return "second", ctx.load_second_model("second-").model
    return "untrained", ctx.loaded.fresh(seed=ctx.args.seed).to(ctx.device)


def run(ctx: ProbeContext) -> None:
    args = ctx.args
    if args.components < 1 or args.max_filters < 1:
        raise ValueError(f"--components and --max-filters must be >= 1, got {args.components} and {args.max_filters}")
    planar_input(ctx.model, ctx.loaded.source)  # the filters are drawn as 2-D patches
    second_given = any(getattr(args, f"second_{key}") is not None for key in ("checkpoint", "config", "model"))
    first = report(ctx, "model", ctx.model, args)
    results = [first]
    if args.compare or second_given:
        label, model = _second_model(ctx, second_given)
        second = report(ctx, label, model, args)
        results.append(second)
        for name in first["parts"]:
            if name in second["parts"]:
                ctx.writer.add_figure(f"compare/{name}", FIGURES[name]({first["summary"]["label"]: first["parts"][name],
                                                                        label: second["parts"][name]}), 0)
        if first["weight"].shape == second["weight"].shape:
            cosine = F.cosine_similarity(first["weight"].flatten(1).double(), second["weight"].flatten(1).double(), dim=1)
            ctx.writer.add_histogram("compare/filter_cosine", cosine, 0)
            second["summary"]["filter_cosine_to_model_mean"] = float(cosine.mean())
    write_csv(ctx.out / "pca.csv", [row for result in results for row in result["rows"]])
    write_json(ctx.out / "filters.json", {result["summary"]["label"]: result["summary"] for result in results})
    for result in results:
        s = result["summary"]
        extra = f", position-embedding neighbour cosine {s['pos_neighbour_cosine']:.3f}" if "pos_neighbour_cosine" in s else ""
        print(f"{s['label']}: {s['filters']} filters {s['in_chans']}x{s['patch_size'][0]}x{s['patch_size'][1]}, "
              f"{s['pca_components_for_90pct']} PCA components for 90% variance{extra}")
