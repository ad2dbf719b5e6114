"""probe.py claims --study's aggregation on planted cells (no training): which claims hold per variant, the
Attentionless table, paired differences against the baseline, untestable variants, and the figures."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vitlab.analysis import claims as C
from vitlab.analysis.studies import seed_estimate
from vitlab.probes.study_claims import ACC, AUROC, CellResult, aggregate, figures, markdown

VARIANTS = ["ablate=none", "ablate=residual", "ablate=attention"]


def planted_cells(seeds: int = 5) -> list[CellResult]:
    rng = np.random.default_rng(0)
    cells = []
    for variant, acc, removed in zip(VARIANTS, (0.85, 0.5, 0.8), ([], ["residual"], ["attention"])):
        for s in range(seeds):
            cell = CellResult(f"{variant}-{s}", str(s), variant, Path("."), removed, 2)
            cell.metrics = {ACC: acc + rng.normal(0, 0.01) if acc != 0.5 else 0.5, AUROC: 0.9 + rng.normal(0, 0.01)}
            cell.curves = {"val/balanced_acc": [(e, acc * (1 - np.exp(-e - rng.uniform()))) for e in range(5)]}
            if variant == "ablate=attention":  # Q/K/V did not move
                cell.claims["000-a"] = C.untestable("000-a", "drift", "no Q/K/V row moved")
            else:  # 000-a planted far below its threshold 1, 002-a around its threshold 0.5
                cell.claims["000-a"] = C._scored("000-a", "drift", "ratio", "T < 1", {}, 0.6 + rng.normal(0, 0.02), 1.0, "<")
            cell.claims["002-a"] = C._scored("002-a", "rho", "min", "T > 0.5", {}, 0.5 + rng.normal(0, 0.05), 0.5, ">")
            for claim_id, (component, claim_of) in (("003-a", ("residual", C.claim_003a)), ("003-b", ("attention", C.claim_003b))):
                if component in removed:
                    cell.claims[claim_id] = claim_of([(cell.name, removed, cell.metrics[ACC], 2)])
            cells.append(cell)
    return cells


def test_aggregate_per_variant_table_and_paired_differences():
    cells = planted_cells()
    record = {"cells": [{"variant": v} for v in VARIANTS], "baseline": "ablate=none"}
    report = aggregate(cells, record)
    verdicts = {(c.id, c.variant): c.verdict for c in report["claims"]}
    assert verdicts[("000-a", "ablate=none")] == "holds" and verdicts[("000-a", "ablate=residual")] == "holds"
    assert verdicts[("003-a", "ablate=residual")] == "holds" and verdicts[("003-b", "ablate=attention")] == "holds"
    assert ("000-a", "ablate=attention") not in verdicts
    assert {"id": "000-a", "variant": "ablate=attention", "verdict": "not testable", "reason": "no Q/K/V row moved"} in report["untestable"]
    residual = next(c for c in report["claims"] if c.id == "003-a")
    assert residual.runs == 5 and residual.runs_holding == 5 and residual.estimate.values == {str(s): 0.0 for s in range(5)}
    rows = {r["variant"]: r for r in report["table"]}
    expected = seed_estimate({c.seed: c.metrics[ACC] for c in cells if c.variant == "ablate=attention"})
    assert rows["ablate=attention"][ACC] == expected
    diffs = {(d.variant, d.metric): d for d in report["differences"]}
    assert set(diffs) == {(v, m) for v in VARIANTS[1:] for m in (ACC, AUROC)}
    drop = diffs[("ablate=residual", ACC)]
    assert drop.differs and drop.estimate.mean == pytest.approx(
        np.mean([0.5 - c.metrics[ACC] for c in cells if c.variant == "ablate=none"]))


def test_untestable_claims_without_the_variant_and_the_report(tmp_path):
    cells = [c for c in planted_cells(seeds=3) if c.variant == "ablate=none"]
    report = aggregate(cells, {"cells": [{"variant": "ablate=none"}], "baseline": "ablate=none"})
    reasons = {u["id"]: u["reason"] for u in report["untestable"]}
    assert "add ablate=residual to the grid" in reasons["003-a"] and "add ablate=attention" in reasons["003-b"]
    assert report["differences"] == []
    text = markdown({"study": "s"}, report, cells)
    assert "| 000-a | ablate=none | T < 1 |" in text and "## The Attentionless table" in text


def test_figures_are_written_as_png_and_tensorboard_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    cells = planted_cells()
    report = aggregate(cells, {"cells": [{"variant": v} for v in VARIANTS], "baseline": "ablate=none"})
    writer = SummaryWriter(str(tmp_path))
    written = figures(SimpleNamespace(out=tmp_path, writer=writer), report, cells, "study planted")
    writer.close()
    assert sorted(p.name for p in written) == ["attentionless_table.png", "curves_val_balanced_acc.png", "forest.png"]
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert set(acc.Tags()["images"]) == {"study/claims_forest", "study/attentionless_table", "study/curves/val/balanced_acc"}
    image = acc.Images("study/claims_forest")[0]
    assert image.width > 800 and image.height > 400


def test_spectral_claims_are_untestable_when_the_attention_weights_never_trained():
    import torch

    from vitlab.models import build_model
    from vitlab.probes.claims import evaluate
    from vitlab.qkv.state import head_counts, qkv_state

    torch.manual_seed(0)
    model = build_model("swin_tiny_patch4_window7_224", 2, in_chans=1, img_size=32, patch_size=4, embed_dim=16,
                        depths=(2, 2), num_heads=(1, 2), window_size=4)
    ref = qkv_state(model)
    moved = {k: v + 0.01 * torch.randn_like(v) for k, v in ref.items()}
    trained = {c.id: c.verdict for c in evaluate(ref, moved, head_counts(model), [], 19, 0)}
    assert all(trained[k] in ("holds", "does not hold") for k in ("000-a", "002-a", "002-b", "002-c"))
    frozen = {c.id: c for c in evaluate(ref, {k: v.clone() for k, v in ref.items()}, head_counts(model), [], 19, 0)}
    for claim_id in ("000-a", "000-b", "000-c", "000-d", "002-a", "002-b", "002-c"):
        assert frozen[claim_id].verdict == "not testable" and "did not change" in frozen[claim_id].reason
