"""A study's command line and grid: the --study tokens, study files and options, the cells they make, and the
one-line refusals of bad input (before anything runs)."""

from __future__ import annotations

import pytest
import yaml

from vitlab.study.grid import ABLATE_COMPONENTS, Axis, StudyOptions, make_cells, parse_command, requested, split_values

SEEDS = ("seed_everything", "data.seed")
BASE = {"seed_everything": 0, "data": {"seed": 0}, "model": {"ablate": {"remove": ["mlp"], "blocks": [0, 1]}}}


def test_requested_and_split_values():
    assert requested(["--config", "x.yaml", "--study", "seeds=0,1"]) and requested(["--study.parallel", "2"])
    assert requested(["--study=seeds=0,1"]) and not requested(["--config", "study.yaml", "--studyx"])
    assert split_values("0,1, 2") == ["0", "1", "2"]
    assert split_values("[2,2],[4, 4],{a: 1, b: 2}") == ["[2,2]", "[4, 4]", "{a: 1, b: 2}"]


def test_parse_command_splits_run_args_grid_and_options():
    cmd = parse_command(["--config", "q.yaml", "--study", "seeds=0,1,2", "ablate=none,attention+mlp", "--trainer.max_epochs", "3",
                         "--study.parallel", "2", "--study.name=ab", "--study.setup", "module load cuda", "--print_config"])
    assert cmd.run_args == ["--config", "q.yaml", "--trainer.max_epochs", "3"] and cmd.print_config
    assert [(a.key, a.values) for a in cmd.axes] == [("ablate", ("none", "attention+mlp")), ("seed", ("0", "1", "2"))]
    assert cmd.options == StudyOptions(name="ab", parallel=2, setup=["module load cuda"])
    assert cmd.axes[1].sets == ("seed_everything", "data.seed")
    fixed_split = parse_command(["--study", "seeds=0,1", "data.seed=3", "--study.seed_keys", "seed_everything"])
    assert fixed_split.axes == [Axis("data.seed", ("3",)), Axis("seed", ("0", "1"), ("seed_everything",))]
    assert make_cells(fixed_split.axes, BASE)[1].overrides == ("--data.seed=3", "--seed_everything=1")
    other = parse_command(["--study=model.lr=0.001,0.002", "--study.time=90", "--study.mem_gb", "7.5", "--study.account", "123"])
    assert other.axes == [Axis("model.lr", ("0.001", "0.002"))] and other.options.time == 90 and other.options.mem_gb == 7.5
    assert other.options.account == "123"  # a name, even when it looks like a number


def test_study_file_with_command_line_overrides(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"grid": {"ablate": ["none", "residual"], "seeds": [0, 1], "model.lr": [1e-3, 0.01],
                                             "model.model_kwargs.depths": [[2, 2], [1, 1]]},
                                    "name": "abl", "parallel": 2, "partition": "gpu", "time": 120}))
    cmd = parse_command(["--config", "q.yaml", "--study", str(path), "seeds=5", "--study.parallel", "1"])
    keys = {a.key: a.values for a in cmd.axes}
    assert keys["seed"] == ("5",) and keys["ablate"] == ("none", "residual") and keys["model.lr"] == ("0.001", "0.01")
    assert keys["model.model_kwargs.depths"] == ("[2, 2]", "[1, 1]") and cmd.axes[-1].key == "seed"
    assert cmd.options == StudyOptions(name="abl", parallel=1, partition="gpu", time=120)


def test_cells_vary_the_seed_slowest_and_set_the_config_keys():
    axes = [Axis("ablate", ("none", "attention+mlp")), Axis("model.lr", ("0.1", "1e-3")), Axis("seed", ("0", "7"), SEEDS)]
    cells = make_cells(axes, BASE)
    assert len(cells) == 8 and [c.seed for c in cells] == ["0"] * 4 + ["7"] * 4
    first = cells[0]
    assert first.name == "ablate-none_lr-0.1_seed-0" and first.variant == "ablate=none, model.lr=0.1"
    assert first.overrides == ("--model.ablate=null", "--model.lr=0.1", "--seed_everything=0", "--data.seed=0")
    ablated = next(c for c in cells if c.values["ablate"] == "attention+mlp")
    spec = yaml.safe_load(ablated.overrides[0].split("=", 1)[1])
    assert spec == {"remove": ["attention", "mlp"], "blocks": [0, 1]}  # the base config's blocks are kept
    no_data_seed = make_cells([Axis("seed", ("3",), SEEDS)], {"seed_everything": 0, "data": {}})
    assert no_data_seed[0].overrides == ("--seed_everything=3",) and no_data_seed[0].variant == "-"


def test_ablate_components_are_those_of_the_model_families():
    from vitlab.models import ablation_components, build_model

    swin = build_model("swin_tiny_patch4_window7_224", 2, in_chans=1, img_size=32, patch_size=4, embed_dim=16, depths=(1,),
                       num_heads=(1,), window_size=4)
    mixer = build_model("mixer_s16_224", 2, in_chans=1, img_size=32, patch_size=16, embed_dim=16, num_blocks=1)
    assert set(ABLATE_COMPONENTS) == set(ablation_components(swin)) | set(ablation_components(mixer))


@pytest.mark.parametrize("argv, message", [
    (["--study"], "--study: give the grid, e.g. --study seeds=0,1,2"),
    (["--study", "seeds="], "--study seeds=: no values for seeds"),
    (["--study", "=1,2"], "a grid item is KEY=V1,V2"),
    (["--study", "seeds=0,x"], "--study seeds=0,x: 'x' is not an integer seed"),
    (["--study", "seeds=0,0"], "--study seeds=...: 0 is listed twice"),
    (["--study", "ablate=none,attenton"], "--study ablate=attenton: unknown component 'attenton'; valid: none, residual"),
    (["--study", "seeds=0", "seed=1"], "--study: seed given twice"),
    (["--study", "seed_everything=0,1"], "--study seed_everything=...: a seed sets seed_everything (--study.seed_keys: seed_everything, data.seed); give seeds=... instead"),
    (["--study", "seeds=0", "--study.seed_keys", "[]"], "--study.seed_keys must be a non-empty list of config keys"),
    (["--study", "trainer.logger.init_args.name=a,b"], "the study sets trainer.logger.init_args.name for each cell itself"),
    (["--study", "ckpt_path=a"], "the study sets ckpt_path"),
    (["--study", "nosuchfile.yaml"], "--study nosuchfile.yaml: no such study file"),
    (["--study", "seeds=0", "--study.paralel", "2"], "--study.paralel: unknown study option (did you mean parallel?)"),
    (["--study", "seeds=0", "--study.parallel", "0"], "--study.parallel must be an integer >= 1, got 0"),
    (["--study", "seeds=0", "--study.launcher", "pbs"], "--study.launcher must be one of local, submitit_local, slurm, got 'pbs'"),
    (["--study", "seeds=0", "--study.name", "a/b"], "--study.name 'a/b' must be a folder name"),
    (["--study", "seeds=0", "--study.time"], "--study.time: give a value"),
])
def test_refusals_name_the_item_in_one_line(argv, message):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        parse_command(["--config", "q.yaml", *argv])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_study_file_refusals(tmp_path):
    bad = tmp_path / "bad.yaml"
    for content, message in [({"grid": {"seeds": []}}, "grid.seeds is an empty list"),
                             ({"grid": {"seeds": [0]}, "paralel": 2}, "unknown key paralel (did you mean parallel?)"),
                             ({"seeds": [0]}, "a study file is a mapping with a grid: section")]:
        bad.write_text(yaml.safe_dump(content))
        with pytest.raises(ValueError) as err:
            parse_command(["--study", str(bad)])
        assert message in str(err.value) and str(bad) in str(err.value)
    bad.write_text("grid: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_command(["--study", str(bad)])


def test_cells_sharing_a_folder_are_refused():
    with pytest.raises(ValueError, match="would share the folder"):
        make_cells([Axis("data.root", ("a/b", "a_b"))], BASE)
