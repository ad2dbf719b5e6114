"""probe.py claims end to end on a tiny fit run (and an 'ablation' run), plus its bad-input messages."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from vitlab.cli import fit, probe_main
from tests.helpers.runs import tiny_args


@pytest.fixture(scope="module")
def tiny_run(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    fit(tiny_args(tiny_dataset, root / "runs", epochs=2))
    return root / "runs" / "tiny" / "version_0"


@pytest.mark.slow
def test_claims_report_on_a_run(tiny_run, tmp_path, capsys):
    out = tmp_path / "out"
    probe_main(["claims", "--run", str(tiny_run), "--out", str(out), "--permutations", "99"])
    report = json.loads((out / "claims.json").read_text())
    ids = [c["id"] for c in report["claims"]]
    assert ids == ["000-a", "000-b", "000-c", "000-d", "002-a", "002-b", "002-c", "003-a", "003-b"]
    verdicts = {c["id"]: c["verdict"] for c in report["claims"]}
    assert all(v in ("holds", "does not hold") for k, v in verdicts.items() if k[:3] in ("000", "002"))
    assert verdicts["003-a"] == "not testable" and "--ablation-run" in report["claims"][7]["reason"]
    assert "epoch 0" in report["header"]["reference weights"] and "epoch 2" in report["header"]["compared weights"]
    assert "swin" in report["header"]["model"]
    md = (out / "claims.md").read_text()
    assert "| 000-a |" in md and str(tiny_run) in md
    # the measured value is the run's own: 000-b's V dot product equals the mean of the drift CSV's dot column for V
    import csv

    rows = list(csv.DictReader(open(tiny_run / "qkv" / "drift_epoch_002.csv")))
    by_block = {}
    for r in rows:
        if r["matrix"] == "v":
            by_block.setdefault(r["block"], []).append(float(r["dot"]))
    expected = sum(sum(v) / len(v) for v in by_block.values()) / len(by_block)
    assert report["claims"][1]["value"]["dot"]["v"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_claims_with_ablation_run_and_two_runs(tiny_run, tmp_path):
    ablation = tmp_path / "ablation_attention" / "version_0"
    shutil.copytree(tiny_run, ablation)
    cfg = yaml.safe_load((ablation / "config.yaml").read_text())
    cfg["model"]["ablate"] = cfg["vitlab"]["ablate"] = {"remove": ["attention"], "blocks": None}  # (and its record)
    (ablation / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    probe_main(["claims", "--reference", str(tiny_run / "qkv" / "epoch_000.safetensors"), "--finetuned", str(tiny_run),
                "--ablation-run", str(ablation), "--out", str(out), "--permutations", "19"])
    report = json.loads((out / "claims.json").read_text())
    b = report["claims"][8]
    assert b["id"] == "003-b" and b["verdict"] in ("holds", "does not hold")
    value = b["value"]["ablation_attention/version_0"]
    assert value["chance"] == pytest.approx(0.5) and 0.0 <= value["best_val_balanced_acc"] <= 1.0
    assert report["claims"][7]["verdict"] == "not testable"


@pytest.mark.slow
def test_claims_bad_input(tiny_run, tmp_path, capsys):
    one = tmp_path / "one" / "version_0"
    (one / "qkv").mkdir(parents=True)
    shutil.copy(tiny_run / "qkv" / "epoch_000.safetensors", one / "qkv")
    with pytest.raises(SystemExit):
        probe_main(["claims", "--run", str(one), "--out", str(tmp_path / "o1")])
    assert "epoch_000.safetensors" in capsys.readouterr().err
    empty = tmp_path / "empty" / "version_0"
    empty.mkdir(parents=True)
    with pytest.raises(SystemExit):
        probe_main(["claims", "--run", str(empty), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert "no Q/K/V snapshots" in err and "QKVSnapshot" in err
    with pytest.raises(SystemExit):
        probe_main(["claims", "--run", str(tiny_run), "--ablation-run", str(tiny_run), "--out", str(tmp_path / "o3")])
    assert "not an ablation run" in capsys.readouterr().err
