"""CSV tables: the column writer (large tables written beside training) gives the file the row writer gives."""

from __future__ import annotations

import random

import torch

from vitlab.analysis import DRIFT_METRICS, drift_tables
from vitlab.outputs.files import plain_floats, write_csv, write_csv_columns
from vitlab.qkv.drift import write_drift_table
from vitlab.qkv.state import block_stage


def test_the_column_writer_writes_the_row_writers_file(tmp_path):
    rng = random.Random(0)
    values = [rng.gauss(0, 1) * 10 ** rng.randint(-20, 20) for _ in range(500)] + [0.0, -0.0, 1e16, 1e-5, 123456789.0,
                                                                                    float("inf"), float("nan")]
    rows = [{"i": i, "name": f"b{i % 3}", "x": v, "y": -v / 3} for i, v in enumerate(values)]
    write_csv(tmp_path / "rows.csv", rows)
    write_csv_columns(tmp_path / "columns.csv", ["i", "name", "x", "y"],
                      zip(range(len(values)), (f"b{i % 3}" for i in range(len(values))), plain_floats(values),
                          plain_floats(-v / 3 for v in values)))
    assert (tmp_path / "columns.csv").read_bytes() == (tmp_path / "rows.csv").read_bytes()


def test_the_drift_table_is_the_row_by_row_table(tmp_path):
    """The per-row drift table (written column by column) against the same rows built one by one."""
    torch.manual_seed(0)
    heads = {"blocks.0": 2, "blocks.1": 4}
    ref = {f"{b}.{m}.weight": torch.randn(8, 6) for b in heads for m in "qkv"}
    cur = {k: v + 0.1 * torch.randn_like(v) for k, v in ref.items()}
    rows_ref, _ = drift_tables(ref, cur, list(heads), out_device="cpu")
    write_drift_table(tmp_path / "table.csv", 3, rows_ref, heads)
    expected = []
    for (block, matrix), r in rows_ref.items():
        names = [*DRIFT_METRICS, "ref_norm", "cur_norm"]
        for i in range(len(r["dot"])):
            expected.append({"epoch": 3, "block": block, "stage": block_stage(block), "matrix": matrix, "row": i,
                             "head": i // (len(r["dot"]) // heads[block]), **{k: r[k].tolist()[i] for k in names}})
    write_csv(tmp_path / "expected.csv", expected)
    assert (tmp_path / "table.csv").read_bytes() == (tmp_path / "expected.csv").read_bytes()


def test_the_array_writer_writes_the_row_writers_file(tmp_path):
    """Columns as numpy arrays (ints, strings, floats of every magnitude) give the file the row writer gives."""
    import numpy as np
    import pytest

    from vitlab.outputs.files import write_csv_arrays

    rng = np.random.default_rng(0)
    x = rng.standard_normal(300) * 10.0 ** rng.integers(-20, 20, 300)
    x[:4] = [0.0, float("inf"), float("nan"), 1e16]
    columns = {"i": np.arange(300), "name": np.repeat(np.array(["blocks.0", "b1"]), 150), "x": x,
               "y": (x / 3).astype(np.float32), "k": [7] * 300}
    write_csv_arrays(tmp_path / "arrays.csv", columns)
    rows = [{"i": i, "name": str(columns["name"][i]), "x": float(x[i]), "y": float(columns["y"][i]), "k": 7} for i in range(300)]
    write_csv(tmp_path / "rows.csv", rows)
    assert (tmp_path / "arrays.csv").read_bytes() == (tmp_path / "rows.csv").read_bytes()
    with pytest.raises(ValueError, match="differ in length"):
        write_csv_arrays(tmp_path / "bad.csv", {"a": np.arange(3), "b": np.arange(4)})
    with pytest.raises(ValueError, match="'a' must be one-dimensional"):
        write_csv_arrays(tmp_path / "bad.csv", {"a": np.zeros((2, 2))})
    assert not (tmp_path / "bad.csv").exists()
