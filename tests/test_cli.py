"""The command lines as a newcomer types them: shipped configs by name, probes without a
model argument, typed overrides, typo suggestions, empty validation, clean config.yaml after resume."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_args
from vitlab import cli_support
from vitlab.cli import fit, probe_main, train_main
from vitlab.data import MedicalDataModule
from vitlab.data.synthetic.embedded import EmbeddedOptions

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    """A folder holding runs/tiny/version_0 (1 epoch, save_dir given as the relative path "runs")."""
    home = tmp_path_factory.mktemp("home")
    cwd = os.getcwd()
    os.chdir(home)
    try:
        fit(tiny_args(tiny_dataset, Path("runs"), epochs=1))
    finally:
        os.chdir(cwd)
    return home


# ---------------------------------------------------------------------------------------------- §1


@pytest.mark.parametrize("name", ["medical_swin.yaml", "medical_swin"])
@pytest.mark.slow
def test_config_by_name_finds_the_shipped_config(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the repository's folder is used
    with pytest.raises(SystemExit):
        train_main(["--config", name])  # offline: ends at the pretrained weights, after the config was read
    err = capsys.readouterr().err
    assert "does not exist" not in err and "no such file" not in err
    assert "pretrained weights for 'swin_tiny_patch4_window7_224'" in err


def test_unknown_config_lists_the_shipped_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train_main(["--config", "medical_swinn.yaml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "medical_swinn.yaml" in err[0]
    assert all(name in err[0] for name in ("quickstart", "medical_swin", "medical_vit", "ablation_attention"))
    assert sorted(cli_support.shipped_configs()) == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.slow
def test_probe_without_model_uses_the_newest_run(trained, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    shutil.copytree(trained / "runs", home / "runs")
    newer = home / "runs" / "tiny" / "version_1"
    shutil.copytree(home / "runs" / "tiny" / "version_0", newer)
    os.utime(newer / "checkpoints" / "last.ckpt")  # newest by modification time
    monkeypatch.chdir(home)
    probe_main(["--ablate", "attention"])  # exactly the design card's command
    err = capsys.readouterr().err
    assert f"using the newest run's checkpoint {Path('runs/tiny/version_1/checkpoints/last.ckpt')}" in err
    assert (home / "runs" / "probe-ablate-tiny-version_1" / "summary.csv").is_file()
    # output folders are named after the run probed: a second run needs no --overwrite
    probe_main(["spectra", "--checkpoint", "runs/tiny/version_0/checkpoints/last.ckpt"])
    probe_main(["spectra"])
    assert (home / "runs" / "probe-spectra-tiny-version_0").is_dir() and (home / "runs" / "probe-spectra-tiny-version_1").is_dir()
    # drift defaults: the newest run against its own epoch-0 snapshot
    probe_main(["drift"])
    assert (home / "runs" / "probe-drift-tiny-version_1" / "drift.csv").is_file()


def test_probe_without_model_or_run_says_to_train_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["--ablate", "attention"], ["spectra"], ["drift"]):
        with pytest.raises(SystemExit):
            probe_main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "python train.py --config configs/quickstart.yaml" in err[0], err


# ---------------------------------------------------------------------------------------------- §6


def _print_config(*extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train.py", "--config", "configs/quickstart.yaml", *extra, "--print_config"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.mark.slow
def test_embedded_options_are_typed_on_the_command_line():
    dotted = _print_config("--data.embedded_kwargs.patients", "24", "--model.model_kwargs.embed_dim", "16")
    assert dotted["data"]["embedded_kwargs"]["patients"] == 24 and dotted["data"]["embedded_kwargs"]["size"] == 64
    assert dotted["model"]["model_kwargs"]["embed_dim"] == 16


def test_embedded_options_inline_mapping_is_typed(capsys):
    with pytest.raises(SystemExit):  # --print_config exits after printing
        fit(["--config", "quickstart", "--data.embedded_kwargs", "{patients: 24, difficulty: 0.5}", "--print_config"])
    inline = yaml.safe_load(capsys.readouterr().out)
    assert inline["data"]["embedded_kwargs"]["patients"] == 24 and inline["data"]["embedded_kwargs"]["difficulty"] == 0.5


def test_embedded_options_reach_the_generator_as_ints(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def record(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr("vitlab.data.synthetic.embedded.embedded_dataset", record)
    with pytest.raises(Stop):
        MedicalDataModule(embedded_kwargs=EmbeddedOptions(patients=24, size=32))
    assert seen["patients"] == 24 and seen["size"] == 32
    with pytest.raises(ValueError, match=r"unknown embedded dataset argument\(s\) \['patient'\]"):
        MedicalDataModule(embedded_kwargs={"patient": 24})


def test_embedded_options_match_the_generator():
    import dataclasses
    import inspect

    from vitlab.data.synthetic import generate

    params = {n: p.default for n, p in inspect.signature(generate).parameters.items() if n != "out"}
    assert {f.name: f.default for f in dataclasses.fields(EmbeddedOptions)} == params


# ---------------------------------------------------------------------------------------------- §9 typos


def test_mistyped_option_is_one_line_with_the_closest_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train_main(["--config", "quickstart", "--data.batchsize", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "vitlab: error: unknown option(s): --data.batchsize (did you mean --data.batch_size?)"
    assert len(err) <= 2


def test_wrongly_typed_nested_value_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train_main(["--config", "quickstart", "--data.embedded_kwargs.patients", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "vitlab: error: data.embedded_kwargs.patients: Expected a <class 'int'>. Got value: x" and len(err) == 2


def test_every_unknown_key_of_a_file_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  batchsize: 4\n  embedded_kwargs:\n    patiens: 3\nmodel:\n  lrr: 0.1\ntrainer:\n  max_epoch: 2\n")
    with pytest.raises(SystemExit):
        train_main(["--config", "quickstart", "--config", str(typo)])
    first = capsys.readouterr().err.strip().splitlines()[0]
    for wrong, right in (("data.batchsize", "data.batch_size"), ("data.embedded_kwargs.patiens", "data.embedded_kwargs.patients"),
                         ("model.lrr", "model.lr"), ("trainer.max_epoch", "trainer.max_epochs")):
        assert f"{wrong} (did you mean {right}?)" in first
    assert "quickstart.yaml" not in first  # valid nested keys of the shipped config are not flagged


# ---------------------------------------------------------------------------------------------- §9 data, runs


def _manifest(tiny_dataset: Path, path: Path, patient_of) -> Path:
    rows = list(csv.DictReader(open(tiny_dataset)))
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label", "patient_id"])
        for i, row in enumerate(rows):
            writer.writerow([tiny_dataset.parent / row["path"], row["label"], patient_of(i, row["label"])])
    return path


def test_empty_validation_stops_and_leaves_no_stub_run(tiny_dataset, tmp_path, capsys):
    # 2 patients sharing the class folders (as 18 real files with 2 PatientIDs did): one stratum each, none for val
    two = _manifest(tiny_dataset, tmp_path / "two.csv", lambda i, label: "AB"[(label == "lesion") == (i == 0)])
    with pytest.raises(ValueError, match=r"left validation empty \(patients per class: lesion: \d, no_lesion: \d; val_fraction 0.2\)"):
        MedicalDataModule(two, image_size=32, num_workers=0).setup("fit")
    with pytest.raises(SystemExit):
        train_main(tiny_args(two, tmp_path / "runs", epochs=1))
    assert "data.val_fraction" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tiny").exists() or not any((tmp_path / "runs" / "tiny").iterdir())


def test_class_missing_from_validation_warns(tiny_dataset, tmp_path):
    lesion_only = _manifest(tiny_dataset, tmp_path / "three.csv", lambda i, label: f"L{i % 2}" if label == "lesion" else "N")
    with pytest.warns(UserWarning, match=r"\['no_lesion'\] have no validation images"):
        MedicalDataModule(lesion_only, image_size=32, num_workers=0, val_fraction=0.25).setup("fit")


@pytest.mark.slow
def test_resume_keeps_config_a_recipe_and_one_best_checkpoint(trained, tmp_path, monkeypatch, tiny_dataset, capsys):
    shutil.copytree(trained / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    run = Path("runs/tiny/version_0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tiny_args(tiny_dataset, Path("runs"), epochs=2, extra=["--ckpt_path", str(run / "checkpoints" / "last.ckpt")]))
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]
    assert len(list((run / "checkpoints").glob("best-*.ckpt"))) == 1
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["ckpt_path"] is None
    logger = saved["trainer"]["logger"]["init_args"]
    assert logger["save_dir"] == "runs" and logger.get("version") is None
    out = capsys.readouterr().out
    assert "last weights" in out


@pytest.mark.slow
def test_closing_report_names_last_weights_after_testing(tiny_dataset, tmp_path, capsys):
    fit(tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=["--data.test_fraction", "0.25"]))
    out = capsys.readouterr().out
    assert "best weights" in out and "last weights" in out and "last.ckpt" in out


# ---------------------------------------------------------------------------------------------- §9 messages


def test_probe_offline_weights_error_names_probe_flags(capsys):
    with pytest.raises(SystemExit):
        probe_main(["spectra", "--model", "vit_tiny_patch16_224", "--pretrained"])
    err = capsys.readouterr().err
    assert "--weights FILE" in err and "drop --pretrained" in err and "model.weights" not in err


def test_warnings_print_without_source_line_and_no_litlogger_tip(caplog):
    vitlab_file = str(Path(cli_support.__file__))
    assert cli_support.format_warning("skipping bad file: x.dcm", UserWarning, vitlab_file, 3, "warnings.warn(x)") == "vitlab: warning: skipping bad file: x.dcm\n"
    assert "warnings.warn" not in cli_support.format_warning("m", UserWarning, "/other/lib.py", 3, "warnings.warn(x)")
    cli_support.quiet_output()
    from pytorch_lightning.utilities.rank_zero import rank_zero_info

    with caplog.at_level("INFO"):
        rank_zero_info("💡 Tip: try installing [litlogger](https://pypi.org/project/litlogger/)")
        rank_zero_info("kept")
    assert "litlogger" not in caplog.text and "kept" in caplog.text


def test_readme_and_help_name_papers_not_seed_numbers():
    from vitlab.probes import build_parser

    parser = build_parser()
    texts = {"README.md": (REPO / "README.md").read_text()}
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        texts[f"probe.py {name} --help"] = sub.format_help()
    texts["probe.py --help"] = parser.format_help()
    texts.update({f"configs/{p.name}": p.read_text() for p in (REPO / "configs").glob("*.yaml")})
    import vitlab.callbacks
    from vitlab.data import DenseDataModule
    from vitlab.training import ClassificationModule, DetectionModule, DINOModule, SegmentationModule

    for obj in (ClassificationModule, DetectionModule, SegmentationModule, DINOModule, MedicalDataModule, DenseDataModule, *(getattr(vitlab.callbacks, n) for n in vitlab.callbacks.__all__)):
        texts[f"train.py help of {obj.__name__}"] = obj.__doc__ or ""  # what --help / --*.help prints
    for where, text in texts.items():
        for word in ("seed 00", "Seed 00", "seeds 00", "SPEC"):
            assert word not in text, f"{where} says {word!r}"
    readme = texts["README.md"]
    assert "## The papers behind vitlab" in readme
    for title in ("Embedding Matrix Evolution in Vision Transformers", "Discussion of transformer models",
                  "Probing Vision Transformer Attention: Image Statistics and Patch Similarity",
                  "Representation in Vision Transformers and Attentionless Models"):
        assert title in readme
    assert "Philip et al." in texts["probe.py mi --help"] and "Attentionless article" in texts["probe.py ablate --help"]
