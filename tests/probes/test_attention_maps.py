"""probe.py attention's 2-D maps: a labelled figure whose overlays are the maps' own values, one colour scale per
image row, a colour bar per row."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from vitlab.probes.attention import map_figure
from vitlab.probes.streams import image_labels
from vitlab.probes.streams import ImageBatch


def test_a_map_figure_draws_each_map_over_its_image_with_a_labelled_colour_scale_per_row():
    gen = torch.Generator().manual_seed(3)
    pixels, maps = torch.rand(2, 1, 32, 32, generator=gen), torch.rand(2, 3, 4, 4, generator=gen) * torch.tensor([1.0, 5.0])[:, None, None, None]
    columns = ["head 0", "head 1", "head mean"]
    fig = map_figure(pixels, maps, columns, ["#0 a.png", "#1 b.png"], "block 0: attention", 32)
    try:
        bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
        panels = [ax for ax in fig.axes if ax not in bars]
        assert len(panels) == 2 * 4 and len(bars) == 2
        assert [ax.get_title() for ax in panels[:4]] == ["image", *columns]
        assert [panels[r * 4].get_ylabel() for r in range(2)] == ["#0 a.png", "#1 b.png"]
        assert all(bar.get_ylabel() == "attention weight" for bar in bars)
        assert fig._suptitle.get_text() == "block 0: attention"
        for r in range(2):
            assert len(panels[r * 4].get_images()) == 1  # the image alone
            for c in range(3):
                image, heat = panels[r * 4 + 1 + c].get_images()
                assert np.array_equal(np.asarray(heat.get_array()), maps[r, c].double().numpy())  # the values, not rescaled
                assert heat.get_clim() == (0.0, float(maps[r].double().max()))  # one scale per row, from 0
                assert np.allclose(image.get_array(), pixels[r, 0].numpy()[:, :, None].repeat(3, 2), atol=1e-6)  # 32 px: not resized
        for ax in panels:  # each panel is the side asked for, in the image's pixels
            box = ax.get_position()
            assert round(box.width * fig.get_figwidth() * fig.dpi) == 32 == round(box.height * fig.get_figheight() * fig.dpi)
    finally:
        plt.close(fig)


def test_image_labels_name_index_file_and_class():
    batch = ImageBatch(torch.zeros(3, 1, 4, 4), torch.zeros(3, 1, 4, 4), torch.tensor([1, 0, 7]),
                       ["p01/slice_02.dcm", "a_very_long_file_name_indeed.png", "x.png"], ["lesion", "no_lesion"])
    assert image_labels(batch) == ["#0 slice_02.dcm\nno_lesion", "#1 a_very_l..deed.png\nlesion", "#2 x.png\nclass 7"]
    batch.labels = None
    assert image_labels(batch)[0] == "#0 slice_02.dcm"
