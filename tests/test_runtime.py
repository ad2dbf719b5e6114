"""vitlab.runtime: threads and loader workers from the config and the cores (never the load), recorded in the
run's config.yaml; the same seed gives the same numbers on a busy machine and with any number of workers."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vitlab.runtime import Runtime, frozen_heap

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "cores, gpu, threads, workers",
    [(1, False, 1, 0), (2, False, 2, 0), (3, False, 1, 2), (4, False, 2, 2), (16, False, 14, 2),
     (1, True, 1, 1), (2, True, 1, 1), (8, True, 2, 5), (16, True, 4, 11), (64, True, 4, 12)],
)
def test_auto_is_decided_by_the_cores_and_the_accelerator(cores, gpu, threads, workers, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    resolved = Runtime().resolved(gpu, cores=cores)
    assert (resolved.threads, resolved.workers, resolved.figures) == (threads, workers, "auto")


def test_auto_threads_never_follow_the_workers(monkeypatch):
    """The thread count changes the numbers, the workers must not: ``threads: auto`` is the same whatever
    ``workers`` says, on every machine size, with or without a GPU."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores in range(1, 65):
        for gpu in (False, True):
            threads = {Runtime(workers=w).resolved(gpu, cores=cores).threads for w in ("auto", 0, 1, 2, 3, 8, 40)}
            assert len(threads) == 1 and 1 <= next(iter(threads)) <= cores, (cores, gpu, threads)


def test_numbers_given_are_kept_and_omp_num_threads_is_the_auto_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Runtime(threads=3, workers=5, figures="off").resolved(False, cores=2) == Runtime(3, 5, "off")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert Runtime().resolved(False, cores=8).threads == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"threads": 0}, "runtime.threads must be 'auto' or an int >= 1, got 0"),
    ({"workers": -1}, "runtime.workers must be 'auto' or an int >= 0, got -1"),
    ({"workers": "many"}, "runtime.workers must be 'auto' or an int >= 0, got 'many'"),
    ({"figures": "background"}, "runtime.figures must be one of auto, inline, off, got 'background'"),
    ({"fill_uninitialized": "yes"}, "runtime.fill_uninitialized must be true or false, got 'yes'"),
])
def test_bad_values_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as error:
        Runtime(**kwargs)
    assert str(error.value) == message


def test_apply_sets_torch_threads():
    """(OpenCV's one thread is the data loaders': tests/data/test_transforms.py.)"""
    before = torch.get_num_threads()
    try:
        Runtime(threads=1).apply()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def deterministic_fill():
    """torch's deterministic-algorithms switches and its NaN fill of fresh tensors, put back after the test."""
    import torch.utils.deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


def _fills(make) -> int:
    """The ``aten::fill_`` operations ``make()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        make()
    return sum(1 for e in prof.events() if e.name == "aten::fill_")


def test_fresh_tensors_are_not_nan_filled_under_deterministic_algorithms_unless_asked(deterministic_fill):
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # (torch's default)
    like = torch.zeros(8)
    assert Runtime().fill_uninitialized is False
    Runtime(threads=torch.get_num_threads()).apply()
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert _fills(lambda: (torch.empty(1000), torch.empty_like(like), like.new_empty(9))) == 0
    Runtime(threads=torch.get_num_threads(), fill_uninitialized=True).apply()
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    assert _fills(lambda: (torch.empty(1000), torch.empty_like(like), like.new_empty(9))) == 3
    assert torch.isnan(torch.empty(1000)).all()  # (what the fill is for: a read of unwritten memory shows)
    assert Runtime(fill_uninitialized=True).resolved(True, cores=16).fill_uninitialized is True


@pytest.fixture
def cuda_matmul_flag():
    """torch's CUDA TF32 switch for matrix products, put back after the test."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_tf32_auto_is_on_for_a_gpu_run_only_and_a_choice_made_is_kept(cuda_matmul_flag, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    assert Runtime().resolved(True, cores=16).tf32 is True
    assert Runtime().resolved(False, cores=16).tf32 == "auto"  # (on the CPU nothing is set)
    assert Runtime(tf32=False).resolved(True, cores=16).tf32 is False and Runtime(tf32=True).resolved(False, cores=2).tf32 is True
    torch.backends.cuda.matmul.allow_tf32 = True  # this process chose a precision already: auto keeps it
    assert Runtime().resolved(True, cores=16).tf32 == "auto"
    torch.backends.cuda.matmul.allow_tf32 = False

    def mixed():
        raise RuntimeError("PyTorch is checking the matmul precision without a specific backend name")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", mixed)  # (torch's answer once its APIs were mixed)
    assert Runtime().resolved(True, cores=16).tf32 == "auto"


def test_apply_switches_cudas_float32_products_and_leaves_the_cpus(cuda_matmul_flag):
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = torch.randn(48, 40, dtype=torch.float32), torch.randn(40, 32, dtype=torch.float32)
    full = a @ b
    cpu_precision = torch.backends.mkldnn.matmul.fp32_precision  # (oneDNN's: what the CPU's float32 products follow)
    Runtime(threads=torch.get_num_threads(), tf32=True).apply()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    # the CPU's products unchanged: its setting left alone (a CPU without TF32 units gives the same products either
    # way, so the setting is what says so on every machine)
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_precision and torch.equal(a @ b, full)
    Runtime(threads=torch.get_num_threads(), tf32=False).apply()
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    torch.backends.cuda.matmul.allow_tf32 = True
    Runtime(threads=torch.get_num_threads()).apply()  # auto, unresolved or resolved on the CPU: left as it is
    assert torch.backends.cuda.matmul.allow_tf32


def test_the_runtime_line_says_how_the_gpu_multiplies(cuda_matmul_flag):
    torch.backends.cuda.matmul.allow_tf32 = False
    line = Runtime().resolved(True, cores=16).describe(16, True)
    assert "the GPU's float32 products in TF32" in line and "runtime.threads / workers / figures / tf32" in line
    assert "full float32" in Runtime(tf32=False).resolved(True, cores=16).describe(16, True)
    assert "float32" not in Runtime().resolved(False, cores=2).describe(2, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_fit_multiplies_in_tf32_without_lightnings_precision_warning(tiny_dataset, tmp_path, cuda_matmul_flag, capfd):
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit

    torch.backends.cuda.matmul.allow_tf32 = False
    extra = ["--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.limit_train_batches", "2"]
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=1, extra=extra))
    assert cli.trainer.global_step == 2 and torch.backends.cuda.matmul.allow_tf32  # (set for the process)
    out, err = capfd.readouterr()
    assert "float32 products in TF32" in err and "set_float32_matmul_precision" not in out + err  # (Lightning's advice)


@pytest.mark.slow
def test_the_entry_points_bound_openmp_spinning_and_importing_vitlab_does_not():
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, vitlab, vitlab.data; a = os.environ.get('GOMP_SPINCOUNT'); import vitlab.cli; print(a, os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["None", "10000"]


@pytest.mark.parametrize("env, expected", [({}, "10000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None), ({"GOMP_SPINCOUNT": "500"}, "500")])
def test_prepare_process_keeps_a_policy_the_user_set(env, expected, monkeypatch):
    from vitlab.runtime import prepare_process

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    prepare_process()
    assert os.environ.get("GOMP_SPINCOUNT") == expected


_FAULTS = """
import resource, sys
from vitlab.runtime import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "kept" else "system")
import torch
for step in range(24):
    if step == 16:  # glibc's heap has grown to hold the freed blocks: count the last 8 allocations' faults
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 << 18)  # 64 MB, freed at once: a step's attention tensor
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensor_memory_is_reused_instead_of_faulted_in_again():
    """Page faults of allocating and freeing a 64 MB tensor: glibc's default maps and unmaps it each time (the
    kernel faults its 16384 pages in again); with :func:`keep_freed_memory` the heap keeps them for the next."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VITLAB_MALLOC"))}
    faults = {}
    for mode in ("kept", "system"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env={**clean, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
        assert out[0] == ("True" if mode == "kept" else "system")
        faults[mode] = int(out[1])
    assert faults["kept"] * 8 < faults["system"], faults


_RESIDENT = """
import os
from vitlab.runtime import keep_freed_memory, prepare_process
prepare_process()  # what probe.py (and train.py) do first
import torch
page = os.sysconf("SC_PAGE_SIZE")
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * page / 2**20

def grown():  # resident MB left by a touched 128 MB tensor once freed
    before = resident()
    block = torch.ones(128 << 18)
    del block
    return resident() - before

probe = grown()
kept = keep_freed_memory()  # what train.py adds for a run on 3-D volumes
print(probe, kept, grown())
"""


@pytest.mark.slow  # (a child process: the allocator is set once per process)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_a_process_prepared_as_probe_py_returns_freed_memory_and_a_3d_training_keeps_it():
    """The resident size after a 128 MB tensor is freed: back where it was in a process prepared as ``probe.py``
    prepares it (glibc unmaps the block), 128 MB higher once freed memory is kept for reuse."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VITLAB_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", _RESIDENT], env={**clean, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout.split()
    probe, kept, grown = float(out[0]), out[1] == "True", float(out[2])
    assert kept and probe < 16 and grown > 120, out


def test_train_py_keeps_freed_memory_for_3d_volumes_only(monkeypatch):
    import vitlab.runtime as runtime

    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    assert [runtime.prepare_training(sample) for sample in ("volume", "image", "slice", "slab", None)] == [True] + [False] * 4
    assert calls == [1]


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"VITLAB_MALLOC": "system"}])
def test_keep_freed_memory_leaves_glibc_as_the_user_set_it(env, monkeypatch):
    from vitlab.runtime import keep_freed_memory

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert keep_freed_memory() is False


def test_frozen_heap_freezes_survivors_for_the_fit_only():
    gc.unfreeze()
    with frozen_heap():
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


def _fit_outputs(args: list[str]):
    """Every Q/K/V snapshot and every scalar of a fit: what must not change."""
    from tests.helpers.runs import events
    from vitlab.qkv.state import load_snapshot
    from vitlab.cli import fit

    threads = torch.get_num_threads()
    try:
        cli = fit(args)
    finally:
        torch.set_num_threads(threads)
    run = Path(cli.trainer.log_dir)
    snapshots = {path.name: load_snapshot(path)[0] for path in sorted((run / "qkv").glob("epoch_*.safetensors"))}
    acc = events(run)
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return run, snapshots, scalars


def _same_snapshots(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(x.keys() == b[n].keys() and all(torch.equal(x[k], b[n][k]) for k in x) for n, x in a.items())


@pytest.mark.slow
def test_same_seed_same_numbers_beside_a_busy_process_and_from_the_saved_config(tiny_dataset, tmp_path, capfd):
    """Two fits with the same config and seed, one while another process keeps a core busy, give bit-identical
    snapshots and metrics; the run's config.yaml holds the resolved runtime, and passing it back repeats the run
    bit for bit."""
    from tests.helpers.runs import tiny_args

    base = ["--runtime.threads", "2", "--trainer.max_epochs", "2"]
    quiet_run, quiet, quiet_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "quiet", extra=base))
    saved = yaml.safe_load((quiet_run / "config.yaml").read_text())
    assert saved["runtime"] == {"threads": 2, "workers": 0, "figures": "auto", "tf32": "auto",  # (no GPU: left as it is)
                                "fill_uninitialized": False}
    assert "vitlab: runtime: 2 torch thread(s), 0 loader worker(s)" in capfd.readouterr().err

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _, busy, busy_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "busy", extra=base))
    finally:
        spinner.kill()
    assert "other processes" not in capfd.readouterr().err
    assert _same_snapshots(busy, quiet) and busy_scalars == quiet_scalars

    again_dir = tmp_path / "again"
    config = quiet_run / "config.yaml"
    again = yaml.safe_load(config.read_text())
    again["trainer"]["logger"]["init_args"]["save_dir"] = str(again_dir)
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(again))
    _, repeated, repeated_scalars = _fit_outputs(["--config", str(tmp_path / "again.yaml")])
    assert _same_snapshots(repeated, quiet) and repeated_scalars == quiet_scalars


@pytest.mark.slow
def test_loader_workers_never_change_the_numbers(tiny_dataset, tmp_path, capfd, monkeypatch):
    """The same tiny fit (drop path on: torch's global stream matters) with 0, 1 and 2 loader workers and
    ``threads: auto`` gives bit-identical snapshots (every epoch) and metrics (every scalar, every step): the
    thread count does not follow the workers, and the loaders draw their worker seeds from a generator of their
    own, not the stream drop path draws from."""
    import json

    from tests.helpers.runs import TINY_SWIN, tiny_args

    from vitlab.data.sampling import EpochLoader

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    started, start_epoch = [], EpochLoader.start_epoch  # the workers' early start on epoch 1 (none with 0 workers)

    def counted(self, epoch):
        started.append((self.num_workers, epoch, start_epoch(self, epoch)))
        return started[-1][-1]

    monkeypatch.setattr(EpochLoader, "start_epoch", counted)
    kwargs = json.dumps({**TINY_SWIN["model_kwargs"], "drop_path_rate": 0.2})
    outputs = []
    for workers in (0, 1, 2):
        extra = ["--model.model_kwargs", kwargs, "--runtime.workers", str(workers), "--trainer.max_epochs", "2"]
        outputs.append(_fit_outputs(tiny_args(tiny_dataset, tmp_path / f"workers{workers}", extra=extra))[1:])
        assert f"{workers} loader worker(s)" in capfd.readouterr().err
    # after epoch 0's last batch only (epoch 1 is the last), started with persistent workers only
    assert started == [(0, 1, False), (1, 1, True), (2, 1, True)]
    (snapshots, scalars), *others = outputs
    assert len(snapshots) == 3 and len(scalars) > 10
    for other_snapshots, other_scalars in others:
        assert _same_snapshots(other_snapshots, snapshots) and other_scalars == scalars


@pytest.mark.slow
def test_batches_normalised_on_the_device_never_change_the_numbers(tiny_dataset, tmp_path, monkeypatch):
    """The tiny fit of a three-channel model on gray slices (``augment: default``) with its batches normalised by the
    loaders and, as beside a GPU, after the transfer (one loader worker, so the one-channel batches cross processes):
    bit-identical snapshots and metrics."""
    from tests.helpers.runs import tiny_args

    from vitlab.callbacks.runtime import RuntimeCallback
    from vitlab.data import image_data

    init, normalised = RuntimeCallback.__init__, []

    def on_device(self, figures="auto", workers=0, checkpoints="auto", normalize="auto"):
        init(self, figures, workers, checkpoints, "device")

    def counted(self, batch):
        out = normalize_batch(self, batch)
        normalised.append((batch[0].shape[1], out[0].shape[1]))
        return out

    normalize_batch = image_data.ImageData.normalize_batch
    extra = ["--data.in_chans", "3", "--data.augment", "default", "--trainer.max_epochs", "2"]
    _, snapshots, scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "loader", extra=extra))
    monkeypatch.setattr(RuntimeCallback, "__init__", on_device)
    monkeypatch.setattr(image_data.ImageData, "normalize_batch", counted)
    _, device_snapshots, device_scalars = _fit_outputs(tiny_args(tiny_dataset, tmp_path / "device", extra=[*extra, "--runtime.workers", "1"]))
    assert normalised and set(normalised) == {(1, 3)}  # every batch, training and validation, sent with one channel
    assert len(snapshots) == 3 and len(scalars) > 10
    assert _same_snapshots(device_snapshots, snapshots) and device_scalars == scalars


@pytest.mark.slow
def test_fresh_tensors_left_unfilled_never_change_a_deterministic_volume_fit(tmp_path, monkeypatch, deterministic_fill):
    """The 3-D quickstart's recipe (a SwinUNETR under ``trainer.deterministic: warn``, bf16 on the CPU), two epochs
    on a few embedded volumes, with fresh tensors NaN-filled (torch's default under deterministic algorithms) and
    not (the default): bit-identical snapshots and metrics, so no operation of its training or validation reads
    memory it did not write; and the fill did run in the first fit (many ``fill_`` a step: what leaving it out
    saves)."""
    import torch.utils.deterministic

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    flags, fills = [], []
    step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):  # (a step's fills: the ones its forward and backward made)
        flags.append((torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    outputs = []
    for fill in (True, False):
        args = ["--config", "quickstart_volume", "--data.embedded_kwargs", '{"patients": 4, "slices": 3, "size": 64}',
                "--runtime.workers", "0", "--runtime.fill_uninitialized", str(fill).lower(), "--data.batch_size", "2",
                "--data.val_fraction", "0.5", "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "1",
                "--trainer.precision", "bf16-mixed", "--trainer.enable_progress_bar", "false",
                "--trainer.logger.init_args.save_dir", str(tmp_path / f"fill_{fill}")]
        outputs.append(_fit_outputs(args)[1:])
    assert {f for f in flags[:2]} == {(True, True)} and {f for f in flags[-2:]} == {(True, False)}
    (filled, filled_scalars), (unfilled, unfilled_scalars) = outputs
    assert len(filled) == 3 and len(filled_scalars) >= 4
    assert _same_snapshots(unfilled, filled) and unfilled_scalars == filled_scalars


def _printed_workers(args: list[str], capsys) -> int:
    """``runtime.workers`` of the config ``train.py ARGS --print_config`` prints."""
    from vitlab.cli import train_main

    with pytest.raises(SystemExit) as done:
        train_main([*args, "--print_config"])
    assert done.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)["runtime"]["workers"]


def test_an_old_config_key_is_read_as_the_new_one_with_one_warning(tmp_path, capsys):
    """``data.num_workers`` (before the ``runtime:`` section) in a config file, a flag or a config dict is read as
    ``runtime.workers``, with one warning naming the new key; given twice with one value, accepted; the command
    line still overrides a file (later wins)."""
    from vitlab.cli_support import move_old_keys

    workers = random.randrange(9)
    old = tmp_path / "old.yaml"
    old.write_text(f"data:\n  num_workers: {workers}\n  batch_size: 4\n")
    for args, where in ((["--config", str(old)], f"{old}: data.num_workers"), ([f"--data.num_workers={workers}"], "--data.num_workers")):
        with pytest.warns(FutureWarning) as warned:
            assert _printed_workers(args, capsys) == workers
        messages = [str(w.message) for w in warned if w.category is FutureWarning]
        assert messages == [f"{where} is read as {'--' if where.startswith('--') else ''}runtime.workers, where it moved; "
                            "older configs keep working for now, but rename it"]
    both = tmp_path / "both.yaml"
    both.write_text(f"data:\n  num_workers: {workers}\nruntime:\n  workers: {workers}\n")
    with pytest.warns(FutureWarning, match=f"{both}: data.num_workers is read as runtime.workers"):
        assert _printed_workers(["--config", str(both)], capsys) == workers
    with pytest.warns(FutureWarning):
        assert _printed_workers(["--config", str(old), "--runtime.workers", str(workers + 1)], capsys) == workers + 1
    with pytest.warns(FutureWarning, match="the config: data.num_workers"):
        moved = move_old_keys({"data": {"num_workers": workers, "root": "x"}, "trainer": {"max_epochs": 1}})
    assert moved == {"data": {"root": "x"}, "runtime": {"workers": workers}, "trainer": {"max_epochs": 1}}
    with pytest.warns(FutureWarning):  # an empty runtime: section
        assert move_old_keys({"data": {"num_workers": workers}, "runtime": None}) == {"data": {}, "runtime": {"workers": workers}}


def test_an_old_config_key_that_disagrees_with_the_new_one_is_refused_in_one_line(tmp_path, capsys):
    from vitlab.cli import train_main

    config = tmp_path / "both.yaml"
    config.write_text("data:\n  num_workers: 2\nruntime:\n  workers: 1\n")
    with pytest.raises(SystemExit):
        train_main(["--config", str(config)])
    assert capsys.readouterr().err == (f"vitlab: error: {config}: data.num_workers: 2 and runtime.workers: 1 disagree: keep "
                                       "runtime.workers only (data.num_workers is its name in older configs)\n")
    with pytest.raises(SystemExit):
        train_main(["--data.num_workers", "2", "--runtime.workers=auto"])
    assert capsys.readouterr().err == ("vitlab: error: --data.num_workers 2 and --runtime.workers auto disagree: give "
                                       "--runtime.workers only (--data.num_workers is its name in older configs)\n")


@pytest.mark.slow
def test_an_old_config_trains_with_one_warning_line(tiny_dataset, tmp_path):
    """``python train.py --config old.yaml`` with ``data.num_workers``: trains, one warning line naming the new key;
    the run's config.yaml holds the new key only."""
    from tests.helpers.runs import tiny_args

    config = Path(tiny_args(tiny_dataset, tmp_path, epochs=1)[1])
    cfg = yaml.safe_load(config.read_text())
    del cfg["runtime"]
    cfg["data"]["num_workers"] = 1
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "train.py", "--config", str(config)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    warned = [line for line in run.stderr.splitlines() if "num_workers" in line or line.startswith("vitlab: warning")]
    assert warned == [f"vitlab: warning: {config}: data.num_workers is read as runtime.workers, where it moved; older "
                      "configs keep working for now, but rename it"], run.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "tiny" / "version_0" / "config.yaml").read_text())
    assert saved["runtime"]["workers"] == 1 and "num_workers" not in saved["data"]


@pytest.mark.parametrize("loads", [False, True])
def test_lightnings_nvml_check_is_dropped_only_where_nvml_cannot_load(loads, monkeypatch):
    """Without NVIDIA's driver torch's NVML-based check searches for the library at every call and falls back to
    the CUDA runtime's count: dropping it keeps the answer. Where NVML loads, the variable stays."""
    import ctypes

    import vitlab.runtime as runtime

    real = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if name == "libnvidia-ml.so.1":
            if not loads:
                raise OSError(f"{name}: cannot open shared object file")
            return object()
        return real(name, *args, **kwargs)

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    available = torch.cuda.is_available()
    assert runtime.nvml_cuda_check() is (not loads)
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == (None if not loads else "1")
    monkeypatch.setattr(ctypes, "CDLL", real)
    assert torch.cuda.is_available() == available
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert runtime.nvml_cuda_check() is False and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
