"""probe.py drift: two weight sets of one architecture -> the drift report; bad input -> one line."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.helpers.runs import events
from vitlab.qkv.state import head_counts, qkv_state
from vitlab.cli import probe_main
from vitlab.models.testing import tiny_model
from vitlab.probes import main
from vitlab.outputs.files import save_safetensors


def snapshot(model, path):
    return save_safetensors(qkv_state(model), path, {"heads": head_counts(model), "epoch": 0})


@pytest.mark.slow
def test_drift_between_snapshots_finds_a_planted_change(tmp_path, capsys):
    model = tiny_model("timm-vit", seed=0)
    a = snapshot(model, tmp_path / "a.safetensors")
    state = qkv_state(model)
    blocks = list(head_counts(model))
    target = blocks[-1]
    hd = state[f"{target}.k.weight"].shape[0] // head_counts(model)[target]
    with torch.no_grad():  # plant a change in head 1 of the last block's K only
        from vitlab.models import qkv

        qkv(model)[target]["k"][hd : 2 * hd].mul_(1.5).add_(0.1)
    b = snapshot(model, tmp_path / "b.safetensors")

    main(["drift", "--reference", str(a), "--finetuned", str(b), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "stage0" in out and "results in" in out

    rows = list(csv.DictReader(open(tmp_path / "out" / "drift.csv")))
    changed = {(r["block"], r["matrix"], int(r["head"])) for r in rows if float(r["euclidean"]) > 0}
    assert changed == {(target, "k", 1)}
    ours = [r for r in rows if r["block"] == target and r["matrix"] == "k" and int(r["head"]) == 1]
    assert len(ours) == hd and all(float(r["cosine_distance"]) > 0 for r in ours)

    summary = list(csv.DictReader(open(tmp_path / "out" / "drift_summary.csv")))
    assert {(r["stage"], r["matrix"]) for r in summary} == {("stage0", "Q"), ("stage0", "K"), ("stage0", "V")}

    acc = events(tmp_path / "out")
    assert f"drift/rel_frobenius/{target}.k" in acc.Tags()["scalars"]
    assert acc.Scalars(f"drift/rel_frobenius/{blocks[0]}.q")[0].value == 0.0
    assert acc.Scalars(f"drift/rel_frobenius/{target}.k")[0].value > 0.0
    for tag in ("drift_map/cosine_distance", f"drift_local/{target}", "spectra_figure/stage0"):
        assert any(t.startswith(tag) for t in acc.Tags()["images"]), tag


@pytest.mark.slow
def test_drift_reads_checkpoints_and_weight_files(tmp_path, tiny_dataset):
    from vitlab.models import build_model

    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    m1 = build_model("vit_tiny_patch16_224", 2, **kwargs)
    torch.manual_seed(1)
    m2 = build_model("vit_tiny_patch16_224", 2, **kwargs)
    torch.save(m1.state_dict(), tmp_path / "a.pth")
    torch.save(m2.state_dict(), tmp_path / "b.pth")
    import json

    main(["drift", "--reference", str(tmp_path / "a.pth"), "--finetuned", str(tmp_path / "b.pth"), "--model", "vit_tiny_patch16_224",
          "--model-kwargs", json.dumps(kwargs), "--out", str(tmp_path / "o")])
    rows = list(csv.DictReader(open(tmp_path / "o" / "drift.csv")))
    u = m1.blocks[0].attn.qkv.weight[:32].double()
    v = m2.blocks[0].attn.qkv.weight[:32].double()
    got = [float(r["euclidean"]) for r in rows if r["block"] == "stage0.block0" and r["matrix"] == "q"]
    assert got == pytest.approx((u - v).norm(dim=1).tolist(), rel=1e-7)  # CSV keeps 8 significant digits


@pytest.mark.slow
def test_drift_bad_input_is_one_line(tmp_path, capsys):
    vit = snapshot(tiny_model("timm-vit", seed=0), tmp_path / "vit.safetensors")
    swin = snapshot(tiny_model("timm-swin", seed=0), tmp_path / "swin.safetensors")
    cases = [
        (["--reference", str(vit), "--finetuned", str(swin)], "different architectures"),
        (["--reference", str(vit), "--finetuned", str(tmp_path / "missing.ckpt")], "missing.ckpt"),
    ]
    for args, needle in cases:
        with pytest.raises(SystemExit) as exc:
            probe_main(["drift", *args, "--out", str(tmp_path / "o")])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()  # a failed run leaves no folder that would block a rerun
    probe_main(["drift", "--reference", str(vit), "--finetuned", str(vit), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        probe_main(["drift", "--reference", str(vit), "--finetuned", str(vit), "--out", str(tmp_path / "o")])
    assert "--overwrite" in capsys.readouterr().err
