"""Tests for vitlab.analysis.drift: per-row drift metrics against independent float64 formulas."""

import numpy as np
import pytest
import torch

from vitlab.analysis.drift import ROW_METRICS, head_grid, matrix_drift, row_drift


def _random_pair(shape, seed, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=g) * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g) * 3
    cur = ref * (1 + 0.2 * torch.randn(shape, generator=g)) + drift * torch.randn(shape, generator=g)
    return ref, cur


def _numpy_rows(ref, cur):
    """Row metrics computed independently with numpy float64, one row at a time."""
    u_all = ref.double().reshape(ref.shape[0], -1).numpy() if ref.ndim > 1 else ref.double().numpy()[:, None]
    v_all = cur.double().reshape(cur.shape[0], -1).numpy() if cur.ndim > 1 else cur.double().numpy()[:, None]
    out = {k: [] for k in ROW_METRICS}
    for u, v in zip(u_all, v_all):
        out["cosine_distance"].append(1 - np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
        out["euclidean"].append(np.linalg.norm(u - v))
        out["mse"].append(np.mean((u - v) ** 2))
        out["dot"].append(np.dot(u, v))
        out["ref_norm"].append(np.linalg.norm(u))
        out["cur_norm"].append(np.linalg.norm(v))
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("shape", [(24, 40), (300, 1000), (17,), (6, 3, 2, 2)])
def test_row_drift_matches_independent_formulas(shape):
    ref, cur = _random_pair(shape, seed=sum(shape))
    got = row_drift(ref, cur)
    expected = _numpy_rows(ref, cur)
    assert set(got) == set(ROW_METRICS)
    for key in ROW_METRICS:
        assert got[key].dtype == torch.float64 and got[key].shape == (shape[0],)
        np.testing.assert_allclose(got[key].numpy(), expected[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_identical_weights_give_zero_distance_and_squared_norm_dot():
    ref, _ = _random_pair((32, 20), seed=1)
    got = row_drift(ref, ref.clone())
    for key in ("cosine_distance", "euclidean", "mse"):
        assert torch.all(got[key] == 0), key
    sq_norm = (ref.double() ** 2).sum(1)
    torch.testing.assert_close(got["dot"], sq_norm, rtol=1e-12, atol=0)
    torch.testing.assert_close(got["ref_norm"], got["cur_norm"], rtol=0, atol=0)


def test_tiny_drift_keeps_relative_precision():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(8, 64, generator=g, dtype=torch.float64)
    cur = ref + 1e-8 * torch.randn(8, 64, generator=g, dtype=torch.float64)
    got = row_drift(ref, cur)["cosine_distance"]
    unit_ref = ref / ref.norm(dim=1, keepdim=True)
    unit_cur = cur / cur.norm(dim=1, keepdim=True)
    accurate = 0.5 * (unit_ref - unit_cur).square().sum(1)  # = 1 - cos without cancellation
    assert torch.all(accurate > 0)
    torch.testing.assert_close(got, accurate, rtol=1e-5, atol=0)


def test_planted_change_shows_only_in_its_head():
    heads, hd, width = 6, 8, 24
    ref, _ = _random_pair((heads * hd, width), seed=4)
    cur = ref.clone()
    cur[3 * hd + 2] += 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(5))  # one row of head 3
    cur[3 * hd + 5] *= -1.0  # a flipped row in the same head: cosine distance 2
    rows = row_drift(ref, cur)
    grid = head_grid(rows["euclidean"], heads)
    assert grid.shape == (heads, hd)
    changed = grid != 0
    assert changed[3, 2] and changed[3, 5] and changed.sum() == 2
    torch.testing.assert_close(head_grid(rows["cosine_distance"], heads)[3, 5], torch.tensor(2.0, dtype=torch.float64))
    summary = matrix_drift(ref, cur)
    assert summary["cosine_distance_max"] == pytest.approx(2.0)
    assert summary["cosine_distance_median"] == 0.0


def test_zero_rows_and_bias_vectors():
    ref = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 2.0]])
    cur = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    got = row_drift(ref, cur)
    torch.testing.assert_close(got["cosine_distance"], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(got["euclidean"], torch.tensor([0.0, 5.0, 5**0.5], dtype=torch.float64))
    bias = row_drift(torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 2.0, 0.5]))  # elementwise, d_in = 1
    torch.testing.assert_close(bias["cosine_distance"], torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(bias["mse"], torch.tensor([4.0, 16.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(bias["dot"], torch.tensor([3.0, -4.0, 0.25], dtype=torch.float64))


def test_matrix_drift_aggregates():
    ref, cur = _random_pair((50, 30), seed=6)
    summary = matrix_drift(ref, cur)
    r, c = ref.double().numpy(), cur.double().numpy()
    assert summary["rel_frobenius"] == pytest.approx(np.linalg.norm(c - r) / np.linalg.norm(r), rel=1e-12)
    assert summary["norm_ratio"] == pytest.approx(np.linalg.norm(c) / np.linalg.norm(r), rel=1e-12)
    rows = _numpy_rows(ref, cur)
    for key in ROW_METRICS:
        assert summary[f"{key}_mean"] == pytest.approx(rows[key].mean(), rel=1e-9)
        assert summary[f"{key}_median"] == pytest.approx(np.median(rows[key]), rel=1e-9)
        assert summary[f"{key}_max"] == pytest.approx(rows[key].max(), rel=1e-9)
    assert all(isinstance(v, float) for v in summary.values())
    zero = matrix_drift(torch.zeros(3, 4), torch.ones(3, 4))
    assert zero["rel_frobenius"] == float("inf") and zero["norm_ratio"] == float("inf")


def test_bad_input_raises_one_line_errors():
    with pytest.raises(ValueError, match=r"\(4, 5\).*\(5, 4\)"):
        row_drift(torch.zeros(4, 5), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="0-D|at least 1"):
        row_drift(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(ValueError, match="num_heads=5"):
        head_grid(torch.zeros(12), 5)
    with pytest.raises(ValueError, match="1-D"):
        head_grid(torch.zeros(3, 4), 3)


def test_drift_tables_stack_matrices_of_one_width_and_match_each_matrix_alone():
    """Blocks of two widths (a Swin's stages): the stacked computation equals :func:`matrix_drift` / :func:`row_drift`
    of each matrix on its own, and the per-row tensors come back where asked."""
    from vitlab.analysis import drift_tables

    gen = torch.Generator().manual_seed(7)
    ref, cur, blocks = {}, {}, []
    for name, width, rows in (("stage0.block0", 8, 24), ("stage0.block1", 8, 24), ("stage1.block0", 16, 48)):
        blocks.append(name)
        for m in "qkv":
            ref[f"{name}.{m}.weight"] = torch.randn(rows, width, generator=gen)
            cur[f"{name}.{m}.weight"] = ref[f"{name}.{m}.weight"] + 0.1 * torch.randn(rows, width, generator=gen)
    rows, summary = drift_tables(ref, cur, blocks, out_device="cpu")
    assert list(summary) == [(b, m) for b in blocks for m in "qkv"]
    for (block, m), values in summary.items():
        alone = matrix_drift(ref[f"{block}.{m}.weight"], cur[f"{block}.{m}.weight"])
        assert values["rel_frobenius"] == pytest.approx(alone["rel_frobenius"], rel=1e-12)
        assert values["norm_ratio"] == pytest.approx(alone["norm_ratio"], rel=1e-12)
        for metric in ("cosine_distance", "euclidean", "mse", "dot"):
            assert values[metric] == pytest.approx(alone[f"{metric}_mean"], rel=1e-12)
        per_row = row_drift(ref[f"{block}.{m}.weight"], cur[f"{block}.{m}.weight"])
        for metric, column in per_row.items():
            torch.testing.assert_close(rows[(block, m)][metric], column, rtol=1e-14, atol=1e-14)
