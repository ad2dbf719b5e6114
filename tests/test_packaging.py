"""vitlab as a package: the wheel carries the shipped configs, and, installed outside the repository, its console
scripts run the quickstart and a probe from an empty folder.

The wheel is built from a copy of the files a build reads (``pip wheel --no-deps``, this environment's setuptools,
no index), installed without its dependencies into a fresh virtual environment, and the dependencies are borrowed
from this test environment through a ``.pth`` line. Commands then run from an empty folder with no ``PYTHONPATH``,
so the checkout (importable here through the editable install or ``PYTHONPATH``) cannot be what runs.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from vitlab import cli_support

REPO = Path(__file__).resolve().parent.parent
BUILD_FILES = ["setup.py", "setup.cfg", "pyproject.toml", "README.md"]  # plus the vitlab/ and configs/ folders
SHIPPED = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def _run(argv: list, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} (in {cwd}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``vitlab-*.whl`` built from a copy of the checkout's build files (the checkout gets no build/ or egg-info)."""
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    assert (major, minor) >= (70, 1), (f"setuptools {setuptools.__version__} cannot build a wheel without the `wheel` "
                                       "package: install the dev extra (pip install -e \".[dev]\" -c constraints.txt)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_FILES:
        shutil.copy2(REPO / name, src / name)
    for folder in ("vitlab", "configs"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp / "dist", src], cwd=tmp)
    (found,) = (tmp / "dist").glob("vitlab-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The ``bin`` folder of a fresh virtual environment holding the wheel (its dependencies: this environment's)."""
    env = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", env], cwd=env.parent)
    scripts = env / ("Scripts" if os.name == "nt" else "bin")
    python = scripts / ("python.exe" if os.name == "nt" else "python")
    # installed before the dependencies are visible, so pip never sees (or touches) this environment's vitlab
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         cwd=env.parent)
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=env).stdout.strip()
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # plain path lines: this environment's .pth files (the editable install of vitlab among them) are not run
    (Path(purelib) / "_test_dependencies.pth").write_text("\n".join(ours) + "\n")
    return scripts


@pytest.mark.slow
def test_wheel_ships_every_config_once(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.removeprefix("vitlab/configs/") for n in names if n.startswith("vitlab/configs/")) == SHIPPED
    assert not [n for n in names if n.startswith("configs/")], "the configs belong inside the package"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vitlab-train = vitlab.cli:train_main" in text and "vitlab-probe = vitlab.probe_cli:probe_main" in text


@pytest.mark.slow
def test_installed_wheel_runs_the_quickstart_and_a_probe_from_an_empty_folder(installed, tmp_path):
    work = tmp_path / "empty"
    work.mkdir()
    where, configs, listed = _run([installed / "python", "-c", "import vitlab, vitlab.cli_support as c; print(vitlab.__file__); "
                                   "print(c.PACKAGE_CONFIGS); print(repr(c.configs_help()))"], cwd=work).stdout.splitlines()
    assert Path(where).is_relative_to(installed.parent) and not Path(where).is_relative_to(REPO), where
    assert Path(configs) == Path(where).parent / "configs", configs
    # the configs train.py's --help lists (its full help imports Lightning: a process of its own, so the in-process
    # tests cover the help's text and the console scripts' names)
    assert all(name.removesuffix(".yaml") in listed for name in SHIPPED), listed
    assert _run([installed / "vitlab-probe", "--help"], cwd=work).stdout.startswith("usage: vitlab-probe ")

    # the quickstart for one epoch, on a small variant of its embedded data (generated into $VITLAB_CACHE)
    _run([installed / "vitlab-train", "--config", "quickstart", "--trainer.max_epochs", "1",
          "--data.embedded_kwargs.patients", "8", "--runtime.threads", "2"], cwd=work)
    run = work / "runs" / "quickstart" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    # the design card's probe command on the newest run, with a short inversion
    _run([installed / "vitlab-probe", "--ablate", "attention", "--layers", "0", "--steps", "5", "--accuracy-images", "4"],
         cwd=work)
    assert (work / "runs" / "probe-ablate-quickstart-version_0" / "summary.csv").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["runs"], "the commands write nothing outside runs/"


# ---------------------------------------------------------------------------------------------- the lookup itself


@pytest.mark.parametrize("name", ["quickstart_volume", "quickstart_detection.yaml"])
def test_a_shipped_config_by_name_picks_its_task_from_any_folder(name, tmp_path, monkeypatch, capsys):
    from vitlab.cli import fit

    monkeypatch.chdir(tmp_path)  # no configs/ here
    with pytest.raises(SystemExit) as exc:
        fit(["--config", name, "--print_config"])
    assert exc.value.code == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out)
    shipped = yaml.safe_load((REPO / "configs" / f"{name.removesuffix('.yaml')}.yaml").read_text())
    assert printed["task"] == shipped["task"] and printed["model"]["model_name"] == shipped["model"]["model_name"]


def test_help_names_the_shipped_configs():
    text = cli_support.configs_help()
    assert all(name.removesuffix(".yaml") in text for name in SHIPPED)


def test_program_name_is_the_console_script_or_the_repository_script(monkeypatch):
    for argv0, expected in [("/venv/bin/vitlab-probe", "vitlab-probe"), ("vitlab-train.exe", "vitlab-train"),
                            ("probe.py", "probe.py"), ("/usr/bin/pytest", "probe.py"), ("-c", "probe.py")]:
        monkeypatch.setattr(sys, "argv", [argv0])
        assert cli_support.program_name("probe.py") == expected, argv0
