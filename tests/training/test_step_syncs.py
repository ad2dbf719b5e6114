"""A training or validation step of vitlab's own code never waits for the device.

On a GPU, reading a value off the device (``.item()``, ``float(t)``, ``bool(t)``, ``.cpu()``, ``.tolist()``), or an
operation whose output size depends on the data (``torch.unique``, ``bincount``, ``nonzero``), stops the host until
every queued kernel has run: the next step is launched late and the GPU idles. On the CPU these calls are cheap,
so the test counts them instead: it records each one made during the steps whose call stack passes through the
``vitlab`` package. Where CUDA exists, the same steps also run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

import vitlab
from vitlab.cli import fit

VITLAB_DIR = str(Path(vitlab.__file__).resolve().parent)
TENSOR_METHODS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy", "nonzero")
TORCH_FUNCTIONS = ("unique", "bincount", "nonzero")


class SyncCounter(pl.Callback):
    """Records host-device synchronisation points made from vitlab code that Lightning calls inside every training and
    validation step (from the first callback's ``on_*_batch_start`` to its ``on_*_batch_end``: put it first in the
    callbacks).

    Args:
        cuda_error: Also run the steps under ``torch.cuda.set_sync_debug_mode("error")`` (CUDA runs).
    """

    def __init__(self, cuda_error: bool = False) -> None:
        self.cuda_error = cuda_error
        self.calls: list[str] = []
        self.steps = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        calls = self.calls

        def counted(*args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            # vitlab code that Lightning called (a step, a hook), not the ``fit`` call that started Lightning
            lightning = next((i for i, f in enumerate(stack) if f"{os.sep}pytorch_lightning{os.sep}" in f.filename), len(stack))
            ours = [f for f in stack[lightning:] if f.filename.startswith(VITLAB_DIR)]
            if ours:
                calls.append(f"{name} from {Path(ours[-1].filename).name}:{ours[-1].lineno} ({ours[-1].name})")
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def _start(self) -> None:
        self.steps += 1
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in TORCH_FUNCTIONS:
            self._wrap(torch, name)
        if self.cuda_error:
            torch.cuda.set_sync_debug_mode("error")

    def _stop(self) -> None:
        if self.cuda_error:
            torch.cuda.set_sync_debug_mode("default")
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stop()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._stop()

    def on_exception(self, trainer, pl_module, exception):
        self._stop()


def _first(args: list[str], counter: str, **init_args) -> list[str]:
    """The config's callbacks with the counter first."""
    import yaml

    path = Path(args[1])
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["callbacks"] = [{"class_path": counter, "init_args": init_args}, *cfg["trainer"]["callbacks"]]
    path.write_text(yaml.safe_dump(cfg))
    return args


def _counter(cli) -> SyncCounter:
    return next(cb for cb in cli.trainer.callbacks if isinstance(cb, SyncCounter))


COUNTER = f"{__name__}.SyncCounter"


def _nvml_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_classification_steps_make_no_synchronisation_of_their_own(tiny_dataset, tmp_path, monkeypatch):
    from tests.helpers.runs import tiny_args

    full_logs = []  # Lightning's full self.log (0.2-0.6 ms of host time a call): the steps log through BatchLog
    original_log = pl.LightningModule.log

    def log(module, name, *args, **kwargs):
        full_logs.append((module._current_fx_name, name))
        return original_log(module, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", log)
    # torch's NVML-based CUDA check, as Lightning sets it: on a machine without NVIDIA's driver the fit drops it, so
    # the optimiser's check at every step does not search for the NVML library again (about 0.27 ms a step)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    nvml_searches, steps_seen = [], []
    original_nvml = torch.cuda._raw_device_count_nvml
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml",
                        lambda: nvml_searches.append(len(steps_seen)) or original_nvml())
    limits = ["--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "--runtime.figures", "off"]
    args = _first(tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=limits), COUNTER)  # (figures: drawn off the steps)
    original_start = SyncCounter._start
    monkeypatch.setattr(SyncCounter, "_start", lambda self: steps_seen.append(1) or original_start(self))
    cli = fit(args)
    counter = _counter(cli)
    if not _nvml_loads():
        assert [n for n in nvml_searches if n > 0] == []  # none once the steps began
    assert counter.steps >= 4  # the 3 training steps and the validation steps were watched
    assert counter.calls == []
    # the step loss went through Lightning's full call once in 3 training batches, and once a validation run (the
    # sanity check's and the epoch's) in 2 batches each
    assert full_logs.count(("training_step", "train/loss")) == 1, full_logs
    assert full_logs.count(("validation_step", "val/loss")) <= 2, full_logs
    # the metrics still saw every sample once (they get them at the epoch's end)
    assert "val/auroc" in cli.trainer.callback_metrics


@pytest.mark.slow
def test_segmentation_training_and_validation_steps_make_no_synchronisation_of_their_own(tmp_path, monkeypatch):
    """2-D segmentation: the loss, the Dice and IoU kept on the device for the epoch, the first batch's figure kept there
    until it is drawn."""
    from tests.helpers.runs import dense_args

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    args = _first(dense_args("segmentation", tmp_path / "runs", epochs=1), COUNTER)
    counter = _counter(fit(args))
    assert counter.steps >= 2
    assert counter.calls == []


def _volume_args(tmp_path: Path, monkeypatch, extra: tuple[str, ...] = ()) -> list[str]:
    """A tiny SwinUNETR trained on random 32^3 patches and validated on whole volumes by sliding windows."""
    from tests.helpers.volumes import volume_fit_args
    from vitlab.data.synthetic import generate_volumes

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    manifest = generate_volumes(tmp_path / "v", patients=4, size=32, slices=8, seed=2, difficulty=0.0)
    return volume_fit_args(manifest, tmp_path / "runs", epochs=1, extra=[
        "--data.volume_size", "null", "--data.patch_size", "[32, 32, 32]", "--data.patch_foreground", "0.5", *extra])


@pytest.mark.slow
def test_swin_unetr_volume_steps_make_no_synchronisation_of_their_own(tmp_path, monkeypatch):
    """3-D segmentation: SwinUNETR's soft Dice and weighted cross-entropy, sliding-window validation with its blending
    weights made once, the Dice and IoU kept on the device for the epoch."""
    counter = _counter(fit(_first(_volume_args(tmp_path, monkeypatch), COUNTER)))
    assert counter.steps >= 3  # (two training batches, validation volumes)
    assert counter.calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swin_unetr_volume_steps_on_cuda_run_under_sync_debug_error(tmp_path, monkeypatch):
    args = _volume_args(tmp_path, monkeypatch, ("--trainer.accelerator", "gpu"))
    assert _counter(fit(_first(args, COUNTER, cuda_error=True))).steps >= 3


@pytest.mark.slow
def test_the_counter_sees_a_synchronisation_made_in_vitlab(tiny_dataset, tmp_path, monkeypatch):
    """The counter is live: a planted ``.item()`` in the classification step is reported, with its place."""
    from tests.helpers.runs import tiny_args

    def planted(self, *tensors):
        float(tensors[0].sum())  # what a careless step would do
        self._parts.append(tensors)

    monkeypatch.setattr("vitlab.training.outputs.EpochOutputs.append", planted)
    cli = fit(_first(tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=["--trainer.limit_val_batches", "0"]), COUNTER))
    calls = _counter(cli).calls
    assert calls and all(call.startswith("__float__ from classification.py") for call in calls), calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_classification_steps_on_cuda_run_under_sync_debug_error(tiny_dataset, tmp_path):
    from tests.helpers.runs import tiny_args

    args = tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=["--trainer.accelerator", "gpu"])
    cli = fit(_first(args, COUNTER, cuda_error=True))
    assert _counter(cli).steps >= 4


class ReadsBetweenSteps(pl.Callback):
    """Counts the values read off the device (``Tensor.item`` / ``__float__`` / ``tolist``) by Lightning's loop, its
    logger, the progress bar and vitlab during each training batch (from its ``on_train_batch_start`` to the next
    one's: the later callbacks' batch-end hooks included); AdamW's reads of its own step counters, which stay on the
    host, are left out."""

    def __init__(self) -> None:
        self.reads: dict[int, list[str]] = {}
        self.batch: int | None = None
        self._saved: list[tuple[str, object]] = []

    def on_train_start(self, trainer, pl_module):
        reads, owner = self.reads, self
        for name in ("item", "__float__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                if owner.batch is not None:
                    stack = traceback.extract_stack()[:-1]
                    if not any(f"{os.sep}torch{os.sep}optim{os.sep}" in f.filename for f in stack):
                        where = next((f for f in reversed(stack) if "pytorch_lightning" in f.filename or f.filename.startswith(VITLAB_DIR)), stack[-1])
                        reads.setdefault(owner.batch, []).append(f"{_name} from {Path(where.filename).name}:{where.lineno}")
                return _original(*args, **kwargs)

            self._saved.append((name, original))
            setattr(torch.Tensor, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch_idx

    def on_train_epoch_end(self, trainer, pl_module):
        self.batch = None

    def on_train_end(self, trainer, pl_module):
        while self._saved:
            name, original = self._saved.pop()
            setattr(torch.Tensor, name, original)

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


@pytest.mark.parametrize("bar", ["default", pytest.param("tqdm", marks=pytest.mark.slow), pytest.param("named", marks=pytest.mark.slow)])
def test_the_training_loop_reads_the_device_only_at_logging_steps(tiny_dataset, tmp_path, bar):
    """With the progress bar train.py shows by default (Rich's, tqdm's where the config picks Lightning's tqdm bar),
    the logged loss is read off the device at the logging steps and the epoch's last batch only, not after every
    step (which would keep a GPU waiting for the host every step)."""
    from tests.helpers.runs import tiny_args

    extra = ["--trainer.limit_train_batches", "7", "--data.batch_size", "2", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "true",
             "--trainer.log_every_n_steps", "3", "--runtime.figures", "off"]  # (figures: drawn off the steps)
    args = _first(tiny_args(tiny_dataset, tmp_path / "runs", epochs=1, extra=extra), f"{__name__}.ReadsBetweenSteps")
    if bar != "default":  # a bar the config names is kept as it is
        import yaml

        cfg = yaml.safe_load(Path(args[1]).read_text())
        cfg["trainer"]["callbacks"].append({"class_path": "pytorch_lightning.callbacks.TQDMProgressBar"} if bar == "tqdm" else
                                           {"class_path": "vitlab.callbacks.LogStepProgressBar", "init_args": {"refresh_rate": 5}})
        Path(args[1]).write_text(yaml.safe_dump(cfg))
    cli = fit(args)
    reads = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ReadsBetweenSteps)).reads
    bars = [type(cb).__name__ for cb in cli.trainer.callbacks if "ProgressBar" in type(cb).__name__]
    assert bars == (["TQDMProgressBar"] if bar == "tqdm" else ["LogStepProgressBar"])
    if bar == "named":
        assert next(cb for cb in cli.trainer.callbacks if "ProgressBar" in type(cb).__name__).refresh_rate == 5
    quiet = [b for b in range(7) if (b + 1) % 3 and b != 0 and b != 6]  # (the bar reads once at the first batch)
    assert {b: reads[b] for b in quiet if b in reads} == {}
    assert reads.get(2) and reads.get(5)  # the counter is live: the logging steps read the loss
    if bar != "tqdm":  # and the bar shows it (read at those steps)
        shown = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "LogStepProgressBar")._shown
        assert isinstance(shown.get("train/loss"), float), shown
