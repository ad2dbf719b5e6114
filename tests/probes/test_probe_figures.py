"""The image figures of probe.py invert / ablate / transplant, visualize and filters: each image drawn as it is, every
row, column and cell named, the figures under each cell the probe's own numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.probes.test_attentionless_probes import VIT, VIT_KWARGS, weights  # noqa: F401 (the tiny ViT and its weights)
from vitlab import models
from vitlab.outputs.figures import chw_to_image, image_table_figure
from vitlab.probes import main


pytestmark = pytest.mark.usefixtures("one_thread")


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_images()]


def test_an_image_table_draws_each_image_as_it_is_in_a_panel_of_the_size_asked_with_its_names():
    gen = torch.Generator().manual_seed(0)
    gray, rgb = torch.rand(1, 20, 20, generator=gen), torch.rand(3, 20, 20, generator=gen)
    cells = [[chw_to_image(gray), chw_to_image(rgb)], [chw_to_image(rgb), None]]
    fig = image_table_figure(cells, columns=["original", "a variant with a long name"], row_labels=["#0 a.png", "#1 b.png\nlesion"],
                             notes=[["", "error 0.1"], ["error 0.2", ""]], title="a title", panel_px=100)
    panels = _panels(fig)
    assert len(panels) == 3  # the empty cell draws nothing
    assert [ax.get_title() for ax in panels] == ["original", "a variant with a\nlong name", ""]  # wrapped to the panel
    assert [ax.get_ylabel() for ax in panels] == ["#0 a.png", "", "#1 b.png\nlesion"]
    assert [ax.get_xlabel() for ax in panels] == ["", "error 0.1", "error 0.2"]
    assert fig._suptitle.get_text() == "a title"
    drawn = [np.asarray(ax.get_images()[0].get_array()) for ax in panels]
    assert np.array_equal(drawn[0], gray[0].double().numpy()) and np.array_equal(drawn[1], rgb.permute(1, 2, 0).double().numpy())
    image = panels[0].get_images()[0]
    assert image.get_clim() == (0.0, 1.0) and image.get_cmap().name == "gray"  # black 0, white 1: not rescaled
    for ax in panels:
        box = ax.get_position()
        assert round(box.width * fig.get_figwidth() * fig.dpi) == 100 == round(box.height * fig.get_figheight() * fig.dpi)
    assert chw_to_image(torch.ones(2, 3, 3) * torch.tensor([0.2, 0.6])[:, None, None]) == pytest.approx(np.full((3, 3), 0.4))


def test_the_inversion_figure_names_images_and_variants_and_gives_each_inversions_errors(tmp_path, tiny_dataset, weights, figures):
    out = tmp_path / "invert"
    main(["invert", *VIT, "--weights", str(weights), "--images", str(tiny_dataset.parent), "--num-images", "2",
          "--layers", "0", "--steps", "6", "--noise-draws", "2", "--no-early-stop", "--out", str(out)])
    fig = figures["inversion/depth01_stage0.block0"]
    panels = _panels(fig)
    assert len(panels) == 2 * 2 and [ax.get_title() for ax in panels[:2]] == ["original", "model"]
    rows = {row["image"]: row for row in _csv(out / "inversion_images.csv")}
    names = json.loads((out / "inversion.json").read_text())["images"]
    for i, name in enumerate(names):
        assert panels[2 * i].get_ylabel().startswith(f"#{i} {name.rsplit('/', 1)[-1]}")
        row = rows[name]
        passed = row["passed_sigma_1_18"] == "True"
        assert panels[2 * i + 1].get_xlabel() == (
            f"feature error {float(row['feature_error']):.3f}\n{'<' if passed else '>='} noise "
            f"{float(row['noise_error_sigma_1_18']):.3f}: {'passed' if passed else 'not passed'}\n"
            f"input error {float(row['input_error']):.3f}")
        original = np.asarray(panels[2 * i].get_images()[0].get_array())
        assert original.shape == (32, 32, 3) and 0 <= original.min() and original.max() <= 1  # the image as the model sees it
    assert "sigma 1/18" in fig._suptitle.get_text()
    curves = figures["inversion/curves_vs_depth"].axes
    assert [ax.get_ylabel() for ax in curves] == ["relative error", "relative error", "fraction of the images"]
    assert all(ax.get_xlabel().startswith("depth") for ax in curves)


def test_the_visualize_figure_titles_each_image_with_its_final_values(tmp_path, weights, figures):
    out = tmp_path / "visualize"
    main(["visualize", *VIT, "--weights", str(weights), "--steps", "5", "--every", "5", "--classes", "0,2",
          "--neurons", "1:0-1", "--out", str(out)])
    rows = {(r["group"], r["target"]): r for r in _csv(out / "visualize.csv")}
    classes = _panels(figures["class/all_final"])
    assert [ax.get_title() for ax in classes] == [
        f"class{c}\nlogit {float(rows['class', f'class{c}']['final_logit']):.3g}, "
        f"p {float(rows['class', f'class{c}']['final_probability']):.3g}" for c in (0, 2)]
    units = _panels(figures["neuron/stage0.block1/all_final"])
    assert [ax.get_title() for ax in units] == [
        f"unit{u}\nactivation {float(rows['neuron/stage0.block1', f'unit{u}']['final_activation']):.3g}" for u in (0, 1)]
    assert "logit to 100" in figures["class/all_final"]._suptitle.get_text()


def test_the_filters_figures_name_the_models_the_components_shares_and_the_similarity_scale(tmp_path, weights, figures):
    out = tmp_path / "filters"
    main(["filters", *VIT, "--weights", str(weights), "--compare", "--components", "4", "--out", str(out)])
    pca = {(r["model"], int(r["component"])): float(r["explained_variance_ratio"]) for r in _csv(out / "pca.csv")}
    panels = _panels(figures["compare/pca"])
    assert len(panels) == 2 * 4
    assert [ax.get_title() for ax in panels] == [f"PC{k + 1}\n{pca[m, k]:.1%}" for m in ("model", "untrained") for k in range(4)]
    assert [panels[0].get_ylabel(), panels[4].get_ylabel()] == ["model", "untrained"]  # a row each (8 a row at most)
    filters = _panels(figures["compare/patch_filters"])
    assert [ax.get_title() for ax in filters] == ["model: 32 of 32 filters (3x8x8)", "untrained: 32 of 32 filters (3x8x8)"]
    fig = figures["compare/pos_similarity"]
    maps = _panels(fig)
    assert [ax.get_title() for ax in maps] == ["model (4 x 4 patches)", "untrained (4 x 4 patches)"]
    assert all(ax.get_xlabel() == "patch column" and ax.get_ylabel() == "patch row" for ax in maps)
    assert all(ax.get_images()[0].get_clim() == (-1.0, 1.0) for ax in maps)
    bar = next(ax for ax in fig.axes if ax not in maps)
    assert bar.get_ylabel() == "cosine similarity of the position embeddings"
    from vitlab.probes.filters import position_similarity, similarity_mosaic

    model = models.build_model("vit_tiny_patch16_224", 3, **VIT_KWARGS)
    model.load_state_dict(torch.load(weights))
    expected = similarity_mosaic(position_similarity(models.embeddings(model).pos_embed), (4, 4)).numpy()
    drawn = maps[0].get_images()[0].get_array()
    assert np.array_equal(np.ma.getmaskarray(drawn), np.isnan(expected))
    np.testing.assert_allclose(drawn.filled(0), np.nan_to_num(expected), atol=1e-6)


def _csv(path):
    import csv

    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_pca_figure_puts_eight_components_a_row_and_names_each_models_first_row():
    from vitlab.probes.filters import PCA_PER_ROW, pca_figure

    tiles = [np.full((4, 4), k / 10) for k in range(10)]
    shares = [0.5 / 2**k for k in range(10)]
    fig = pca_figure({"model": (tiles, shares), "untrained": (tiles[:3], shares[:3])})
    panels = _panels(fig)
    assert PCA_PER_ROW == 8 and len(panels) == 13
    assert [ax.get_ylabel() for ax in panels if ax.get_ylabel()] == ["model", "untrained"]
    assert [ax.get_title() for ax in panels[8:11]] == ["PC9\n0.2%", "PC10\n0.1%", "PC1\n50.0%"]
    rows = sorted({round(ax.get_position().y0, 6) for ax in panels}, reverse=True)
    assert len(rows) == 3  # model: 8 + 2, untrained: 3
