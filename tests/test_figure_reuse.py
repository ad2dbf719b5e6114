"""Figures kept between epochs (FigureCache) write exactly the images that new figures would."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from vitlab.callbacks.drift import report_drift
from vitlab.callbacks.spectra import block_spectra, report_spectra
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


def _report(log_dir, cache: FigureCache | None) -> dict[tuple[str, int], bytes]:
    """Three epochs of drift and spectra reports whose values (and colour ranges) change from epoch to epoch."""
    ref = _state(0)
    writer = SummaryWriter(str(log_dir))
    prev = ref
    for step in (1, 2, 3):
        cur = {k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) * 0.3 * step for k, v in ref.items()}
        report_drift(writer, ref, cur, prev, HEADS, step, figure_cache=cache)
        report_spectra(writer, block_spectra(_state(10 + step, scale=step), HEADS), step, figure_cache=cache)
        prev = cur
    writer.close()
    return _images(log_dir)


def test_cached_figures_write_the_same_images_as_new_ones(tmp_path):
    cache = FigureCache()
    fresh = _report(tmp_path / "fresh", None)
    reused = _report(tmp_path / "reused", cache)
    assert len(cache._figures) == 5 + len(HEADS) + 2 + 1  # drift maps, local maps, 2 stages, heads map
    tags = {tag for tag, _ in fresh}
    assert {"drift_map/cosine_distance", "drift_local/stage1.block0", "spectra_figure/stage0", "spectra_heads/positive_mass"} <= tags
    assert set(reused) == set(fresh) and len(fresh) == 3 * len(tags)
    for key, png in fresh.items():
        assert reused[key] == png, f"{key}: the updated figure differs from a new one"
    assert fresh[("drift_map/euclidean", 2)] != fresh[("drift_map/euclidean", 3)]  # the images did change
    assert not plt.get_fignums()  # cached figures are not left among pyplot's open figures


def test_background_drawing_writes_the_same_images_in_order_and_reports_errors(tmp_path):
    """``FigureCache(background=True)`` (the callbacks' caches): same PNGs as new figures, every image of a tag in
    step order, all caches on one figure thread, and a drawing's error raised by flush()."""
    import threading

    fresh = _report(tmp_path / "fresh", None)
    cache = FigureCache(background=True)
    main = threading.get_ident()
    drawn_on: set[int] = set()
    import vitlab.tblog as tblog

    original = tblog._draw

    def recording(kept):
        drawn_on.add(threading.get_ident())
        original(kept)

    tblog._draw = recording
    from vitlab.callbacks import drift

    built_on: set[int] = set()
    build_local = drift.local_drift_figure

    def recording_build(*args):
        built_on.add(threading.get_ident())
        return build_local(*args)

    drift.local_drift_figure = recording_build
    import sys

    switch = sys.getswitchinterval()
    try:
        ref, writer = _state(0), SummaryWriter(str(tmp_path / "background"))
        prev = ref
        for step in (1, 2, 3):
            cur = {k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) * 0.3 * step for k, v in ref.items()}
            report_drift(writer, ref, cur, prev, HEADS, step, figure_cache=cache)
            report_spectra(writer, block_spectra(_state(10 + step, scale=step), HEADS), step, figure_cache=cache)
            prev = cur
            # the training thread gets the GIL back quickly while a figure is drawn beside it
            assert sys.getswitchinterval() == pytest.approx(min(switch, tblog.GIL_SWITCH_S))
        other = FigureCache(background=True)  # another callback's cache, cleared after this one
        other_writer = SummaryWriter(str(tmp_path / "other"))
        other.add(other_writer, "other", 1, plt.figure, lambda fig: None)
        cache.clear()  # waits for the last drawings (what the callbacks' teardown does)
        assert sys.getswitchinterval() == pytest.approx(min(switch, tblog.GIL_SWITCH_S))  # other thread still drawing
        other.clear()
        other_writer.close()
        assert sys.getswitchinterval() == switch  # restored once the last figure thread is gone
        writer.close()
    finally:
        tblog._draw = original
        drift.local_drift_figure = build_local
        sys.setswitchinterval(switch)
    assert len(drawn_on) == 1 and main not in drawn_on  # every cache draws on the one figure thread, not the training one
    assert built_on == drawn_on  # built there too
    background = _images(tmp_path / "background")
    assert background == fresh
    acc = EventAccumulator(str(tmp_path / "background"), size_guidance={"images": 0})
    acc.Reload()
    assert all([e.step for e in acc.Images(tag)] == [1, 2, 3] for tag in acc.Tags()["images"])

    def broken():
        fig = plt.figure()
        fig.add_subplot().set_title("$\\badcommand$")  # a mathtext error, raised only when drawn
        return fig

    failing = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path / "broken"))
    failing.add(writer, "broken", 1, broken, lambda fig: None)  # returns at once: the error comes with flush()
    with pytest.raises(ValueError):
        failing.clear()
    writer.close()

    # a run that stopped on an error closes its writer with images still pending: they are dropped, not written to
    # a new event file that the closed writer would open
    late = FigureCache(background=True)
    writer = SummaryWriter(str(tmp_path / "late"))
    gate = threading.Event()

    def slow():
        gate.wait(10)
        return plt.figure()

    late.add(writer, "late", 1, slow, lambda fig: None)
    writer.close()
    files = sorted(p.name for p in (tmp_path / "late").iterdir())
    gate.set()
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
    fig = cache._figures["val/confusion_matrix"].canvas.figure
    assert [t.get_text() for t in fig.axes[0].texts] == ["10", "0", "3", "1.23e+03"]


@pytest.mark.slow
def test_a_fit_builds_each_figure_once_and_logs_it_every_epoch(tiny_dataset, tmp_path, monkeypatch):
    """The callbacks of a real fit build every figure once and update it in the later epochs."""
    from tests.test_train_e2e import events, tiny_args
    from vitlab.callbacks import drift, spectra
    from vitlab.cli import fit
    from vitlab.training import module

    built: dict[str, int] = {}

    def counting(name, make):
        def wrapper(*args, **kwargs):
            built[name] = built.get(name, 0) + 1
            return make(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(drift, "local_drift_figure", counting("local", drift.local_drift_figure))
    monkeypatch.setattr(drift, "heatmap_figure", counting("drift_map", drift.heatmap_figure))
    monkeypatch.setattr(spectra, "stage_figure", counting("stage", spectra.stage_figure))
    monkeypatch.setattr(module, "confusion_matrix_figure", counting("confusion", module.confusion_matrix_figure))
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=3))
    acc = events(Path(cli.trainer.log_dir))
    images = acc.Tags()["images"]
    local_tags = [t for t in images if t.startswith("drift_local/")]
    stage_tags = [t for t in images if t.startswith("spectra_figure/")]
    assert len(local_tags) == 4 and built["local"] == 4  # 4 blocks, one figure each
    assert built["drift_map"] == 5 and len(stage_tags) == built["stage"] == 2  # 5 metrics, 2 stages
    for tag in local_tags + [t for t in images if t.startswith("drift_map/")]:
        assert len(acc.Images(tag)) == 3, tag  # drawn after each of the 3 epochs
    for tag in stage_tags:
        assert len(acc.Images(tag)) == 4, tag  # and the spectra at fit start too
    assert built["confusion"] == 1 and len(acc.Images("val/confusion_matrix")) == 3
