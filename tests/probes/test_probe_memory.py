"""The streamed probes' memory, measured in processes set up as ``probe.py`` sets itself up.

A probe's peak resident size depends on the allocator as much as on the probe: glibc thresholds that keep freed
blocks for reuse (good for a 3-D training step) cost ``probe.py mi`` on ViT-B/16 1.4 GB at N = 600. So the probe
runs here as a user runs it, ``python probe.py mi`` in a fresh process (its own set-up, nothing of the test's),
and its peak is compared with the same command under glibc's defaults (``VITLAB_MALLOC=system``). The full-size
figures (ViT-B/16, N = 600 and 2000) are ``benchmarks/bench_probe_memory.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def smooth_images(folder: Path, count: int, size: int = 224) -> Path:
    """``count`` smooth random greyscale PNGs (low-resolution noise, bicubic upsampled)."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = (rng.random((14, 14)) * 255).astype(np.uint8)
        Image.fromarray(small).resize((size, size), Image.BICUBIC).save(folder / f"img{i:04d}.png")
    return folder


def peak_resident_mb(args: list[str], env_extra: dict[str, str]) -> float:
    """Peak RSS (MB) of ``python probe.py ARGS`` in a fresh process, the allocator variables of this one cleared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VITLAB_MALLOC"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2", TQDM_DISABLE="1", **env_extra)
    proc = subprocess.Popen([sys.executable, "probe.py", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, stderr[-3000:]
    return usage.ru_maxrss / 1024


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator, wait4's peak RSS")
def test_probe_py_mi_peaks_no_higher_than_under_glibcs_defaults(tmp_path):
    """``probe.py mi`` on ViT-Ti/16 at 224 px (attention and MLP tensors of 30-40 MB a batch, as ViT-B/16's are
    larger still), N = 128: its peak RSS as ``probe.py`` runs it is within 5 % of glibc's defaults. (With the
    training allocator, blocks up to 256 MB from the heap and 512 MB of freed heap kept, it peaked 19 % higher:
    1693 against 1428 MB.)

    The same command's peak is not one number: on 2 cores about one run in five peaked 110-220 MB above the
    others (1176-1206 MB against 1300-1402 MB, in either configuration, with a fixed hash seed too), more than the
    5 % asked, and an outlier of glibc's defaults let the training allocator (1377-1405 MB in every run) pass.
    So each side is its lowest peak: glibc's defaults over two runs, the probe over up to three (another only
    while the bound is not met)."""
    images = smooth_images(tmp_path / "images", 128)
    args = ["mi", "--model", "vit_tiny_patch16_224", "--images", str(images), "--num-images", "128", "--overwrite"]
    system = min(peak_resident_mb([*args, "--out", str(tmp_path / "system")], {"VITLAB_MALLOC": "system"}) for _ in range(2))
    peaks = []
    while len(peaks) < 3 and (not peaks or min(peaks) > 1.05 * system + 20):
        peaks.append(peak_resident_mb([*args, "--out", str(tmp_path / "probe")], {}))
    assert min(peaks) <= 1.05 * system + 20, (peaks, system)
