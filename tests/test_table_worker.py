"""The table worker: CSV tables written by a child process are the files the training process writes; its errors
reach the caller; it ends when closed."""

from __future__ import annotations

import numpy as np
import pytest

from vitlab.outputs.files import write_csv_arrays
from vitlab.table_worker import TableWorker


def test_the_child_writes_the_file_written_here_and_its_errors_reach_the_caller(tmp_path):
    rng = np.random.default_rng(1)
    columns = {"block": np.repeat(np.array(["blocks.0", "blocks.1"]), 50), "row": np.arange(100),
               "value": rng.standard_normal(100) * 10.0 ** rng.integers(-9, 9, 100)}
    write_csv_arrays(tmp_path / "here.csv", columns)
    tables = TableWorker()
    try:
        assert tables.write(tmp_path / "child.csv", columns) == tmp_path / "child.csv"
        assert (tmp_path / "child.csv").read_bytes() == (tmp_path / "here.csv").read_bytes()
        (tmp_path / "a_file").write_text("")
        with pytest.raises((FileExistsError, NotADirectoryError)):  # the child's error, raised here
            tables.write(tmp_path / "a_file" / "table.csv", columns)
        with pytest.raises(ValueError, match="differ in length"):
            tables.write(tmp_path / "bad.csv", {"a": np.arange(2), "b": np.arange(3)})
        child = tables._proc
        child.kill()
        child.wait()
        with pytest.raises(RuntimeError, match=r"table worker ended \(exit code -9\) before writing .*again.csv"):
            tables.write(tmp_path / "again.csv", columns)
        tables.write(tmp_path / "again.csv", columns)  # a new child
        assert (tmp_path / "again.csv").read_bytes() == (tmp_path / "here.csv").read_bytes()
        child = tables._proc
    finally:
        tables.close()
    assert child.poll() == 0 and tables._proc is None  # ended when its input closed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "again.csv", "child.csv", "here.csv"]  # no temp left
