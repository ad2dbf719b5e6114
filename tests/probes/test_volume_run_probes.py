"""The probes that read a run (drift, spectra, claims) and ablate on a trained 3-D run: a 1-epoch tiny SwinUNETR
segmentation fit on synthetic CT volumes with the Q/K/V callbacks. Oracles: the training callbacks' own tables, and
validation's Dice (the probe's intact Dice on the validation volumes is the ``val/dice_lesion`` training logged)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.volumes import volume_fit_args
from vitlab.probes import main as probe

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def volume_run(tmp_path_factory) -> Path:
    from vitlab.cli import fit
    from vitlab.data.synthetic import generate_volumes

    root = tmp_path_factory.mktemp("volume-run")
    manifest = generate_volumes(root / "v", patients=4, size=32, slices=8, seed=2, difficulty=0.0)
    fit(volume_fit_args(manifest, root / "runs", epochs=1))
    return root / "runs" / "tiny" / "version_0"


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_drift_and_spectra_of_a_3d_run_equal_the_training_callbacks(volume_run, tmp_path):
    ckpt = str(volume_run / "checkpoints" / "last.ckpt")
    probe(["drift", "--finetuned", ckpt, "--out", str(tmp_path / "drift")])
    probed, logged = rows(tmp_path / "drift" / "drift.csv"), rows(volume_run / "qkv" / "drift_epoch_001.csv")
    assert len(probed) == len(logged) > 0
    for mine, theirs in zip(probed, logged):
        assert (mine["block"], mine["matrix"], mine["row"]) == (theirs["block"], theirs["matrix"], theirs["row"])
        assert float(mine["euclidean"]) == pytest.approx(float(theirs["euclidean"]), rel=1e-4, abs=1e-7)
    assert max(float(r["euclidean"]) for r in probed) > 0  # training moved the encoder's Q/K/V
    probe(["spectra", "--checkpoint", ckpt, "--out", str(tmp_path / "spectra")])
    probed, logged = rows(tmp_path / "spectra" / "spectra.csv"), rows(volume_run / "qkv" / "spectra_epoch_001.csv")
    assert [(r["block"], r["head"]) for r in probed] == [(r["block"], r["head"]) for r in logged]
    assert {r["block"] for r in probed} == {f"stage{s}.block{b}" for s in range(4) for b in range(2)}
    for mine, theirs in zip(probed, logged):
        assert float(mine["positive_mass"]) == pytest.approx(float(theirs["positive_mass"]), abs=1e-5)


def test_claims_of_a_3d_run(volume_run, tmp_path):
    probe(["claims", "--run", str(volume_run), "--permutations", "19", "--out", str(tmp_path / "claims")])
    report = json.loads((tmp_path / "claims" / "claims.json").read_text())
    assert report["header"]["model"] == "monai:swin_unetr" and report["header"]["blocks"] == 8
    verdicts = {claim["id"]: claim["verdict"] for claim in report["claims"]}
    assert {"000-a", "000-d", "002-a", "002-c"} <= set(verdicts)
    assert all(verdicts[c] in ("holds", "does not hold") for c in ("000-a", "000-b", "000-c", "000-d", "002-a", "002-b", "002-c")), verdicts
    assert (tmp_path / "claims" / "claims.md").is_file()


def test_ablate_dice_of_a_3d_run_is_validations(volume_run, tmp_path):
    out = tmp_path / "ablate"
    probe(["ablate", "--checkpoint", str(volume_run / "checkpoints" / "last.ckpt"), "--ablate", "attention",
           "--accuracy-images", "2", "--out", str(out)])  # the 2 validation volumes (4 patients, val_fraction 0.5)
    table = {r["variant"]: r for r in rows(out / "dice.csv")}
    acc = EventAccumulator(str(volume_run), size_guidance={"scalars": 0})
    acc.Reload()
    validation = acc.Scalars("val/dice_lesion")[-1].value  # last.ckpt holds the weights validation measured
    assert table["intact"]["volumes"] == "2"
    assert float(table["intact"]["dice_lesion"]) == pytest.approx(validation, rel=1e-5, abs=1e-7)
    assert 0.0 <= float(table["no attention"]["dice_lesion"]) <= 1.0
