"""Studies end to end on a tiny Swin and tiny generated DICOM data (slow): a grid run here two at a time and its
claims (every interval recomputed with scipy from the numbers claims.json gives per cell), a study SIGKILLed in
the middle of a cell and rerun, and the same grid through submitit's local executor."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import bootstrap, norm, t

from tests.helpers.runs import events, tiny_args
from tests.helpers.runs import all_points
from vitlab.cli import fit, probe_main, train_main
from vitlab.study.record import DONE, StudyFolder

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture()
def here(tmp_path, monkeypatch):
    """Run in ``tmp_path`` with this checkout's vitlab in the cells' processes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return tmp_path


def _expanded_interval(values: list[float], random_state: int = 0) -> tuple[float, float]:
    """The interval a study reports for ``values``, computed here from scipy and the textbook level."""
    n = len(values)
    level = 1 - 2 * norm.sf(math.sqrt(n / (n - 1)) * t.ppf(0.975, n - 1))
    ci = bootstrap((np.array(values),), np.mean, n_resamples=9999, confidence_level=level, method="percentile",
                   random_state=random_state).confidence_interval
    return ci.low, ci.high


def _check(estimate: dict, values: dict[str, float]) -> None:
    assert estimate["values"] == pytest.approx(values, rel=1e-6)
    low, high = _expanded_interval(list(estimate["values"].values()))
    assert (estimate["interval"]["low"], estimate["interval"]["high"]) == pytest.approx((low, high), rel=1e-9, abs=1e-12)
    assert estimate["mean"] == pytest.approx(np.mean(list(values.values())), rel=1e-6)


def test_grid_runs_two_at_a_time_and_its_claims_are_recomputable(tiny_dataset, here, capsys):
    argv = [*tiny_args(tiny_dataset, here / "runs", epochs=1), "--study", "seeds=0,1,2", "ablate=none,attention",
            "--study.parallel", "2"]
    train_main(argv)
    folder = StudyFolder(here / "runs" / "tiny-ablate-seed")
    record = folder.load()
    names = [c["name"] for c in record["cells"]]
    assert len(names) == 6 and record["status"] == {n: DONE for n in names}
    for cell in record["cells"]:
        assert sorted(p.name for p in (folder.path / cell["name"]).iterdir()) == ["version_0"]
        state = folder.state(cell["name"])
        assert state["attempts"] == 1 and state["resumed_from"] is None and state["cpu_s"] > 0
    # one cell's config.yaml repeats it: the same parser reads it back with its seed and ablation
    import yaml

    cfg_path = folder.path / "ablate-attention_seed-2" / "version_0" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    assert cfg["seed_everything"] == 2 and cfg["data"]["seed"] == 2 and cfg["model"]["ablate"]["remove"] == ["attention"]
    cores = len(os.sched_getaffinity(0))
    assert cfg["runtime"]["threads"] <= max(1, math.ceil(cores / 2))  # two at once: each run on its share of the cores
    spans = [(folder.state(n)["started"], folder.state(n)["finished"]) for n in names]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:])  # they overlapped
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        fit(["--config", str(cfg_path), "--print_config"])
    assert exit_.value.code == 0 and yaml.safe_load(capsys.readouterr().out)["model"]["ablate"] == cfg["model"]["ablate"]
    train_main(argv)  # all done: nothing runs again
    assert "6 cells (6 done)" in capsys.readouterr().err
    assert all(folder.state(n)["attempts"] == 1 for n in names)

    probe_main(["claims", "--study", str(folder.path), "--permutations", "49"])
    out = folder.path / "claims"
    report = json.loads((out / "claims.json").read_text())
    cells = {c["cell"]: c for c in report["cells"]}
    for name, cell in cells.items():  # each cell's metric, read back from its own event files
        acc = events(folder.path / name / "version_0").Scalars("val/balanced_acc")
        assert cell["metrics"]["best val balanced accuracy"] == pytest.approx(max(e.value for e in acc), rel=1e-6)
    for claim in report["claims"]:
        values = {c["seed"]: c["claims"][claim["id"]]["score"] for c in cells.values()
                  if c["variant"] == claim["variant"] and c["claims"].get(claim["id"], {}).get("score") is not None}
        _check(claim["estimate"], values)
        lo, hi = claim["estimate"]["interval"]["low"], claim["estimate"]["interval"]["high"]
        expected = "holds" if all(_holds(v, claim) for v in (lo, hi)) else "does not hold" if not any(_holds(v, claim) for v in (lo, hi)) else "inconclusive"
        assert claim["verdict"] == expected and f"{claim['threshold']:g}" in claim["reason"]
    assert {(c["id"], c["variant"]) for c in report["claims"]} >= {("003-b", "ablate=attention"), ("002-a", "ablate=none")}
    for row in report["table"]:
        _check(row["best val balanced accuracy"], {c["seed"]: c["metrics"]["best val balanced accuracy"]
                                                   for c in cells.values() if c["variant"] == row["variant"]})
    (diff,) = [d for d in report["differences"] if d["metric"] == "best val balanced accuracy"]
    by = {(c["variant"], c["seed"]): c["metrics"]["best val balanced accuracy"] for c in cells.values()}
    _check(diff["estimate"], {s: by[("ablate=attention", s)] - by[("ablate=none", s)] for s in ("0", "1", "2")})
    assert "## The Attentionless table" in (out / "claims.md").read_text()
    acc = events(out)
    images = set(acc.Tags()["images"])
    assert {"study/claims_forest", "study/attentionless_table", "study/curves/val/balanced_acc"} <= images
    for png in ("forest.png", "attentionless_table.png", "curves_val_balanced_acc.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _holds(value: float, claim: dict) -> bool:
    c = claim["threshold"]
    return {"<": value < c, "<=": value <= c, ">": value > c, ">=": value >= c}[claim["holds_when"]]


def test_study_killed_in_the_middle_of_a_cell_resumes_without_training_anything_twice(tiny_dataset, here):
    args = [*tiny_args(tiny_dataset, here / "runs", epochs=2), "--study", "seeds=0", "ablate=none,attention,mlp"]
    folder = StudyFolder(here / "runs" / "tiny-ablate-seed")
    victim = "ablate-attention_seed-0"  # the second of three cells
    code = "import sys; from vitlab.cli import train_main; train_main(sys.argv[1:])"
    study = subprocess.Popen([sys.executable, "-c", code, *args], cwd=here, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpt = folder.run_path(victim) / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and study.poll() is None:  # its first epoch checkpointed: the cell is mid-run
        if ckpt.exists() and torch.load(ckpt, weights_only=True, mmap=True)["epoch"] == 0:
            break
        time.sleep(0.05)
    assert study.poll() is None, study.stderr.read()[-2000:]
    study.send_signal(signal.SIGKILL)
    study.wait()
    deadline = time.monotonic() + 30
    while folder.busy(victim) and time.monotonic() < deadline:  # its training process ends with it (no run left behind)
        time.sleep(0.1)
    assert not folder.busy(victim)
    assert folder.status("ablate-none_seed-0") == DONE and folder.status(victim) == "interrupted"
    assert not folder.run_path("ablate-mlp_seed-0").exists()  # the cell after it never started

    train_main(args)
    names = [c["name"] for c in folder.load()["cells"]]
    assert all(folder.status(n) == DONE for n in names)
    state = folder.state(victim)
    assert state["attempts"] == 2 and state["resumed_from"] == str(ckpt)
    reference = {tag: [s for s, _ in pts] for tag, pts in all_points(folder.run_path("ablate-none_seed-0")).items()}
    for name in names:  # every cell: one run folder, one point per step, the steps of a cell nobody killed
        assert sorted(p.name for p in (folder.path / name).iterdir()) == ["version_0"]
        points = {tag: [s for s, _ in pts] for tag, pts in all_points(folder.run_path(name)).items()}
        assert {k.split(" ")[0] for k in points} == {k.split(" ")[0] for k in reference}, name
        for tag, steps in points.items():  # (Lightning logs "epoch" beside each metric: several points a step there too)
            assert steps == reference[tag] if tag in reference else steps == sorted(set(steps)), (name, tag)
        assert points["scalars:val/balanced_acc"] == sorted(set(points["scalars:val/balanced_acc"])) and len(points["scalars:val/balanced_acc"]) == 2
        assert len(list((folder.run_path(name) / "qkv").glob("epoch_*.safetensors"))) == 3


def test_the_grid_runs_through_submitits_local_executor(tiny_dataset, here):
    args = [*tiny_args(tiny_dataset, here / "runs", epochs=1), "--study", "seeds=0", "ablate=none,attention",
            "--study.launcher", "submitit_local", "--study.parallel", "2"]
    train_main(args)
    folder = StudyFolder(here / "runs" / "tiny-ablate-seed")
    record = folder.load()
    assert record["status"] == {c["name"]: DONE for c in record["cells"]} and len(record["cells"]) == 2
    for cell in record["cells"]:
        assert events(folder.run_path(cell["name"])).Scalars("val/balanced_acc")
    assert list((folder.path / "submitit").glob("*_log.out"))  # submitit's own job logs
