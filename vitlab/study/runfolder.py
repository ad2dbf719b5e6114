"""Reading a finished or interrupted run folder ``<save_dir>/<name>/<version>``: its config, its TensorBoard
scalars, its Q/K/V snapshots and its checkpoints.

The one place the study launcher and the study report read a run folder (``probe.py claims`` reads ablation
runs through it too); what built the run comes from :mod:`vitlab.runs`, as for every probe. Lightning-free: YAML,
TensorBoard's event reader and ``torch.load`` of plain tensors.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any


class RunFolder:
    """A ``train.py`` run folder (``config.yaml``, event files, ``checkpoints/``, ``qkv/``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def last_checkpoint(self) -> Path | None:
        """``checkpoints/last.ckpt`` when it is there (what a resumed run starts from)."""
        path = self.path / "checkpoints" / "last.ckpt"
        return path if path.is_file() else None

    @cached_property
    def config(self) -> dict[str, Any]:
        """The run's ``config.yaml`` as a dict (empty when it has none yet)."""
        import yaml

        path = self.path / "config.yaml"
        if not path.is_file():
            return {}
        return yaml.safe_load(path.read_text()) or {}

    @cached_property
    def record(self):
        """What built the run (:class:`vitlab.run_record.RunRecord`), read from its ``config.yaml`` through
        :func:`vitlab.runs.config_record` (an older config's by the same inference the probes use); None before the
        run has a config."""
        if not self.config:
            return None
        from vitlab.runs import config_record

        return config_record(self.config, str(self.path / "config.yaml"))[0]

    def removed(self) -> list[str]:
        """The components ``model.ablate.remove`` takes out (empty for an intact model)."""
        record = self.record
        return list(((record.ablate if record is not None else None) or {}).get("remove") or [])

    def num_classes(self) -> int | None:
        """Classes of the head: the recorded network call's ``num_classes``, else the last checkpoint's hyperparameters."""
        record = self.record
        classes = record.model.arguments.get("num_classes") if record is not None else None
        if classes is None and self.last_checkpoint is not None:
            import torch

            ckpt = torch.load(self.last_checkpoint, map_location="cpu", weights_only=True, mmap=True)
            classes = (ckpt.get("hyper_parameters") or {}).get("num_classes")
        return int(classes) if classes else None

    @cached_property
    def _events(self):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(self.path), size_guidance={"scalars": 0})
        acc.Reload()
        return acc

    def scalar_tags(self) -> list[str]:
        return list(self._events.Tags()["scalars"])

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        """(step, value) of a scalar tag in step order; empty when the run never logged it."""
        if tag not in self.scalar_tags():
            return []
        return [(e.step, float(e.value)) for e in self._events.Scalars(tag)]

    def epoch_curve(self, tag: str) -> list[tuple[int, float]]:
        """(epoch, value) of an epoch-level scalar (``val/*``): the epoch Lightning logged at the same step."""
        epochs = dict(self.scalars("epoch"))  # step -> epoch (Lightning logs it with every metric)
        return [(int(epochs[step]) if step in epochs else i, value) for i, (step, value) in enumerate(self.scalars(tag))]

    def snapshots(self) -> list[Path]:
        """The Q/K/V snapshots ``qkv/epoch_NNN.safetensors`` in epoch order."""
        return sorted((self.path / "qkv").glob("epoch_*.safetensors"))
