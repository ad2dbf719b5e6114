"""The local drift maps and the per-head spectra map are labelled figures (axes, colour bars with ranges)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from vitlab.analysis import head_grid
from vitlab.qkv.drift import LOCAL_METRICS
from vitlab.outputs.figures import local_drift_figure
from vitlab.qkv.spectra import block_spectra, report_spectra


class RecordingWriter:
    """Accepts scalars (and is its own figure worker: keeps the figures it is given, built and open)."""

    def __init__(self) -> None:
        self.figures: dict[str, object] = {}

    def submit(self, writer, tag, step, figure):
        self.figures[tag] = figure.build()

    def add_scalar(self, *args, **kwargs):
        pass


def test_local_drift_figure_labels_heads_rows_matrices_and_ranges():
    gen = torch.Generator().manual_seed(3)
    heads, head_dim = 3, 5
    rows = {name: [torch.rand(heads * head_dim, generator=gen, dtype=torch.float64) * (i + 1) for i in range(3)] for name in LOCAL_METRICS}
    grids = {name: [head_grid(r, heads) for r in per] for name, per in rows.items()}
    fig = local_drift_figure("stage1.block0", grids, step=7)
    panels = [ax for ax in fig.axes if ax.get_images() and ax.get_label() != "<colorbar>"]
    assert len(panels) == len(LOCAL_METRICS) * 3
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["h0", "h1", "h2"]  # heads, shared by all panels
    assert all(ax.get_shared_y_axes().joined(ax, panels[0]) for ax in panels)
    assert [ax.get_title() for ax in panels[:3]] == ["Q", "K", "V"]
    for ax in panels:  # each panel is heads x rows-in-head, drawn from the grid it was given
        assert ax.get_images()[0].get_array().shape == (heads, head_dim)
    assert "row in head" in panels[-1].get_xlabel()
    colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(colorbars) == len(LOCAL_METRICS)
    for name, cbar, first in zip(LOCAL_METRICS, colorbars, panels[::3]):
        vmax = max(float(r.max()) for r in rows[name])
        assert cbar.get_ylabel() == f"{name.replace('_', ' ')} [0, {vmax:.3g}]"
        assert first.get_images()[0].get_clim() == (0.0, vmax)  # one scale for Q, K and V of a metric
    assert "stage1.block0" in fig._suptitle.get_text()
    plt.close(fig)


def test_spectra_heads_figure_has_blocks_heads_and_unit_colour_range():
    gen = torch.Generator().manual_seed(4)
    state = {}
    heads = {"stage0.block0": 2, "stage1.block0": 4}
    for block, dim in (("stage0.block0", 8), ("stage1.block0", 16)):
        for m in "qk":
            state[f"{block}.{m}.weight"] = torch.randn(dim, dim, generator=gen)
    spectra = block_spectra(state, heads)
    writer = RecordingWriter()
    report_spectra(writer, spectra, step=3, figure_worker=writer)
    fig = writer.figures["spectra_heads/positive_mass"]
    ax = next(a for a in fig.axes if a.get_images())
    image = ax.get_images()[0]
    data = image.get_array()
    assert data.shape == (2, 4) and image.get_clim() == (0.0, 1.0)
    assert np.ma.is_masked(data[0, 2]) and np.ma.is_masked(data[0, 3])  # stage0 has 2 heads: grey cells
    np.testing.assert_allclose(np.asarray(data[1]), spectra["stage1.block0"].positive_mass.numpy(), rtol=1e-6)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(heads)
    assert ax.get_xlabel().startswith("head") and ax.get_ylabel() == "block"
    cbar = [a for a in fig.axes if a is not ax][0]
    assert "positive mass" in cbar.get_ylabel()
    for f in writer.figures.values():
        plt.close(f)


def test_figures_are_drawn_about_five_times_per_run_and_at_both_ends():
    from types import SimpleNamespace

    from vitlab.outputs.tensorboard import figures_due

    thirty = SimpleNamespace(max_epochs=30)
    assert [e for e in range(31) if figures_due(thirty, e)] == [0, 1, 8, 16, 24, 30]
    assert [e for e in range(8) if figures_due(SimpleNamespace(max_epochs=7), e)] == [0, 1, 2, 4, 6, 7]
    assert [e for e in range(4) if figures_due(SimpleNamespace(max_epochs=3), e)] == [0, 1, 2, 3]
    assert [e for e in range(11) if figures_due(SimpleNamespace(max_epochs=10), e, every_n_epochs=4)] == [0, 1, 4, 8, 10]
    assert [e for e in range(6) if figures_due(SimpleNamespace(max_epochs=None), e)] == list(range(6))


def test_add_scalars_writes_what_add_scalar_writes_in_one_event(tmp_path):
    """The callbacks' scalars go out as one event per step: TensorBoard reads the same tags, steps and values as
    from one ``add_scalar`` event each; a writer without a file writer gets ``add_scalar`` calls."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.outputs.tensorboard import add_scalars

    gen = torch.Generator().manual_seed(4)
    values = {f"drift/m{i}/stage{j}.block0.q": float(torch.randn((), generator=gen)) for i in range(5) for j in range(3)}
    values["spectra/effective_rank/stage0.block1"] = torch.tensor(3.25)  # a 0-d tensor, as float() takes it
    values["nan"] = float("nan")
    read = {}
    for name in ("separate", "together"):
        writer = SummaryWriter(str(tmp_path / name))
        for step in (2, 5):
            if name == "separate":
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
            else:
                add_scalars(writer, values, step)
        writer.close()
        acc = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0})
        acc.Reload()
        read[name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert set(read["together"]) == set(values) and len(read["together"]["nan"]) == 2
    np.testing.assert_equal(read["together"], read["separate"])  # (NaN equal to NaN)
    calls = []

    class Plain:
        def add_scalar(self, tag, value, step):
            calls.append((tag, step))

    add_scalars(Plain(), values, 7)
    assert calls == [(tag, 7) for tag in values]


def test_event_checksums_in_c_are_tensorboards_and_the_files_read_back(tmp_path, monkeypatch):
    """vitlab's masked CRC-32C (google-crc32c's C code) gives TensorBoard's pure-Python values, and event files
    written with it carry TensorBoard's checksums and read back through TensorBoard's reader (which checks them)."""
    import struct

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.outputs.tensorboard import fast_event_checksums, masked_crc32c

    reference = pywrap_tensorflow.masked_crc32c  # (TensorBoard's pure-Python function)
    monkeypatch.setattr(pywrap_tensorflow, "masked_crc32c", reference)
    monkeypatch.setattr(record_writer, "masked_crc32c", record_writer.masked_crc32c)
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 64, 1000, 20011):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == reference(data) and masked_crc32c(bytearray(data)) == reference(data)
    assert fast_event_checksums() and record_writer.masked_crc32c is masked_crc32c is pywrap_tensorflow.masked_crc32c
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("loss", 0.25, 3)
    writer.add_image("picture", rng.random((3, 40, 30)), 3)
    writer.close()
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    raw, records = event_file.read_bytes(), 0
    while raw:  # every record: length, its masked CRC, data, the data's masked CRC (TensorBoard's values)
        (length,), (length_crc,) = struct.unpack("<Q", raw[:8]), struct.unpack("<I", raw[8:12])
        data, (data_crc,) = raw[12 : 12 + length], struct.unpack("<I", raw[12 + length : 16 + length])
        assert length_crc == reference(raw[:8]) and data_crc == reference(data)
        raw, records = raw[16 + length :], records + 1
    assert records == 3  # (the file version, the scalar, the image)
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [0.25] and len(acc.Images("picture")) == 1
