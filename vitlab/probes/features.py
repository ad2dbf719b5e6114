"""probe.py features: k-NN / linear accuracy of each block's frozen features, and CKA between two models (Veta lecture)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch

from vitlab import models
from vitlab.analysis.probing import knn_probe, linear_probe
from vitlab.analysis.stats import linear_cka
from vitlab.probes.activations import add_recording_arguments, record_batches, selected_blocks
from vitlab.probes.common import add_common_arguments, add_model_arguments
from vitlab.probes.loading import LoadedModel
from vitlab.outputs.files import write_csv

HELP = """Layer-wise frozen-feature evaluation (the Veta lecture's k-NN / linear table, per depth) and CKA between two models.

Each block's output is pooled (class token, or the token mean without one) on the data's train split and the
evaluation split (--split, default val); a k-NN (cosine, k = 20) and a logistic-regression classifier fitted on
the train features are scored on the evaluation features. With a second model (--second-checkpoint / --second-model
... or --second-untrained) the same is done for it (before vs after fine-tuning) and the linear CKA between the
two models' representations of the same images is computed per block (pooled features, and all tokens of the
first --cka-images images): activation-level drift beside the weight drift. features.csv, cka.csv, depth curves.
3-D checkpoints (ViT-3D, UNETR, SwinUNETR): the run's labelled volumes (its data's class folders / manifest label,
also for a segmentation checkpoint, whose own outputs are voxel logits), read as training reads them; tokens
mean-pooled per block (ViT-3D: its class token under --pool auto).

examples:
  python probe.py features --config runs/quickstart/version_0/config.yaml --second-untrained
  python probe.py features --config runs/medical_swin/version_0/config.yaml \\
                           --second-model swin_tiny_patch4_window7_224 --second-pretrained   # before vs after fine-tuning
"""
DEFAULT_IMAGES = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    second = parser.add_argument_group("second model, to compare with (same architecture; e.g. the weights before fine-tuning)")
    add_model_arguments(second, prefix="second-")
    second.add_argument("--second-untrained", action="store_true", help="compare with an untrained model of the same architecture")
    group = add_recording_arguments(parser)
    group.add_argument("--pool", default="auto", choices=["auto", "cls", "mean"], help="block features: the class token (cls), the patch-token mean (mean), or cls where there is one (auto)")
    group.add_argument("--knn-k", type=int, default=20, help="neighbours of the k-NN classifier (default 20, as DINO)")
    group.add_argument("--linear-c", type=float, default=1.0, help="inverse L2 strength of the logistic regression on standardised features (default 1)")
    group.add_argument("--cka-images", type=int, default=64, help="evaluation images whose tokens enter the token-level CKA (0: pooled CKA only; default 64)")


@dataclass
class Features:
    """Block outputs of one model on one split."""

    pooled: dict[str, torch.Tensor]  # block -> (N, C) float32
    tokens: dict[str, torch.Tensor]  # block -> (n, T, C) float16, the first n images


def run(ctx) -> None:
    args = ctx.args
    if args.images:
        raise ValueError("probe.py features needs labelled train and evaluation splits: omit --images (embedded dataset) or pass --config RUN/config.yaml (its data section)")
    if args.split == "train":
        raise ValueError("--split train: the classifiers are fitted on the train split; evaluate on --split val or test")
    if args.knn_k < 1 or args.linear_c <= 0 or args.cka_images < 0:
        raise ValueError(f"need --knn-k >= 1, --linear-c > 0 and --cka-images >= 0, got {args.knn_k}, {args.linear_c}, {args.cka_images}")
    compared = [("model", ctx.loaded)]
    second = second_model(ctx)
    if second is not None:
        check_same_architecture(ctx.loaded, second)
        compared.append(("second", second))
    views = selected_blocks(ctx.model, args.blocks)
    # read a batch at a time; a 3-D model: its data's volumes, labelled by class folder / manifest label (any task)
    train, test = ctx.image_stream(DEFAULT_IMAGES, split="train", volumes=True), ctx.image_stream(DEFAULT_IMAGES, volumes=True)
    if not train.labelled or not test.labelled:
        raise ValueError("probe.py features: the images carry no labels; use the embedded dataset or --config with a labelled data section")

    rows: list[dict[str, object]] = []
    feats: dict[str, Features] = {}
    for label, loaded in compared:
        train_f, train_labels = extract(ctx, loaded.model, train, views, f"features: {label} train", 0)
        test_f, test_labels = extract(ctx, loaded.model, test, views, f"features: {label} {args.split}", args.cka_images if second else 0)
        feats[label] = test_f
        for view in views:
            knn = knn_probe(train_f.pooled[view.name], train_labels, test_f.pooled[view.name], test_labels, k=args.knn_k)
            try:
                linear = linear_probe(train_f.pooled[view.name], train_labels, test_f.pooled[view.name], test_labels, c=args.linear_c)
            except ValueError as err:
                raise ValueError(f"probe.py features: the train split cannot fit a classifier ({err})") from None
            rows.append({"model": label, "source": loaded.source, "layer": view.name, "block_index": view.global_index, "pool": pool_name(view, args.pool),
                         "knn_accuracy": knn.accuracy, "knn_balanced_accuracy": knn.balanced_accuracy, "linear_accuracy": linear.accuracy,
                         "linear_balanced_accuracy": linear.balanced_accuracy, "n_train": len(train_labels), "n_eval": len(test_labels)})
            for key in ("knn_accuracy", "linear_accuracy"):
                ctx.writer.add_scalar(f"features/{key}/{label}", rows[-1][key], view.global_index)
            write_csv(ctx.out / "features.csv", rows)  # per block: an interrupted run keeps what is finished
        ctx.writer.flush()
    ctx.writer.add_figure("features/accuracy_vs_depth", accuracy_figure(rows, args.split), 0)
    if second is not None:
        cka_rows = compare(ctx, views, feats["model"], feats["second"])
        ctx.writer.add_figure("cka/vs_depth", cka_figure(cka_rows), 0)
    print_table(rows, args.split)


def second_model(ctx) -> LoadedModel | None:
    """The model to compare with: --second-checkpoint / --second-config / --second-model, or --second-untrained."""
    args = ctx.args
    given = any(getattr(args, f"second_{key}") is not None for key in ("checkpoint", "config", "model"))
    if given and args.second_untrained:
        raise ValueError("give either --second-untrained or a second model (--second-checkpoint / --second-config / --second-model), not both")
    if args.second_untrained:
        fresh = ctx.loaded.fresh(args.seed + 1).to(ctx.device).eval()  # + 1: never the draw of an untrained first model
        return LoadedModel(fresh, ctx.loaded.name, f"untrained {ctx.loaded.name}", ctx.loaded.build, ctx.loaded.data)
    return ctx.load_second_model("second-") if given else None


def signature(model: torch.nn.Module) -> tuple:
    """What must match for block-by-block comparison: family, input, and every block's name, width and heads."""
    return (models.family_name(model), models.input_size(model), tuple((v.name, v.dim, v.num_heads, v.grid) for v in models.blocks(model)))


def check_same_architecture(first: LoadedModel, second: LoadedModel) -> None:
    a, b = signature(first.model), signature(second.model)
    if a != b:
        def describe(sig: tuple, loaded: LoadedModel) -> str:
            widths = sorted({block[1] for block in sig[2]})
            return f"{loaded.name} ({sig[0]}, input {sig[1]}, {len(sig[2])} blocks, widths {widths})"
        raise ValueError(f"probe.py features: the second model {describe(b, second)} is another architecture than {describe(a, first)}; "
                         "before/after and CKA compare the same architecture: give weights of the same model (and --second-model-kwargs)")


def pool_name(view, pool: str) -> str:
    if pool == "cls" and view.num_prefix_tokens == 0:
        raise ValueError(f"--pool cls: {view.name} has no class token (valid here: --pool mean or auto)")
    return "cls" if pool == "cls" or (pool == "auto" and view.num_prefix_tokens) else "mean"


def extract(ctx, model: torch.nn.Module, images, views, desc: str, token_images: int) -> tuple[Features, torch.Tensor]:
    """Pooled block outputs of all images of the stream and the tokens of the first ``token_images`` (model's own
    normalisation; volumes: as training gives them, the stream's), and the images' labels; only one batch of
    images is in memory at a time."""
    mean, std = (images.mean, images.std) if images.volumetric else models.normalization(model)
    labels: list[torch.Tensor] = []

    def inputs():
        for pixels, batch_labels in images.pixel_batches(ctx.args.batch_size):  # (b, C, H, W); volumes (b, C, I, J, K)
            labels.append(batch_labels)
            shape = (1, -1) + (1,) * (pixels.ndim - 2)
            yield (pixels - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)

    pooled: dict[str, list[torch.Tensor]] = {view.name: [] for view in views}
    tokens: dict[str, list[torch.Tensor]] = {view.name: [] for view in views}
    for rec in record_batches(model, inputs(), ["resid"], views, ctx.args.batch_size, ctx.device, desc, total=images.count):
        prefix = rec.capture.prefix
        for view in views:
            patch = rec.capture[view.name, "resid"]  # (b, T, C)
            use_cls = pool_name(view, ctx.args.pool) == "cls"
            pooled[view.name].append((prefix[view.name]["resid"][:, 0] if use_cls else patch.mean(1)).float())  # (b, C)
            if rec.start < token_images:
                tokens[view.name].append(patch[: token_images - rec.start].half())
    return Features({k: torch.cat(v) for k, v in pooled.items()}, {k: torch.cat(v) for k, v in tokens.items() if v}), torch.cat(labels)


def compare(ctx, views, first: Features, second: Features) -> list[dict[str, object]]:
    """Linear CKA per block between two models on the same images: pooled features and all tokens."""
    rows = []
    for view in views:
        a, b = first.pooled[view.name], second.pooled[view.name]  # (N, C)
        row = {"layer": view.name, "block_index": view.global_index, "cka_pooled": float(linear_cka(a, b)), "n_images": a.shape[0],
               "cka_tokens": float("nan"), "n_token_images": 0}
        if view.name in first.tokens:
            ta, tb = first.tokens[view.name], second.tokens[view.name]  # (n, T, C)
            row.update(cka_tokens=float(linear_cka(ta.reshape(-1, ta.shape[-1]), tb.reshape(-1, tb.shape[-1]))), n_token_images=ta.shape[0])
        rows.append(row)
        for key in ("cka_pooled", "cka_tokens"):
            ctx.writer.add_scalar(f"cka/{key.split('_')[1]}", row[key], view.global_index)
        write_csv(ctx.out / "cka.csv", rows)
    return rows


def accuracy_figure(rows: list[dict[str, object]], split: str):
    """k-NN and linear accuracy against depth, one line per model."""
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    for i, label in enumerate(dict.fromkeys(r["model"] for r in rows)):
        mine = [r for r in rows if r["model"] == label]
        depth = [r["block_index"] for r in mine]
        ax.plot(depth, [r["knn_accuracy"] for r in mine], "-o", color=f"C{i}", ms=3, label=f"{label}: k-NN")
        ax.plot(depth, [r["linear_accuracy"] for r in mine], "--s", color=f"C{i}", ms=3, label=f"{label}: linear")
    ax.set_xlabel("block (global index)")
    ax.set_ylabel(f"{split} accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title("frozen block features: k-NN and logistic regression", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def cka_figure(rows: list[dict[str, object]]):
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=90)
    depth = [r["block_index"] for r in rows]
    ax.plot(depth, [r["cka_pooled"] for r in rows], "-o", ms=3, label="pooled features")
    ax.plot(depth, [r["cka_tokens"] for r in rows], "--s", ms=3, label="all tokens")
    ax.set_xlabel("block (global index)")
    ax.set_ylabel("linear CKA (model vs second)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def print_table(rows: list[dict[str, object]], split: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"frozen features per block: {split} accuracy (balanced in brackets)")
    for col in ("model", "layer", "pool", "k-NN", "linear"):
        table.add_column(col, justify="left" if col in ("model", "layer", "pool") else "right")
    for r in rows:
        table.add_row(r["model"], r["layer"], r["pool"], f"{r['knn_accuracy']:.3f} ({r['knn_balanced_accuracy']:.3f})",
                      f"{r['linear_accuracy']:.3f} ({r['linear_balanced_accuracy']:.3f})")
    Console(width=max(100, Console().width)).print(table)
