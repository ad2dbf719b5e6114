"""probe.py spectra: the QK bilinear form's spectra of a checkpoint (Philip et al., Fig. 5), as the QKSpectra callback."""

from __future__ import annotations

import argparse

from vitlab import models
from vitlab.qkv.state import head_counts, qkv_state
from vitlab.qkv.spectra import block_spectra, report_spectra, spectra_layout, spectra_rows
from vitlab.probes.activations import require_attention
from vitlab.probes.common import add_common_arguments
from vitlab.solver_pool import SolverPool

HELP = """Spectra of each block's QK bilinear form W_Q W_K^T (Philip et al., Fig. 5), the same as the QKSpectra callback.

Per block and head: eigenvalues of the symmetric part (positive mass), the +-i lambda pairs of the antisymmetric
part, the symmetry score and the singular values (effective rank); also for the head-summed matrix. Writes the
per-stage Fig. 5 images, a blocks x heads positive-mass heatmap, scalars and spectra.csv (one row per block
and head, head = sum for the summed matrix). Needs no images. Cosine attention (Swin V2): the spectra of the
same W_Q W_K^T, the form of the un-normalised q.k (sign structure and effective rank carry over, magnitudes not).

example:
  python probe.py spectra --checkpoint runs/quickstart/version_0/checkpoints/last.ckpt
  python probe.py spectra --model vit_base_patch16_224 --pretrained
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, images=False)


def run(ctx) -> None:
    require_attention(ctx.model, "spectra")
    with SolverPool() as solvers:  # (each problem on one core, as many at once as torch has threads)
        spectra = block_spectra(qkv_state(ctx.model), head_counts(ctx.model), executor=solvers)
    report_spectra(ctx.writer, spectra, 0, ctx.out / "spectra.csv")
    ctx.writer.add_custom_scalars(spectra_layout())
    print_summary(spectra_rows(spectra), ctx.loaded.source)
    if any(view.attention_form == "cosine" for view in models.blocks(ctx.model)):
        print("cosine attention: these are the spectra of W_Q W_K^T, the bilinear form of the un-normalised q.k "
              "(positive mass, symmetry and effective rank carry over to the cosine logits; magnitudes do not)")


def print_summary(rows: list[dict[str, object]], source: str) -> None:
    """The head-summed statistics of every block as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"QK bilinear form W_Q W_K^T, heads summed ({source})")
    cols = ("block", "positive_mass", "symmetry_score", "effective_rank", "top_singular_value")
    for col in cols:
        table.add_column(col, justify="left" if col == "block" else "right")
    for row in rows:
        if row["head"] == "sum":
            table.add_row(*(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols))
    Console(width=max(100, Console().width)).print(table)
