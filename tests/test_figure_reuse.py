"""Figures kept between epochs (FigureCache) write exactly the images that new figures would."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from vitlab.callbacks.drift import report_drift
from vitlab.callbacks.spectra import block_spectra, report_spectra
import vitlab.tblog as tblog
from vitlab.figures import new_figure, stage_curves_figure, stage_curves_update
from vitlab.tblog import CONFUSION_TITLE, FigureCache, confusion_matrix_figure, heatmap_figure, log_figure, update_heatmap

HEADS = {"stage0.block0": 2, "stage1.block0": 4}
DIMS = {"stage0.block0": 8, "stage1.block0": 16}


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"{b}.{m}.weight": torch.randn(d, d, generator=gen) * scale for b, d in DIMS.items() for m in "qkv"}


def _images(log_dir) -> dict[tuple[str, int], bytes]:
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {(tag, event.step): event.encoded_image_string for tag in acc.Tags()["images"] for event in acc.Images(tag)}


def _write_reports(writer, cache: FigureCache | None) -> None:
    """Three epochs of drift and spectra reports whose values (and colour ranges) change from epoch to epoch."""
    ref = _state(0)
    prev = ref
    for step in (1, 2, 3):
        cur = {k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) * 0.3 * step for k, v in ref.items()}
        report_drift(writer, ref, cur, prev, HEADS, step, figure_cache=cache)
        report_spectra(writer, block_spectra(_state(10 + step, scale=step), HEADS), step, figure_cache=cache)
        prev = cur


def _report(log_dir, cache: FigureCache | None) -> dict[tuple[str, int], bytes]:
    writer = SummaryWriter(str(log_dir))
    _write_reports(writer, cache)
    writer.close()
    return _images(log_dir)


def test_cached_figures_write_the_same_images_as_new_ones(tmp_path):
    cache = FigureCache()
    fresh = _report(tmp_path / "fresh", None)
    reused = _report(tmp_path / "reused", cache)
    assert len(cache._store.figures) == 5 + len(HEADS) + 2 + 1  # drift maps, local maps, 2 stages, heads map
    assert set(cache.builds.values()) == {1}  # each built once, updated twice
    tags = {tag for tag, _ in fresh}
    assert {"drift_map/cosine_distance", "drift_local/stage1.block0", "spectra_figure/stage0", "spectra_heads/positive_mass"} <= tags
    assert set(reused) == set(fresh) and len(fresh) == 3 * len(tags)
    for key, png in fresh.items():
        assert reused[key] == png, f"{key}: the updated figure differs from a new one"
    assert fresh[("drift_map/euclidean", 2)] != fresh[("drift_map/euclidean", 3)]  # the images did change
    assert not plt.get_fignums()  # cached figures are not left among pyplot's open figures


def _pid_figure(path: str):
    """A figure whose builder records the process that built it (a module function: picklable)."""
    Path(path).write_text(str(os.getpid()))
    return new_figure((2, 2))


def _mathtext_error_figure():
    fig = new_figure((2, 2))
    fig.add_subplot().set_title("$\\badcommand$")  # a mathtext error, raised only when drawn
    return fig


def _slow_figure(seconds: float):
    time.sleep(seconds)
    return new_figure((2, 2))


def _no_update(fig) -> None:
    pass


def test_background_drawing_writes_the_same_images_in_order_and_reports_errors(tmp_path, monkeypatch):
    """``FigureCache(background=True)`` (the callbacks' caches): the same PNGs as new figures, every image of a tag
    in step order, all caches drawn in one other process, a figure's error raised by flush(), and images finished
    after their writer closed dropped."""
    monkeypatch.setattr(tblog, "FIGURE_PATIENCE_S", 120.0)  # (unpickling this module's builders imports torch there)
    fresh = _report(tmp_path / "fresh", None)
    cache = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path / "background"))
    _write_reports(writer, cache)  # returns at once: the figure process draws
    other = FigureCache(background=True)  # another callback's cache, cleared after this one
    other_writer = SummaryWriter(str(tmp_path / "other"))
    other.add(other_writer, "other", 1, partial(_pid_figure, str(tmp_path / "pid")), _no_update)
    cache.clear()  # waits for the last drawings (what the callbacks' teardown does)
    assert tblog._FIGURE_PROCESS["pool"] is not None  # the other cache still uses the process
    other.clear()
    assert tblog._FIGURE_PROCESS["pool"] is None  # stopped with its last user
    other_writer.close()
    writer.close()
    assert cache.drawn_by == other.drawn_by == {int((tmp_path / "pid").read_text())} != {os.getpid()}  # one other process
    assert set(cache.builds.values()) == {1}
    background = _images(tmp_path / "background")
    assert background == fresh
    acc = EventAccumulator(str(tmp_path / "background"), size_guidance={"images": 0})
    acc.Reload()
    assert all([e.step for e in acc.Images(tag)] == [1, 2, 3] for tag in acc.Tags()["images"])

    failing = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path / "broken"))
    failing.add(writer, "broken", 1, _mathtext_error_figure, _no_update)  # returns at once: the error comes with flush()
    failing.add(writer, "fine", 1, partial(new_figure, (2, 2)), _no_update)
    with pytest.raises(ValueError):
        failing.clear()
    writer.close()
    assert list(_images(tmp_path / "broken")) == [("fine", 1)]  # the others are still written

    # a run that stopped on an error closes its writer with images still being drawn: they are dropped, not
    # written to a new event file that the closed writer would open
    late = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path / "late"))
    late.add(writer, "late", 1, partial(_slow_figure, 1.0), _no_update)
    writer.close()
    files = sorted(p.name for p in (tmp_path / "late").iterdir())
    late.clear()
    assert sorted(p.name for p in (tmp_path / "late").iterdir()) == files and "late" not in _images(tmp_path / "late")


@pytest.mark.parametrize("annotate", [False, True])
def test_updated_heatmap_equals_a_new_one(tmp_path, annotate):
    """Colour range from the data (None) or annotated cells: an updated heatmap is pixel for pixel a new one."""
    gen = torch.Generator().manual_seed(5)
    first, second = torch.rand(3, 4, generator=gen), torch.rand(3, 4, generator=gen) * 50
    second[1, 2] = float("nan")

    def build(matrix, title):
        return heatmap_figure(matrix, title=title, xticklabels=list("abcd"), yticklabels=list("xyz"), annotate=annotate)

    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    cache = FigureCache()
    for step, matrix in ((1, first), (2, second)):
        writers["fresh"].add_figure("map", build(matrix, f"step {step}"), step)
        log_figure(writers["reused"], "map", step, lambda: build(matrix, f"step {step}"),
                   lambda fig: update_heatmap(fig, matrix, title=f"step {step}"), cache)
    for writer in writers.values():
        writer.close()
    assert _images(tmp_path / "fresh") == _images(tmp_path / "reused")


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
    cache = FigureCache()
    backgrounds = []
    for step, values in enumerate(sequence):
        writers["fresh"].add_figure("stage", stage_curves_figure("stage0", values), step)
        log_figure(writers["reused"], "stage", step, partial(stage_curves_figure, "stage0", values), partial(stage_curves_update, values), cache)
        kept = cache._store.figures["stage"]
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
    cache = FigureCache()
    writer = SummaryWriter(str(tmp_path))
    built = []

    def build(rows):
        built.append(rows)
        return heatmap_figure(torch.rand(rows, 2), title="t")

    for rows in (2, 2, 3):
        log_figure(writer, "map", rows, lambda: build(rows), lambda fig: update_heatmap(fig, torch.rand(rows, 2), title="t"), cache, layout=rows)
    writer.close()
    assert built == [2, 3]  # the second call updated the first figure; a 3-row map needed a new one


def test_confusion_matrix_update_rewrites_the_counts(tmp_path):
    """The validation confusion matrix as the module logs it: updated counts, the pixels of a new figure."""
    first, second = torch.tensor([[5, 1], [2, 7]]), torch.tensor([[10, 0], [3, 1234]])
    writers = {name: SummaryWriter(str(tmp_path / name)) for name in ("fresh", "reused")}
    cache = FigureCache()
    for step, confusion in ((1, first), (2, second)):
        writers["fresh"].add_figure("val/confusion_matrix", confusion_matrix_figure(confusion, ["a", "b"]), step)
        log_figure(writers["reused"], "val/confusion_matrix", step, lambda: confusion_matrix_figure(confusion, ["a", "b"]),
                   lambda fig: update_heatmap(fig, confusion, title=CONFUSION_TITLE), cache)
    for writer in writers.values():
        writer.close()
    assert _images(tmp_path / "fresh") == _images(tmp_path / "reused")
    fig = cache._store.figures["val/confusion_matrix"].canvas.figure
    assert [t.get_text() for t in fig.axes[0].texts] == ["10", "0", "3", "1.23e+03"]
    assert [t.get_color() for t in fig.axes[0].texts] == ["k", "k", "k", "w"]  # readable on light and dark cells


@pytest.mark.slow
def test_a_fit_builds_each_figure_once_and_logs_it_every_epoch(tiny_dataset, tmp_path):
    """The callbacks of a real fit build every figure once (in the figure process) and update it later."""
    from tests.test_train_e2e import events, tiny_args
    from vitlab.callbacks import QKSpectra, QKVDrift
    from vitlab.cli import fit

    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=3))
    acc = events(Path(cli.trainer.log_dir))
    images = acc.Tags()["images"]
    local_tags = [t for t in images if t.startswith("drift_local/")]
    stage_tags = [t for t in images if t.startswith("spectra_figure/")]
    drift_cb = next(cb for cb in cli.trainer.callbacks if isinstance(cb, QKVDrift))
    spectra_cb = next(cb for cb in cli.trainer.callbacks if isinstance(cb, QKSpectra))
    built = drift_cb._figures.builds + spectra_cb._figures.builds + cli.trainer.logger.experiment._vitlab_figures.builds
    assert len(local_tags) == 4 and all(built[t] == 1 for t in local_tags)  # 4 blocks, one figure each
    assert len(stage_tags) == 2 and all(built[t] == 1 for t in stage_tags)  # 2 stages
    assert sorted(t for t in built if t.startswith("drift_map/")) == sorted(t for t in images if t.startswith("drift_map/"))
    assert set(built.values()) == {1} and len(built) == 4 + 5 + 2 + 1 + 1  # local, drift maps, stages, positive mass, confusion
    assert os.getpid() not in drift_cb._figures.drawn_by
    for tag in local_tags + [t for t in images if t.startswith("drift_map/")]:
        assert len(acc.Images(tag)) == 3, tag  # drawn after each of the 3 epochs
    for tag in stage_tags:
        assert len(acc.Images(tag)) == 4, tag  # and the spectra at fit start too
    assert len(acc.Images("val/confusion_matrix")) == 3


def test_a_training_run_starts_one_warmed_up_figure_process_before_its_set_up_and_ends_it(tiny_dataset, tmp_path, monkeypatch, capsys):
    """``vitlab.cli.fit`` starts the figure process before the model and data are set up (its imports, fonts and
    first figures then take a core the set-up leaves idle, not one training needs); the callbacks draw in that
    process, which is paused during each training and validation step when torch's threads take every core, and
    it ends with the run. ``--help`` starts none."""
    import vitlab.figures as figures
    from tests.test_train_e2e import tiny_args
    from vitlab.cli import fit

    started = []

    class Recording(figures.FigureProcess):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []
            started.append(self)

        def submit(self, call, *args):
            self.calls.append(call)
            return super().submit(call, *args)

        def pause(self) -> None:
            self.calls.append("pause")
            super().pause()

        def resume(self) -> None:
            self.calls.append("resume")
            super().resume()

    monkeypatch.setattr(figures, "FigureProcess", Recording)
    import vitlab.threads

    monkeypatch.setattr(vitlab.threads, "available_cores", lambda: 1)  # torch's threads take every core
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=2))
    assert len(started) == 1
    calls = started[0].calls
    assert calls[0] == "warm_up" and calls.count("render") == len(_images(cli.trainer.log_dir))
    steps = cli.trainer.global_step + 2 * sum(cli.trainer.num_val_batches)  # training and validation steps
    assert calls.count("pause") == steps > 0 and calls.count("resume") >= steps  # stopped during every step (flushes resume)
    assert [c for c in calls if c in ("pause", "resume")][:4] == ["pause", "resume", "pause", "resume"]
    assert not started[0].paused
    monkeypatch.setattr(vitlab.threads, "available_cores", lambda: 64)  # cores to spare: it draws beside the steps
    monkeypatch.setenv("VITLAB_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        fit(tiny_args(tiny_dataset, tmp_path / "spare", epochs=1))
    finally:
        torch.set_num_threads(threads)
    assert len(started) == 2 and "pause" not in started[1].calls
    assert tblog._FIGURE_PROCESS["pool"] is None and started[0]._proc.wait(timeout=30) is not None  # ended with the run
    with pytest.raises(SystemExit):
        fit(["--help"])
    assert len(started) == 2
    capsys.readouterr()


def test_a_training_script_without_a_main_guard_runs_once(tiny_dataset, tmp_path):
    """The figure process is a plain subprocess: unlike multiprocessing's spawn, it does not run the user's
    ``__main__`` script again (a script without ``if __name__ == "__main__"`` would train twice)."""
    import subprocess
    import sys

    from tests.test_train_e2e import tiny_args

    args = tiny_args(tiny_dataset, tmp_path / "runs", epochs=1)
    marker = tmp_path / "ran"
    script = tmp_path / "train_mine.py"
    script.write_text(
        "import sys\n"
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from vitlab.cli import fit\n"
        f"fit({args!r})\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.read_text() == "x"
    assert _images(next((tmp_path / "runs" / "tiny").iterdir()))  # the figures were drawn


def test_the_figure_process_priority_and_a_figure_process_that_dies():
    from vitlab.figures import FigureProcess

    process = FigureProcess()
    fine = process.submit("render", "cache", "fine", partial(new_figure, (1, 1)), _no_update, None)
    assert fine.result(timeout=60)[0].startswith(b"\x89PNG")
    if hasattr(os, "SCHED_IDLE"):  # Linux: it draws with the cycles nothing else wants
        assert os.sched_getscheduler(process._proc.pid) == os.SCHED_IDLE
    import signal

    os.kill(process._proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the training process decides, not the figure process
    again = process.submit("render", "cache", "fine", partial(new_figure, (1, 1)), _no_update, None)
    assert again.result(timeout=60)[0].startswith(b"\x89PNG")
    dead = process.submit("render", "cache", "dies", partial(os._exit, 3), _no_update, None)
    with pytest.raises(RuntimeError, match=r"figure process ended \(exit code 3\)"):
        dead.result(timeout=60)
    process.shutdown()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="pausing is Linux-only")
def test_a_paused_figure_process_draws_nothing_until_resumed_and_a_flush_resumes_it(tmp_path, monkeypatch):
    from vitlab.figures import FigureProcess

    monkeypatch.setattr(tblog, "FIGURE_PATIENCE_S", 60.0)  # (an idle-priority process starts slowly on a busy machine)

    process = FigureProcess()
    assert process.submit("render", "cache", "warm", partial(new_figure, (1, 1)), _no_update, None).result(timeout=60)
    process.pause()
    waiting = process.submit("render", "cache", "later", partial(new_figure, (1, 1)), _no_update, None)
    time.sleep(1.0)
    assert not waiting.done()  # stopped
    process.resume()
    assert waiting.result(timeout=60)[0].startswith(b"\x89PNG")
    process.shutdown()

    cache = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path))
    log_figure(writer, "first", 1, partial(new_figure, (1, 1)), _no_update, cache)  # starts the shared process
    cache.flush()
    tblog.pause_figures()
    assert tblog._FIGURE_PROCESS["pool"].paused
    log_figure(writer, "second", 1, partial(new_figure, (1, 1)), _no_update, cache)
    cache.flush()  # resumes it: drawn there, not taken over by this process after the patience time
    assert not tblog._FIGURE_PROCESS["pool"].paused and cache.drawn_by and os.getpid() not in cache.drawn_by
    cache.clear()
    writer.close()
    assert set(tag for tag, _ in _images(tmp_path)) == {"first", "second"}


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_paused_figure_process_ends_with_a_killed_training_process():
    """A training process killed (SIGKILL) while its figure process is paused: the stopped child would never read
    the end of its input; the kernel kills it with its parent."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("import os, sys\nfrom vitlab.figures import FigureProcess\np = FigureProcess()\n"
            "p.submit('warm_up').result(timeout=60)\np.pause()\nprint(p._proc.pid, flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "T":  # stopped (the signal is asynchronous)
        assert time.monotonic() < deadline, "the figure process was not stopped"
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
        pytest.fail("the paused figure process outlived its killed parent")


def test_a_flush_draws_what_the_figure_process_has_not_drawn_in_time(tmp_path, monkeypatch):
    """On a busy machine the idle-priority figure process may barely run: after FIGURE_PATIENCE_S a flush draws the
    remaining figures in the training process, in order, with the images new figures would give."""
    monkeypatch.setattr(tblog, "FIGURE_PATIENCE_S", 0.5)
    matrices = [torch.rand(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    writer = SummaryWriter(str(tmp_path / "late"))
    blocker = FigureCache(background=True)  # another callback's figure keeps the figure process busy
    blocker.add(SummaryWriter(str(tmp_path / "blocker")), "blocker", 0, partial(_slow_figure, 8.0), _no_update)
    cache = FigureCache(background=True)
    for step, matrix in enumerate(matrices, start=1):
        cache.add(writer, "map", step, partial(heatmap_figure, matrix.numpy(), title="t"), partial(tblog.heatmap_update, matrix.numpy(), "t", None, None))
    start = time.monotonic()
    cache.flush()
    assert time.monotonic() - start < 5.0 and cache.drawn_by == {os.getpid()}
    writer.close()
    fresh_writer = SummaryWriter(str(tmp_path / "fresh"))
    for step, matrix in enumerate(matrices, start=1):
        fresh_writer.add_figure("map", heatmap_figure(matrix, title="t"), step)
    fresh_writer.close()
    late = _images(tmp_path / "late")
    assert late == _images(tmp_path / "fresh")
    cache.clear()
    blocker.clear()
