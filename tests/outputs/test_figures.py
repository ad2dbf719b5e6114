"""Figure kinds kept between epochs write exactly the images new figures would; the figure worker draws them in
another process, in order, paused during steps, and ends with the run."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from vitlab.qkv.drift import report_drift
from vitlab.qkv.spectra import block_spectra, report_spectra
from vitlab.outputs.figures import Figure, Heatmap, LocalDrift, StageCurves, confusion_matrix, new_figure
from vitlab.runtime import FigureWorker

HEADS = {"stage0.block0": 2, "stage1.block0": 4}
DIMS = {"stage0.block0": 8, "stage1.block0": 16}


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"{b}.{m}.weight": torch.randn(d, d, generator=gen) * scale for b, d in DIMS.items() for m in "qkv"}


def _images(log_dir) -> dict[tuple[str, int], bytes]:
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {(tag, event.step): event.encoded_image_string for tag in acc.Tags()["images"] for event in acc.Images(tag)}


def _write_reports(writer, worker: FigureWorker | None) -> None:
    """Three epochs of drift and spectra reports whose values (and colour ranges) change from epoch to epoch."""
    ref = _state(0)
    prev = ref
    for step in (1, 2, 3):
        cur = {k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) * 0.3 * step for k, v in ref.items()}
        report_drift(writer, ref, cur, prev, HEADS, step, figure_worker=worker)
        report_spectra(writer, block_spectra(_state(10 + step, scale=step), HEADS), step, figure_worker=worker)
        prev = cur


def _report(log_dir, worker: FigureWorker | None) -> dict[tuple[str, int], bytes]:
    writer = SummaryWriter(str(log_dir))
    _write_reports(writer, worker)
    if worker is not None:
        worker.flush()
    writer.close()
    return _images(log_dir)


@pytest.mark.slow
def test_kept_figures_write_the_same_images_as_new_ones(tmp_path):
    worker = FigureWorker(process=False)
    fresh = _report(tmp_path / "fresh", None)
    reused = _report(tmp_path / "reused", worker)
    assert len(worker._store.figures) == 5 + len(HEADS) + 2 + 1  # drift maps, local maps, 2 stages, heads map
    assert set(worker.builds.values()) == {1}  # each built once, updated twice
    tags = {tag for tag, _ in fresh}
    assert {"drift_map/cosine_distance", "drift_local/stage1.block0", "spectra_figure/stage0", "spectra_heads/positive_mass"} <= tags
    assert set(reused) == set(fresh) and len(fresh) == 3 * len(tags)
    for key, png in fresh.items():
        assert reused[key] == png, f"{key}: the updated figure differs from a new one"
    assert fresh[("drift_map/euclidean", 2)] != fresh[("drift_map/euclidean", 3)]  # the images did change
    assert not plt.get_fignums()  # kept figures are not left among pyplot's open figures


@dataclass
class _Pid(Figure):
    """Records the process that built it (picklable: a module-level class)."""

    path: str

    def build(self):
        Path(self.path).write_text(str(os.getpid()))
        return new_figure((2, 2))


class _MathtextError(Figure):
    def build(self):
        fig = new_figure((2, 2))
        fig.add_subplot().set_title("$\\badcommand$")  # a mathtext error, raised only when drawn
        return fig


@dataclass
class _Slow(Figure):
    seconds: float

    def build(self):
        time.sleep(self.seconds)
        return new_figure((2, 2))


class _Dies(Figure):
    def build(self):
        os._exit(3)


@pytest.mark.slow
def test_the_worker_process_writes_the_same_images_in_order_and_reports_errors(tmp_path):
    """``FigureWorker()`` (a run's): the same PNGs as new figures, every image of a tag in step order, drawn in
    another process, a figure's error raised by flush() after the others are written, and images finished after
    their writer closed dropped."""
    fresh = _report(tmp_path / "fresh", None)
    worker = FigureWorker()
    try:
        background = _report(tmp_path / "background", worker)
        writer = SummaryWriter(str(tmp_path / "pid"))
        worker.submit(writer, "pid", 1, _Pid(str(tmp_path / "pid.txt")))
        worker.flush()
        writer.close()
        assert int((tmp_path / "pid.txt").read_text()) not in (os.getpid(), 0)
        assert background == fresh
        acc = EventAccumulator(str(tmp_path / "background"), size_guidance={"images": 0})
        acc.Reload()
        assert all([e.step for e in acc.Images(tag)] == [1, 2, 3] for tag in acc.Tags()["images"])

        writer = SummaryWriter(str(tmp_path / "broken"))
        worker.submit(writer, "broken", 1, _MathtextError())
        worker.submit(writer, "fine", 1, Heatmap([[1.0, 2.0]]))
        with pytest.raises(ValueError):
            worker.flush()
        writer.close()
        assert list(_images(tmp_path / "broken")) == [("fine", 1)]  # the others are still written

        # a run that stopped on an error closes its writer with images still being drawn: they are dropped, not
        # written to a new event file that the closed writer would open
        writer = SummaryWriter(str(tmp_path / "late"))
        worker.submit(writer, "late", 1, _Slow(1.0))
        writer.close()
        files = sorted(p.name for p in (tmp_path / "late").iterdir())
        worker.flush()
        assert sorted(p.name for p in (tmp_path / "late").iterdir()) == files and "late" not in _images(tmp_path / "late")
    finally:
        worker.close()


@pytest.mark.parametrize("annotate", [False, True])
def test_updated_heatmap_equals_a_new_one(tmp_path, annotate):
    """Colour range from the data (None) or annotated cells: an updated heatmap is pixel for pixel a new one."""
    gen = torch.Generator().manual_seed(5)
    first, second = torch.rand(3, 4, generator=gen).numpy(), (torch.rand(3, 4, generator=gen) * 50).numpy()
    second[1, 2] = float("nan")
    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    worker = FigureWorker(process=False)
    for step, matrix in ((1, first), (2, second)):
        figure = Heatmap(matrix, title=f"step {step}", xticklabels=list("abcd"), yticklabels=list("xyz"), annotate=annotate)
        writers["fresh"].add_figure("map", figure.build(), step)
        worker.submit(writers["reused"], "map", step, figure)
    for writer in writers.values():
        writer.close()
    assert worker.builds == {"map": 1}
    assert _images(tmp_path / "fresh") == _images(tmp_path / "reused")


@pytest.mark.slow
def test_a_stage_figure_redraws_its_axes_only_when_their_round_limits_change(tmp_path):
    """Spectra stage curves: updates within the figure's round y limits redraw the curves over the kept axes,
    updates beyond them redraw the axes too; every image is pixel for pixel a new figure's (TensorBoard's own
    encoding), and the limits end on ticks, at 0 for the antisymmetric lambdas and 1 for the singular values."""
    gen = torch.Generator().manual_seed(11)

    def curves(scale: float, noise: float) -> dict:
        base = torch.Generator().manual_seed(3)
        out = {}
        for b in range(3):
            sym, asym, sv = torch.randn(24, generator=base), torch.rand(12, generator=base) + 0.1, torch.rand(24, generator=base) + 0.05
            sym = sym * scale + noise * torch.randn(24, generator=gen)
            out[f"stage0.block{b}"] = tuple(t.sort(descending=True).values.numpy() for t in (sym, asym * scale, sv))
        return out

    sequence = [curves(1.0, 0.0), curves(1.0, 0.01), curves(1.0, 0.02), curves(4.0, 0.0), curves(4.0, 0.01)]
    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    worker = FigureWorker(process=False)
    backgrounds = []
    for step, values in enumerate(sequence):
        figure = StageCurves("stage0", values)
        writers["fresh"].add_figure("stage", figure.build(), step)
        worker.submit(writers["reused"], "stage", step, figure)
        kept = worker._store.figures["stage"]
        backgrounds.append(kept.backgrounds)
    limits = [ax.get_ylim() for ax in kept.canvas.figure.axes]
    for writer in writers.values():
        writer.close()
    fresh = _images(tmp_path / "fresh")
    assert _images(tmp_path / "reused") == fresh
    assert len(set(fresh.values())) == len(sequence)  # every update changed the image
    assert backgrounds == [1, 1, 1, 2, 2]  # axes redrawn for the first image and when the scale grew 4x
    assert limits[1][0] == 0.0 and limits[2][1] == 1.0
    for ax, (low, high) in zip(kept.canvas.figure.axes, limits):
        ticks = ax.get_yticks()
        assert min(abs(ticks - low)) < 1e-9 * max(1.0, abs(low)) and min(abs(ticks - high)) < 1e-9 * max(1.0, abs(high))


def test_a_different_layout_builds_a_new_figure(tmp_path):
    worker = FigureWorker(process=False)
    writer = SummaryWriter(str(tmp_path))
    for step, rows in enumerate((2, 2, 3)):
        worker.submit(writer, "map", step, Heatmap(torch.rand(rows, 2).numpy(), title="t"))
    writer.close()
    assert worker.builds == {"map": 2}  # the second call updated the first figure; a 3-row map needed a new one


def test_confusion_matrix_update_rewrites_the_counts(tmp_path):
    """The validation confusion matrix as the run logs it: updated counts, the pixels of a new figure."""
    first, second = torch.tensor([[5, 1], [2, 7]]), torch.tensor([[10, 0], [3, 1234]])
    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    worker = FigureWorker(process=False)
    for step, confusion in ((1, first), (2, second)):
        writers["fresh"].add_figure("val/confusion_matrix", confusion_matrix(confusion, ["a", "b"]).build(), step)
        worker.submit(writers["reused"], "val/confusion_matrix", step, confusion_matrix(confusion, ["a", "b"]))
    for writer in writers.values():
        writer.close()
    assert _images(tmp_path / "fresh") == _images(tmp_path / "reused")
    fig = worker._store.figures["val/confusion_matrix"].canvas.figure
    assert [t.get_text() for t in fig.axes[0].texts] == ["10", "0", "3", "1.23e+03"]
    assert [t.get_color() for t in fig.axes[0].texts] == ["k", "k", "k", "w"]  # readable on light and dark cells


@pytest.mark.slow
def test_a_training_run_draws_in_one_worker_paused_during_its_steps_and_ends_it(tiny_dataset, tmp_path, monkeypatch, capsys):
    """``train.py`` adds a RuntimeCallback: one figure worker per run, paused during each training and validation
    step when torch's threads take every core, every figure built once and then updated, ended with the run;
    ``runtime.figures inline`` draws in the training process and ``off`` draws nothing."""
    import vitlab.callbacks.runtime as runtime_callback
    import vitlab.runtime as runtime
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit

    started = []

    class Recording(runtime.FigureWorker):
        def __init__(self, process: bool = True) -> None:
            super().__init__(process)
            self.calls: list[str] = []
            started.append(self)

        def submit(self, writer, tag, step, figure) -> None:
            self.calls.append(tag)
            super().submit(writer, tag, step, figure)

        def pause(self) -> None:
            self.calls.append("pause")
            super().pause()

        def resume(self) -> None:
            self.calls.append("resume")
            super().resume()

    monkeypatch.setattr(runtime_callback, "FigureWorker", Recording)
    monkeypatch.setattr(runtime_callback, "available_cores", lambda: 1)  # torch's threads take every core
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=2))
    assert len(started) == 1 and started[0].process
    calls = started[0].calls
    images = _images(cli.trainer.log_dir)
    assert len([c for c in calls if c not in ("pause", "resume")]) == len(images) > 0
    assert {t for t, _ in images} >= {"val/confusion_matrix", "drift_map/cosine_distance", "spectra_figure/stage0"}
    steps = cli.trainer.global_step + 2 * sum(cli.trainer.num_val_batches)  # training and validation steps
    assert calls.count("pause") == steps > 0 and calls.count("resume") >= steps  # stopped during every step (flushes resume)
    assert [c for c in calls if c in ("pause", "resume")][:4] == ["pause", "resume", "pause", "resume"]
    assert started[0]._proc.wait(timeout=30) is not None  # ended with the run

    monkeypatch.setattr(runtime_callback, "available_cores", lambda: 64)  # cores to spare: it draws beside the steps
    fit(tiny_args(tiny_dataset, tmp_path / "spare", epochs=1))
    assert len(started) == 2 and "pause" not in started[1].calls
    inline = fit([*tiny_args(tiny_dataset, tmp_path / "inline", epochs=1), "--runtime.figures", "inline"])
    assert len(started) == 3 and not started[2].process and set(_images(inline.trainer.log_dir)) == {
        k for k in _images(next((tmp_path / "spare" / "tiny").iterdir()))}
    off = fit([*tiny_args(tiny_dataset, tmp_path / "off", epochs=1), "--runtime.figures", "off"])
    assert len(started) == 3 and not _images(off.trainer.log_dir)
    with pytest.raises(SystemExit):
        fit(["--help"])
    assert len(started) == 3
    capsys.readouterr()


@pytest.mark.slow
def test_a_training_script_without_a_main_guard_runs_once(tiny_dataset, tmp_path):
    """The figure worker is a plain subprocess: unlike multiprocessing's spawn, it does not run the user's
    ``__main__`` script again (a script without ``if __name__ == "__main__"`` would train twice)."""
    import subprocess
    import sys

    from tests.helpers.runs import tiny_args

    args = tiny_args(tiny_dataset, tmp_path / "runs", epochs=1)
    marker = tmp_path / "ran"
    script = tmp_path / "train_mine.py"
    script.write_text(
        "import sys\n"
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from vitlab.cli import fit\n"
        f"fit({args!r})\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.read_text() == "x"
    assert _images(next((tmp_path / "runs" / "tiny").iterdir()))  # the figures were drawn


@pytest.mark.slow
def test_a_worker_that_ignores_ctrl_c_and_one_that_dies(tmp_path):
    import signal

    worker = FigureWorker()
    writer = SummaryWriter(str(tmp_path))
    try:
        worker.submit(writer, "fine", 1, Heatmap([[1.0]]))
        worker.flush()
        os.kill(worker._proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the training process decides, not the worker
        worker.submit(writer, "again", 1, Heatmap([[1.0]]))
        worker.flush()
        worker.submit(writer, "dies", 1, _Dies())
        with pytest.raises(RuntimeError, match=r"figure worker ended \(exit code 3\)"):
            worker.flush()
    finally:
        worker.close()
        writer.close()
    assert {tag for tag, _ in _images(tmp_path)} == {"fine", "again"}


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="pausing is Linux-only")
def test_a_paused_worker_draws_nothing_until_resumed_and_a_flush_resumes_it(tmp_path):
    worker = FigureWorker()
    writer = SummaryWriter(str(tmp_path))
    try:
        worker.submit(writer, "first", 1, Heatmap([[1.0]]))
        worker.flush()
        worker.pause()
        worker.submit(writer, "second", 1, Heatmap([[2.0]]))
        time.sleep(1.0)
        assert (worker.submitted, worker.written) == (2, 1)  # stopped
        worker.flush()  # resumes it
        assert not worker.paused and worker.written == 2
    finally:
        worker.close()
        writer.close()
    assert {tag for tag, _ in _images(tmp_path)} == {"first", "second"}


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_paused_worker_ends_with_a_killed_training_process(tmp_path):
    """A training process killed (SIGKILL) while its figure worker is paused: the stopped child would never read
    the end of its input; the kernel kills it with its parent."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom torch.utils.tensorboard import SummaryWriter\nfrom vitlab.runtime import FigureWorker\n"
            "from vitlab.outputs.figures import Heatmap\nw = FigureWorker()\n"
            f"w.submit(SummaryWriter({str(tmp_path)!r}), 't', 0, Heatmap([[1.0]]))\nw.flush()\nw.pause()\n"
            "print(w._proc.pid, flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "T":  # stopped (the signal is asynchronous)
            assert time.monotonic() < deadline, "the figure worker was not stopped"
            time.sleep(0.05)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
            except (FileNotFoundError, ProcessLookupError):
                break
            if state in "ZX":  # dead, not yet reaped by whichever process adopted it
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the paused figure worker outlived its killed parent")
    finally:
        parent.kill()


def test_blocks_of_one_layout_share_a_kept_local_drift_map(tmp_path):
    """Two blocks with the same heads x rows share one kept figure (built once); each tag's images, its first
    included, are pixel for pixel a new figure's, titles (block names) and colour ranges included."""
    gen = torch.Generator().manual_seed(7)
    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    worker = FigureWorker(process=False)
    for step in (1, 2):
        for block, scale in (("stage0.block0", 1.0), ("stage0.block1", 30.0), ("stage1.block0", 2.0)):
            rows = 4 if block.startswith("stage1") else 3
            grids = {name: [(torch.rand(rows, 5, generator=gen) * scale * step).numpy() for _ in "qkv"]
                     for name in ("cosine_distance", "euclidean")}
            figure = LocalDrift(block, grids, step)
            writers["fresh"].add_figure(f"drift_local/{block}", figure.build(), step)
            worker.submit(writers["reused"], f"drift_local/{block}", step, figure)
    for writer in writers.values():
        writer.close()
    assert worker.builds == {"drift_local/stage0.block0": 1, "drift_local/stage1.block0": 1}  # block1: block0's figure
    fresh = _images(tmp_path / "fresh")
    assert len(fresh) == 6 and _images(tmp_path / "reused") == fresh


def test_every_drift_and_spectra_figure_labels_its_axes_and_colour_bars(tmp_path, monkeypatch):
    """Each panel of the figures the Q/K/V reports draw names what its x and y axes hold, and every colour bar
    what its colours mean: a figure read on its own says what it shows."""
    import vitlab.qkv.drift as drift_module
    import vitlab.qkv.spectra as spectra_module

    drawn: dict[str, Figure] = {}
    capture = lambda writer, tag, step, figure, worker=None: drawn.setdefault(tag, figure)  # noqa: E731
    monkeypatch.setattr(drift_module, "log_figure", capture)
    monkeypatch.setattr(spectra_module, "log_figure", capture)
    ref, cur = _state(0), _state(1)
    writer = SummaryWriter(str(tmp_path))
    report_drift(writer, ref, cur, ref, HEADS, 1)
    report_spectra(writer, block_spectra(_state(2), HEADS), 1)
    writer.close()
    assert {tag.split("/")[0] for tag in drawn} >= {"drift_map", "drift_local", "spectra_figure"}
    figures = {tag: figure.build() for tag, figure in drawn.items()}
    try:
        for tag, fig in figures.items():
            colour_bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
            panels = [ax for ax in fig.axes if ax not in colour_bars]
            assert panels and any(ax.get_xlabel() for ax in panels), tag
            assert all(any(other.get_ylabel() for other in panels if other.get_position().y0 == ax.get_position().y0)
                       for ax in panels), f"{tag}: a row of panels without a y label"
            assert all(bar.get_ylabel() or bar.get_xlabel() for bar in colour_bars), f"{tag}: a colour bar without a label"
        assert [ax.get_ylabel() for ax in figures["spectra_figure/stage0"].axes[:3]] == ["eigenvalue", "lambda", "sigma_i / sigma_1"]
        assert set(drift_module.DRIFT_MAP_UNITS) == {tag.split("/")[1] for tag in drawn if tag.startswith("drift_map/")}
    finally:
        for fig in figures.values():
            plt.close(fig)


def test_the_segmentation_figure_names_its_columns_classes_and_each_rows_dice():
    """Each row's Dice against scikit-learn's F1 of the class's pixels (the same quantity), the overlays against a
    hand blend, and a legend entry per class in the class's overlay colour."""
    import matplotlib
    import numpy as np
    from sklearn.metrics import f1_score

    from vitlab.outputs.figures import OVERLAY_ALPHA, SegmentationOverlay

    rng = np.random.default_rng(4)
    images, truth, pred = rng.random((3, 24, 24)), rng.integers(0, 3, (3, 24, 24)), rng.integers(0, 3, (3, 24, 24))
    truth[2], pred[2] = 0, 0  # a row with no foreground
    pred[1][pred[1] == 2] = 1  # class 2 in the truth only: Dice 0
    figure = SegmentationOverlay(images, truth, pred, ["lesion", "liver"], "each volume's middle slice")
    fig = figure.build()
    try:
        panels = [ax for ax in fig.axes if ax.get_images()]
        assert len(panels) == 9
        assert [ax.get_title().split("\n")[0] for ax in panels[:3]] == ["image", "ground truth", "prediction"]
        assert [panels[3 * r].get_ylabel() for r in range(3)] == ["#0", "#1", "#2"]
        for r in range(2):
            expected = ", ".join(f"{name} {f1_score(truth[r].ravel() == k, pred[r].ravel() == k):.2f}"
                                 for k, name in ((1, "lesion"), (2, "liver")))
            title = panels[3 * r + 2].get_title().removeprefix("prediction\n").replace("\n", " ")  # (wrapped to the panel)
            assert title == f"Dice: {expected}"
        assert panels[8].get_title() == "no foreground"
        assert "each volume's middle slice" in fig._suptitle.get_text()
        gray = (images[0] - images[0].min()) / (images[0].max() - images[0].min() + 1e-8)
        colours = np.asarray(matplotlib.colormaps["tab10"](truth[0] % 10))[..., :3]
        blended = np.where((truth[0] > 0)[..., None], (1 - OVERLAY_ALPHA) * gray[..., None] + OVERLAY_ALPHA * colours, gray[..., None])
        np.testing.assert_allclose(panels[1].get_images()[0].get_array(), blended, atol=1e-12)
        np.testing.assert_allclose(panels[0].get_images()[0].get_array(), gray, atol=1e-12)
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == ["1 lesion", "2 liver"]
        tab = matplotlib.colormaps["tab10"]
        for k, patch in enumerate(legend.get_patches(), 1):
            assert patch.get_facecolor()[:3] == pytest.approx(tuple((1 - OVERLAY_ALPHA) + OVERLAY_ALPHA * np.asarray(tab(k)[:3])))
    finally:
        plt.close(fig)
