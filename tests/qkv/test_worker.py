"""The Q/K/V callbacks' per-epoch work on a background thread (as beside a GPU) writes what the inline path writes."""

from __future__ import annotations

import threading

import pytest
import torch

from vitlab.qkv.state import QKVCapture, qkv_state
from vitlab.qkv.worker import QKVWorker


def test_worker_runs_jobs_in_order_and_raises_their_errors_in_the_caller():
    for background in (False, True):
        worker, seen = QKVWorker(background), []
        for i in range(5):
            worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        worker.flush()
        assert [i for i, _ in seen] == list(range(5)) and worker.done == worker.submitted == 5
        assert all((name == "vitlab-qkv") == background for _, name in seen)

        def fail():
            raise RuntimeError("disk full")

        if background:
            worker.submit(fail)
            with pytest.raises(RuntimeError, match="disk full"):
                worker.flush()
        else:
            with pytest.raises(RuntimeError, match="disk full"):
                worker.submit(fail)
        worker.close()


def test_a_background_worker_writes_its_tables_in_a_child_and_ends_it_after_its_jobs(tmp_path):
    import numpy as np

    assert QKVWorker(background=False).tables is None  # (on the CPU the jobs write their tables themselves)
    worker = QKVWorker(background=True)
    worker.submit(lambda: worker.tables.write(tmp_path / "t.csv", {"row": np.arange(3), "x": np.ones(3) / 3}))
    worker.flush()
    child = worker.tables._proc
    assert child is not None and child.poll() is None
    assert (tmp_path / "t.csv").read_text().splitlines() == ["row,x", "0,0.33333333", "1,0.33333333", "2,0.33333333"]
    thread = worker._thread
    worker.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and child.poll() == 0 and worker.tables._proc is None


def test_capture_copies_the_weights_once_and_its_host_copy_equals_qkv_state():
    from tests.helpers.runs import TINY_SWIN
    from vitlab import models

    torch.manual_seed(0)
    model = models.build_model(TINY_SWIN["model_name"], num_classes=2, in_chans=1, **TINY_SWIN["model_kwargs"])
    capture = QKVCapture(model, step=3)
    expected = qkv_state(model)
    assert list(capture.tensors) == list(expected) and capture.step == 3
    for key, value in expected.items():
        assert torch.equal(capture.host()[key], value)
    with torch.no_grad():  # a copy, not a view of the live weights
        next(model.parameters()).add_(1.0)
        for block in models.qkv(model).values():
            block["q"].add_(1.0)
    assert all(torch.equal(capture.host()[key], value) for key, value in expected.items())


@pytest.mark.slow
def test_a_fit_with_the_work_on_a_thread_writes_what_the_inline_fit_writes(tiny_dataset, tmp_path, monkeypatch):
    """Two CPU runs of one config: one with the Q/K/V work and the checkpoints written inline, one as on a GPU: the
    Q/K/V work on its background thread, checkpoints copied and written by the background checkpoint writer, the
    batches normalised after the transfer. Snapshots, drift and spectra tables, every TensorBoard scalar and the
    checkpoints' tensors are the same."""
    from tests.helpers.runs import events, tiny_args
    from vitlab.callbacks import RuntimeCallback
    from vitlab.checkpoint_writer import BackgroundCheckpointIO
    from vitlab.cli import fit
    from lightning_fabric.utilities.apply_func import apply_to_collection

    fit(tiny_args(tiny_dataset, tmp_path / "inline", epochs=2))
    original = QKVWorker.__init__
    monkeypatch.setattr(QKVWorker, "__init__", lambda self, background: original(self, True))
    monkeypatch.setattr(RuntimeCallback.__init__, "__defaults__", ("auto", 0, "background", "device"))  # (as beside a GPU)
    handed = [0]  # tensors in the checkpoints handed to the writer
    save = BackgroundCheckpointIO.save_checkpoint

    def counted(self, checkpoint, *args, **kwargs):
        apply_to_collection(checkpoint, torch.Tensor, lambda t: handed.__setitem__(0, handed[0] + 1))
        return save(self, checkpoint, *args, **kwargs)

    monkeypatch.setattr(BackgroundCheckpointIO, "save_checkpoint", counted)
    cli = fit(tiny_args(tiny_dataset, tmp_path / "thread", epochs=2))
    assert getattr(cli.trainer, "_vitlab_qkv_worker", None) is None  # finished and closed at the end of the fit
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, BackgroundCheckpointIO) and io.writes >= 3
    # the first epoch's best and last checkpoints share one copy of the weights and the optimiser's state
    assert io.copies < handed[0] - len(cli.model.state_dict())
    names = [sorted(p.relative_to(tmp_path / name).parts[-1] for p in (tmp_path / name).rglob("*.ckpt")) for name in ("inline", "thread")]
    assert names[0] == names[1] and "last.ckpt" in names[0] and len(names[0]) == 2
    for file in names[0]:
        ckpts = [torch.load(next((tmp_path / name).rglob(file)), map_location="cpu", weights_only=False) for name in ("inline", "thread")]
        assert "_vitlab_settle" not in ckpts[1] and ckpts[0]["global_step"] == ckpts[1]["global_step"]
        assert ckpts[0]["state_dict"].keys() == ckpts[1]["state_dict"].keys()
        assert all(torch.equal(v, ckpts[1]["state_dict"][k]) for k, v in ckpts[0]["state_dict"].items()), file
        for a, b in zip(ckpts[0]["optimizer_states"][0]["state"].values(), ckpts[1]["optimizer_states"][0]["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a), file
    runs = [tmp_path / name / "tiny" / "version_0" for name in ("inline", "thread")]
    files = [sorted(p.name for p in (run / "qkv").iterdir()) for run in runs]
    assert files[0] == files[1] and "drift_epoch_002.csv" in files[0] and "spectra_epoch_000.csv" in files[0]
    from vitlab.qkv.state import load_snapshot

    for name in files[0]:
        if name.endswith(".safetensors"):  # (the header's metadata order is the writer's hash order: compare contents)
            (a, meta_a), (b, meta_b) = (load_snapshot(run / "qkv" / name) for run in runs)
            assert meta_a == meta_b and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert (runs[0] / "qkv" / name).read_bytes() == (runs[1] / "qkv" / name).read_bytes(), name
    scalars = []
    for run in runs:
        acc = events(run)
        scalars.append({tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]})
    assert scalars[0].keys() == scalars[1].keys()
    for tag, points in scalars[0].items():
        assert points == scalars[1][tag], tag
