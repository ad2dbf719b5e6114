"""Where a study runs and what it records, without training: the slots of each launcher, the study folder and its
locks, the parser's one-line refusals of grid values, the plan --print_config shows, and the SLURM job array
submitit would submit (a stand-in ``sbatch`` keeps the script; a stand-in ``sacct`` says the jobs' states)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_args
from vitlab.cli import train_main
from vitlab.study.launch import slots
from vitlab.study.record import DONE, INTERRUPTED, PENDING, RUNNING, StudyFolder

ROOT = Path(__file__).resolve().parents[2]


def test_slots_one_run_per_gpu_or_a_share_of_the_cores():
    assert slots("auto", True, 4, [0, 1]) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert slots("auto", True, 4, [0, 1], gpus_per_run=2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert slots(2, True, 1, [0]) == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2  # two runs share the one GPU when asked
    assert slots("auto", False, 0, [0, 1]) == [{}]  # one run at a time takes every core, as train.py alone
    assert slots("auto", True, 0, [0, 1]) == [{}]  # no GPU visible: the CPU
    assert slots(2, False, 0, [0, 1]) == [{"VITLAB_STUDY_CPUS": "0", "OMP_NUM_THREADS": "1"},
                                          {"VITLAB_STUDY_CPUS": "1", "OMP_NUM_THREADS": "1"}]
    assert slots(2, False, 0, [4, 5, 6, 7, 8]) == [{"VITLAB_STUDY_CPUS": "4,6,8", "OMP_NUM_THREADS": "3"},
                                                   {"VITLAB_STUDY_CPUS": "5,7", "OMP_NUM_THREADS": "2"}]
    assert slots(3, False, 0, [0, 1])[2] == {"VITLAB_STUDY_CPUS": "0", "OMP_NUM_THREADS": "1"}


def _plan(grid, max_epochs=2):
    return {"grid": grid, "base_config": {"trainer": {"max_epochs": max_epochs}}, "cells": [{"name": "a"}], "cwd": "."}


def test_study_folder_refuses_another_grid_or_config_and_keeps_its_jobs(tmp_path):
    folder = StudyFolder(tmp_path / "s")
    record = folder.open(_plan([{"key": "seed", "values": ["0", "1"]}]))
    record["jobs"] = {"a": "12_0"}
    folder.save(record)
    again = folder.open(_plan([{"key": "seed", "values": ["0", "1"]}]))
    assert again["jobs"] == {"a": "12_0"} and again["created"] == record["created"]
    with pytest.raises(ValueError, match=r"holds a study of another grid \(there: seed=0,1; this command: seed=0,1,2\)"):
        folder.open(_plan([{"key": "seed", "values": ["0", "1", "2"]}]))
    with pytest.raises(ValueError, match=r"another config \(trainer.max_epochs: 2 there, 3 in this command\)"):
        folder.open(_plan([{"key": "seed", "values": ["0", "1"]}], max_epochs=3))
    with pytest.raises(FileNotFoundError, match="no study here"):
        StudyFolder(tmp_path / "none").load()


def test_cell_lock_is_exclusive_and_a_killed_runner_reads_as_interrupted(tmp_path):
    folder = StudyFolder(tmp_path)
    assert folder.status("c") == PENDING
    with folder.lock("c") as fd:
        assert fd is not None and folder.busy("c")
        with folder.lock("c") as second:
            assert second is None
        folder.write_state("c", {"status": RUNNING})
        assert folder.status("c") == RUNNING
    assert not folder.busy("c") and folder.status("c") == INTERRUPTED  # its process ended without a word
    folder.write_state("c", {"status": DONE})
    assert folder.status("c") == DONE


@pytest.fixture()
def tiny(tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tiny_args(tiny_dataset, tmp_path / "runs", epochs=1)


@pytest.mark.parametrize("grid, message", [
    (["seeds=0", "model.lrr=1,2"], "vitlab: error: --study model.lrr=1: unknown option(s): --model.lrr (did you mean --model.lr?)"),
    (["model.lr=0.1,abc"], "vitlab: error: --study model.lr=abc: model.lr: Expected a <class 'float'>. Got value: abc"),
    (["data.augment=light,5"], None),  # a str key takes "5": no refusal, the plan is printed
])
def test_grid_values_are_checked_by_the_train_parser(tiny, grid, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main([*tiny, "--study", *grid, "--print_config"])
    out, err = capsys.readouterr()
    if message is None:
        assert exit_.value.code == 0 and len(yaml.safe_load(out)["cells"]) == 2
        return
    assert exit_.value.code == 2 and err.strip() == message and not (Path("runs") / "tiny-lrr").exists()


def test_print_config_shows_the_checked_plan_and_writes_nothing(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main([*tiny, "--study", "seeds=0,1", "ablate=none,attention", "--print_config"])
    plan = yaml.safe_load(capsys.readouterr().out)
    assert exit_.value.code == 0 and plan["study"] == str(tmp_path / "runs" / "tiny-ablate-seed") and plan["baseline"] == "ablate=none"
    assert [c["name"] for c in plan["cells"]] == ["ablate-none_seed-0", "ablate-attention_seed-0", "ablate-none_seed-1",
                                                  "ablate-attention_seed-1"]
    assert "--seed_everything=1 --data.seed=1" in plan["cells"][3]["command"] and "remove: [attention]" in plan["cells"][3]["command"]
    assert not (tmp_path / "runs" / "tiny-ablate-seed").exists()


def test_other_refusals_in_one_line(tiny, tmp_path, capsys):
    cases = [([*tiny, "--study", "seeds=0", "--ckpt_path", "x.ckpt"], "no --ckpt_path (rerun the same study command"),
             ([*tiny, "--trainer.logger=false", "--study", "seeds=0"], "each cell is a run folder of a TensorBoardLogger"),
             ([*tiny, "--study", "seeds=0,1", "--study.name", "s"], None)]
    folder = StudyFolder(tmp_path / "runs" / "s")
    folder.open({"grid": [{"key": "seed", "values": ["0"]}], "base_config": {}, "cells": [], "cwd": "."})
    cases[2] = (cases[2][0], f"vitlab: error: {folder.path} holds a study of another grid (there: seed=0; this command: seed=0,1 [sets seed_everything, data.seed])")
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            train_main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture()
def slurm(tmp_path, monkeypatch):
    """Stand-ins for sbatch (numbers the jobs 4242, 4243 ..., counts its calls), srun and sacct (every array index
    in the state written to ``sacct_state``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "sbatch", f"""
        import pathlib, sys
        count = pathlib.Path({str(tmp_path / 'sbatch_calls')!r})
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
        print(f"Submitted batch job {{4242 + n}}")
        """)
    _stand_in(bin_dir, "srun", "import sys; sys.exit(1)\n")
    _stand_in(bin_dir, "sacct", f"""
        import pathlib, sys
        state = pathlib.Path({str(tmp_path / 'sacct_state')!r}).read_text().strip()
        ids = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "-j"]
        print("JobID|State|NodeList")
        for job in ids:
            for index in range(20):
                print(f"{{job}}_{{index}}|{{state}}|node1")
        """)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    from submitit.slurm.slurm import SlurmJob

    SlurmJob.watcher.clear()
    return tmp_path


@pytest.mark.slow  # (the train parser once per cell, twice)
def test_slurm_job_array_script_and_a_rerun_that_leaves_queued_jobs_alone(tiny, slurm, tmp_path, capsys):
    argv = [*tiny, "--study", "seeds=0,1,2", "ablate=none,mlp", "--study.launcher", "slurm", "--study.partition", "gpu",
            "--study.account", "proj7", "--study.time", "90", "--study.gpus_per_run", "2", "--study.parallel", "2",
            "--study.cpus_per_run", "8", "--study.setup", "module load cuda"]
    train_main(argv)
    folder = tmp_path / "runs" / "tiny-ablate-seed"
    script = (folder / "submitit" / "4242_submission.sh").read_text()
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines() if line.startswith("#SBATCH --"))
    assert directives["partition"] == "gpu" and directives["account"] == "proj7" and directives["time"] == "90"
    assert directives["gpus-per-node"] == "2" and directives["cpus-per-task"] == "8"
    assert directives["array"] == "0-5%2"  # 6 cells, 2 at a time
    assert "module load cuda" in script and "submitit.core._submit" in script
    record = json.loads((folder / "study.json").read_text())
    assert record["jobs"] == {c["name"]: f"4242_{i}" for i, c in enumerate(record["cells"])}
    assert "submitted" in capsys.readouterr().err

    (slurm / "sacct_state").write_text("PENDING")
    train_main(argv)  # queued: nothing is submitted again
    assert (slurm / "sbatch_calls").read_text() == "1"
    assert "queued (SLURM job 4242_0: PENDING)" in capsys.readouterr().err

    from submitit.slurm.slurm import SlurmJob

    SlurmJob.watcher.clear()
    (slurm / "sacct_state").write_text("CANCELLED")
    StudyFolder(folder).write_state("ablate-none_seed-0", {"status": DONE})  # one cell finished before the cancel
    train_main(argv)
    assert (slurm / "sbatch_calls").read_text() == "2"
    resubmitted = (folder / "submitit" / "4243_submission.sh").read_text()
    assert "#SBATCH --array=0-4%2" in resubmitted  # the five cells not done
    jobs = json.loads((folder / "study.json").read_text())["jobs"]
    assert jobs["ablate-none_seed-0"] == "4242_0" and jobs["ablate-mlp_seed-0"] == "4243_0"


def test_a_cell_another_process_runs_is_left_alone(tiny, tmp_path, capsys):
    folder = StudyFolder(tmp_path / "runs" / "tiny-seed")
    with folder.lock("seed-0") as held, folder.lock("seed-1") as held_too:  # as a second command would find them
        assert held is not None and held_too is not None
        with pytest.raises(SystemExit) as exit_:
            train_main([*tiny, "--study", "seeds=0,1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "seed-0: busy: another process is running it" in err
    assert "2 of 2 cells did not finish here (seed-0, seed-1; 2 of them running in another process" in err
    assert not folder.run_path("seed-0").exists() and folder.status("seed-0") == PENDING
