"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    import importlib.util

    has_hf = importlib.util.find_spec("transformers") is not None
    for code in blocks:
        if '"hf:' in code and not has_hf:  # the optional extra's example (the dev install includes it)
            continue
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["dense"].shape[-1] == namespace["dense"].shape[-2] == 256
    assert namespace["spec"].positive_mass.shape == (4,)
