"""Wheels of vitlab's dependencies that a GPU machine's Python lacks, fetched here to be carried there.

    python benchmarks/gpu_wheels.py [--dest .whl] [--python 3.12] [--have NAME ...] [--with-codecs]

A lent GPU machine often cannot reach a package index, and its Python holds torch, timm, Lightning, torchmetrics
and much else, but not vitlab's data and imaging libraries (``bench_gpu.py`` names the missing ones in one line).
This resolves, from ``setup.cfg``'s ``install_requires`` (and py-spy, for ``bench_gpu_ladder.py --py-spy``), every
package the machine does not have (but the compressed-DICOM decoders, ``--with-codecs``: the benchmarks' synthetic
DICOMs are uncompressed), following each wheel's own requirements (markers evaluated for CPython
``--python`` on x86-64 Linux), and downloads one binary wheel of each into ``--dest``, with ``pip download
--no-deps`` (a package published as source only is built here, if it is pure Python): nothing the machine already
has (torch above all) is fetched. :data:`ON_THE_MACHINE` is the package
list of the GPU image this project is lent (``--have`` adds names). It prints what it fetched and the total size.

There: ``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site``
before the project's own path.
"""

from __future__ import annotations

import argparse
import configparser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# the GPU image's Python packages (read off a lent machine, 2026-11-17)
ON_THE_MACHINE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit
cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
# compressed-DICOM decoders (31 MiB of wheels): the benchmarks' synthetic DICOMs are uncompressed (``--with-codecs``)
CODECS = ["imagecodecs", "pyjpegls", "pylibjpeg", "pylibjpeg-openjpeg"]
PLATFORMS = ["manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def requirements_of_project() -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    return [Requirement(line) for line in lines] + [Requirement("py-spy")]


def download(requirement: Requirement, dest: Path, python: str) -> Path:
    """One binary wheel of ``requirement`` (no dependencies) into ``dest``; its path."""
    before = set(dest.glob("*.whl"))
    spec = f"{requirement.name}{requirement.specifier}"
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(dest), spec]
    done = subprocess.run(command, capture_output=True, text=True)
    built = None
    if done.returncode:  # a source distribution only: built here, carried if it is pure Python
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), spec],
                               capture_output=True, text=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(requirement.name)
    # (a wheel fetched or built before is not new: a second run into the same folder finds it by name)
    wheel = new.pop() if new else next((p for p in dest.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name), None)
    if built is not None and (built.returncode or wheel is None or not wheel.name.endswith("-none-any.whl")):
        raise SystemExit(f"gpu_wheels: no wheel of {spec} for CPython {python} on x86-64 Linux, and no pure-Python "
                         f"one built from its source: {(done.stderr + built.stderr).strip()[-400:]}")
    if wheel is None:
        raise SystemExit(f"gpu_wheels: pip downloaded no wheel of {spec}: {done.stderr.strip()[-400:]}")
    return wheel


def wheel_requirements(wheel: Path, extras: set[str], environment: dict) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    out = []
    for line in re.findall(r"^Requires-Dist: (.+)$", text, flags=re.M):
        requirement = Requirement(line)
        if requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": e}) for e in extras | {""}):
            out.append(requirement)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl, git-ignored)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    parser.add_argument("--have", nargs="*", default=[], help="more packages the machine already has")
    parser.add_argument("--with-codecs", action="store_true", help="also the compressed-DICOM decoders (imagecodecs, ...)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    have = {canonicalize_name(n) for n in [*ON_THE_MACHINE, *args.have, *([] if args.with_codecs else CODECS)]}
    environment = {**default_environment(), "python_version": args.python, "python_full_version": f"{args.python}.0",
                   "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
    queue, seen, fetched = requirements_of_project(), set(), []
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in have or name in seen:
            continue
        seen.add(name)
        wheel = download(requirement, args.dest, args.python)
        fetched.append(wheel)
        queue += wheel_requirements(wheel, set(requirement.extras), environment)
    total = sum(w.stat().st_size for w in fetched)
    for wheel in sorted(fetched):
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    print(f"gpu_wheels: {len(fetched)} wheels, {total / 2**20:.1f} MiB in {args.dest} (a device call carries at most 64 MiB)")


if __name__ == "__main__":
    main()
