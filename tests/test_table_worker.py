"""The table worker: CSV tables written by a child process are the files the training process writes; its errors
reach the caller; a child that ends is replaced, a table it did not write is written here; it ends when closed."""

from __future__ import annotations

import numpy as np
import pytest

from vitlab.outputs.files import write_csv_arrays
from vitlab.table_worker import TableWorker


class FatalList(list):
    """A column that ends the process that unpickles it (as a child that dies while it reads a table)."""

    def __reduce__(self):
        import os

        return os._exit, (3,)


def test_the_child_writes_the_file_written_here_and_its_errors_reach_the_caller(tmp_path, capfd):
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
        child.kill()  # ended between two tables: the next one starts a new child
        child.wait()
        tables.write(tmp_path / "again.csv", columns)
        assert (tmp_path / "again.csv").read_bytes() == (tmp_path / "here.csv").read_bytes()
        assert tables._proc is not child and tables.losses == 0
        tables.write(tmp_path / "lost.csv", {**columns, "row": FatalList(range(100))})  # ends the child as it reads it
        assert "table writer process ended (exit code 3)" in capfd.readouterr().err and tables.losses == 1
        assert (tmp_path / "lost.csv").read_bytes() == (tmp_path / "here.csv").read_bytes()  # (written here instead)
        tables.write(tmp_path / "again.csv", columns)  # a new child
        child = tables._proc
    finally:
        tables.close()
    assert child.poll() == 0 and tables._proc is None  # ended when its input closed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "again.csv", "child.csv", "here.csv", "lost.csv"]  # no temp
