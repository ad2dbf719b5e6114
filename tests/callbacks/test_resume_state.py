"""What a checkpoint holds for a resumed run (vitlab.callbacks.runtime, vitlab.random_state): every random stream,
per rank; the figures not yet written, redrawn only where the event files lack them; checkpoints never held back
by the figure worker, whose backlog is bounded."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from vitlab import random_state
from vitlab.callbacks.runtime import RuntimeCallback, figure_from_state, figure_state
from vitlab.outputs.figures import DetectionOverlay, Heatmap, LocalDrift, SegmentationOverlay, StageCurves, confusion_matrix, render_png
from vitlab.outputs.tensorboard import written_images
from vitlab.runtime import FigureWorker


def _draws() -> tuple:
    """One draw of each stream (CUDA's too when this process has started it)."""
    cuda = torch.rand(3, device="cuda").cpu() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.rand(5), np.random.rand(5), np.random.randn(3), random.random(), random.gauss(0, 1), cuda


def _same(a: tuple, b: tuple) -> bool:
    return all(x is None and y is None or (torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y))
               for x, y in zip(a, b))


def _save_and_load(value, path: Path):
    torch.save(value, path)
    return torch.load(path, weights_only=True)  # as Lightning loads a checkpoint: plain values and tensors only


def test_random_streams_survive_a_weights_only_checkpoint(tmp_path):
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed), np.random.seed(seed % 2**32), random.seed(seed)
    np.random.randn(1)  # (a cached Gaussian in NumPy's state, random.gauss's in Python's)
    random.gauss(0, 1)
    state = _save_and_load(random_state.capture(), tmp_path / "streams.pt")
    first = _draws()
    assert random_state.restore(state) == []
    again = _draws()
    assert _same(first, again) and not _same(first, _draws()), seed


def _trainer(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, world_size=world, is_global_zero=rank == 0, ckpt_path="last.ckpt")


def _streams(seeds: list[int]) -> list[dict]:
    out = []
    for seed in seeds:
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        out.append(random_state.capture())
    return out


@pytest.mark.parametrize("saved, world, rank, restored, line", [
    (2, 2, 1, 1, None),  # each rank its own entry
    (2, 2, 0, 0, None),
    (2, 1, 0, 0, "random streams of 2 rank(s) for 1 here"),  # fewer ranks: what it can
    (1, 2, 1, None, None),  # more ranks: rank 1 keeps its own draws (rank 0 says so)
    (1, 2, 0, 0, "random streams of 1 rank(s) for 2 here (rank(s) 1 keep their own draws)"),
])
def test_each_rank_restores_its_own_streams_and_a_different_world_size_says_so(saved, world, rank, restored, line, capsys):
    seeds = [random.randrange(2**31) for _ in range(saved)]
    callback = RuntimeCallback()
    callback.load_state_dict({"rng": _streams(seeds), "figures": []})
    torch.manual_seed(12345)
    mine = torch.get_rng_state()
    callback.on_train_epoch_start(_trainer(rank, world), None)
    expected = mine if restored is None else _streams([seeds[restored]])[0]["torch"]
    assert torch.equal(torch.get_rng_state(), expected) and not callback._restore_streams
    out = capsys.readouterr().out
    assert (out == "") if line is None else (out.count("\n") == 1 and line in out and "differ from an uninterrupted run" in out)


def _figures(rng: np.random.Generator) -> list:
    """One figure of each kind with random values."""
    grid = lambda: rng.random((2, 4))  # noqa: E731
    return [
        confusion_matrix(rng.integers(0, 50, (3, 3)), ["a", "b", "c"]),
        Heatmap(rng.random((3, 5)), title="t", xticklabels=np.array(["q", "k", "v", "w", "x"]), vmin=np.float64(0.1)),
        LocalDrift("stage0.block0", {"cosine_distance": [grid(), grid(), grid()], "euclidean": [grid(), grid(), grid()]}, 7),
        StageCurves("stage0", {"stage0.block0": (np.sort(rng.random(6))[::-1], rng.random(3), rng.random(6))}),
        SegmentationOverlay(rng.random((2, 16, 16)), rng.integers(0, 2, (2, 16, 16)), rng.integers(0, 2, (2, 16, 16)), ["lesion"]),
        DetectionOverlay(rng.random((1, 16, 16)), [{"boxes": rng.random((2, 4)) * 16, "labels": np.array([1, 2]), "masks": rng.random((2, 16, 16)) > 0.5}],
                         [{"boxes": rng.random((1, 4)) * 16, "labels": np.array([2]), "scores": np.array([0.7]), "masks": np.zeros((1, 16, 16), bool)}],
                         ["lesion", "cyst"]),
    ]


def _equal_values(a, b) -> bool:
    """The same values, arrays as numpy arrays of one dtype, containers of one type (nested)."""
    import dataclasses

    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal_values(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray) and a.dtype.kind not in "USO":
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (np.ndarray, list, tuple)):  # (string arrays come back as lists)
        return isinstance(b, type(a) if not isinstance(a, np.ndarray) else list) and len(a) == len(b) and all(map(_equal_values, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_values(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b) or (isinstance(a, np.generic) and a.item() == b)


def test_a_figure_survives_a_weights_only_checkpoint_and_draws_the_same_image(tmp_path):
    rng = np.random.default_rng(random.randrange(2**31))
    figures = _figures(rng)
    states = _save_and_load([figure_state(f"tag{i}", 10 + i, i % 2, f) for i, f in enumerate(figures)], tmp_path / "figures.pt")
    for i, (figure, state) in enumerate(zip(figures, states)):
        assert (state["tag"], state["step"], state["ordinal"]) == (f"tag{i}", 10 + i, i % 2)
        assert _equal_values(figure, figure_from_state(state)), type(figure).__name__
    assert render_png(figure_from_state(states[2])) == render_png(figures[2])  # (a local drift map)
    with pytest.raises(ValueError, match="unknown kind 'Evil'"):
        figure_from_state({**states[0], "kind": "Evil"})


def test_written_images_counts_what_tensorboard_reads_back(tmp_path):
    """Images per (tag, step) across a killed run's event file and its resumed writer's (``purge_step`` 3): the
    resumed writer's restart marker drops what the killed run wrote at step 3 and later, as TensorBoard does."""
    png = render_png(Heatmap([[1.0, 2.0]]))
    from vitlab.outputs.tensorboard import write_png

    killed = SummaryWriter(str(tmp_path))
    for tag, step in [("a", 0), ("a", 1), ("a", 1), ("b", 2), ("a", 3), ("b", 4)]:
        write_png(killed, tag, png, step)
    killed.close()
    # event files sort by name: the second they were opened, then the host, the process and a count of the writers
    # this process opened, which sorts "10" before "9"; a resumed run opens its file seconds later, as here
    time.sleep(1.01 - time.time() % 1)
    resumed = SummaryWriter(str(tmp_path), purge_step=3)
    write_png(resumed, "a", png, 3)
    resumed.close()
    counts = written_images(tmp_path)
    assert counts == {("a", 0): 1, ("a", 1): 2, ("b", 2): 1, ("a", 3): 1}
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()  # (an independent reading: TensorBoard's own)
    read_back = {}
    for tag in acc.Tags()["images"]:
        for event in acc.Images(tag):
            key = (tag.split("/image/")[0], event.step)
            read_back[key] = read_back.get(key, 0) + 1
    assert read_back == dict(counts)


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="pausing is Linux-only")
def test_pending_figures_are_listed_in_order_and_a_backlog_past_its_bound_is_skipped(tmp_path, monkeypatch, capsys):
    import vitlab.figure_worker as figure_worker

    writer = SummaryWriter(str(tmp_path))
    worker = FigureWorker()
    try:
        worker.pause()  # nothing is drawn: everything handed in waits
        small, large = Heatmap(np.ones((2, 2))), Heatmap(np.ones((64, 64)))  # 32 bytes, 32 KB of values
        monkeypatch.setattr(figure_worker, "PENDING_BYTES", 40_000)
        worker.submit(writer, "a", 1, small)
        worker.submit(writer, "a", 1, large)
        worker.submit(writer, "b", 2, small)
        worker.submit(writer, "c", 2, large)  # past the bound: skipped
        worker.submit(writer, "d", 2, large)  # (one line per step)
        worker.submit(writer, "e", 3, large)
        assert [(t, s, o) for t, s, o, _ in worker.pending()] == [("a", 1, 0), ("a", 1, 1), ("b", 2, 0)]
        assert worker.skipped == 3
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2 and lines[0].startswith("vitlab: figures: skipped c (step 2)") and "(step 3)" in lines[1]
        worker.flush()
        assert worker.pending() == [] and worker.written == 3
    finally:
        worker.close()
        writer.close()
    assert written_images(tmp_path) == {("a", 1): 2, ("b", 2): 1}


SEEN: list[tuple[int, int]] = []  # (checkpoint epoch, figures it lists) at each epoch's start


class WatchCheckpoints(pl.Callback):
    """Reads ``last.ckpt`` at the start of every epoch after the first."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch:
            ckpt = torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
            SEEN.append((ckpt["epoch"], len(ckpt["callbacks"]["RuntimeCallback"]["figures"])))


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="pausing is Linux-only")
def test_checkpoints_are_never_held_back_by_a_figure_worker_that_draws_nothing(tiny_dataset, tmp_path, monkeypatch):
    """The figure worker is stopped for the whole fit: each epoch's ``last.ckpt`` is on disk when the next epoch
    starts (a checkpoint at most one epoch behind the snapshots, whatever the backlog), listing every figure handed
    in so far; at the end of the fit every image is written once."""
    import vitlab.callbacks.runtime as runtime_callback
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit

    workers = []

    class Stuck(FigureWorker):
        def __init__(self, process: bool = True) -> None:
            super().__init__(process)
            self.stuck = True
            self.pause()
            workers.append(self)

        def resume(self) -> None:
            if not self.stuck:
                super().resume()

        def flush(self) -> None:
            self.stuck = False
            super().flush()

    monkeypatch.setattr(runtime_callback, "FigureWorker", Stuck)
    SEEN.clear()
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=3, extra=[
        "--trainer.callbacks+=tests.callbacks.test_resume_state.WatchCheckpoints"]))
    assert [epoch for epoch, _ in SEEN] == [0, 1]
    assert 0 < SEEN[0][1] < SEEN[1][1]  # nothing drawn: the backlog grows, the checkpoints do not wait for it
    written = written_images(cli.trainer.log_dir)
    assert sum(written.values()) == workers[0].submitted == workers[0].written and workers[0].skipped == 0
