"""Open a training run: a run folder, its ``config.yaml`` or a checkpoint -> the model, the task and the data.

``train.py`` writes each run into ``runs/<name>/<version>/``: ``config.yaml`` (the recipe that repeats the run),
``checkpoints/`` (``last.ckpt``, ``best-*.ckpt``), ``qkv/`` (the Q/K/V snapshots and their tables) and the
TensorBoard event files. Its checkpoints (the ``"vitlab"`` entry) and its ``config.yaml`` (the ``vitlab`` key)
record what built the run, in plain types (:class:`~vitlab.run_record.RunRecord`): the task, the call that built
the network (:class:`~vitlab.run_record.ModelCall`: a :mod:`vitlab.models` builder and its arguments), the ablation
applied after the weights, the class names, and the data module (:class:`~vitlab.run_record.DataRecord`: its
Lightning-free class and the arguments that rebuild it). :func:`open_run` reads that record; nothing is inferred from
state-dict key names.

Checkpoints and configs written before runs recorded themselves hold no record. For them
:func:`~vitlab.run_record.fallback_record` infers one as the probes always did (the task from state-dict key
prefixes, a MONAI segmenter from its ``sliding_window`` hyperparameter, the data arguments the probes read): the one
place that still guesses.

The record and its fallback are in :mod:`vitlab.run_record`; this module reads the files and opens the run
(docs/runs.md). No Lightning here: ``probe.py`` opens runs and must start fast
(``tests/test_startup_imports.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitlab import models
from vitlab.run_record import EMBEDDED, RECORD_KEY, TASKS, DataRecord, RunRecord, fallback_data, fallback_record

__all__ = ["Run", "config_data", "newest_checkpoint", "open_run", "read_checkpoint", "read_config", "recorded_task", "run_folder",
           "run_label"]


# ---------------------------------------------------------------------------------------------- files


def run_folder(path: str | Path) -> Path | None:
    """The run folder ``runs/<name>/<version>`` of a checkpoint in its ``checkpoints/`` (None elsewhere)."""
    path = Path(path).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else None


def run_label(folder: Path | None) -> str | None:
    """``"<name>-<version>"`` of a run folder ``runs/<name>/<version>`` holding a ``config.yaml`` (names probe
    outputs), else None."""
    return f"{folder.parent.name}-{folder.name}" if folder is not None and (folder / "config.yaml").is_file() else None


def newest_checkpoint(runs: str | Path = "runs") -> Path:
    """The newest ``runs/**/checkpoints/last.ckpt`` by modification time (the default model of every probe)."""
    runs = Path(runs)
    found = sorted(runs.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime) if runs.is_dir() else []
    if not found:
        raise FileNotFoundError(
            f"no model given and no trained run in {runs}/ (no {runs}/**/checkpoints/last.ckpt): train one first with "
            "`python train.py --config configs/quickstart.yaml`, or name a model with --checkpoint, --config or --model")
    return found[-1]


def recorded_task(checkpoint: str | Path) -> str | None:
    """The task a checkpoint's run record names, read memory-mapped (no tensor is loaded); None for a checkpoint
    without a record or one torch cannot read (resuming it then reports why)."""
    try:
        content = _load(Path(checkpoint))
    except Exception:  # noqa: BLE001 - Lightning's own load names the problem
        return None
    record = content.get(RECORD_KEY) if isinstance(content, dict) else None
    return str(record["task"]) if isinstance(record, Mapping) and "task" in record else None


def _load(path: Path) -> Any:
    """``torch.load`` with ``weights_only``, memory-mapped (the tensors are read when used: opening a run for its record
    or its tables costs little); a file in torch's legacy format is read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def read_config(path: str | Path) -> dict[str, Any]:
    """A training config (YAML with a ``model`` section)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not readable YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise ValueError(f"{path}: not a vitlab training config (no 'model' section)")
    return cfg


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A vitlab training checkpoint (``weights_only``): a dict with ``state_dict``, and the run record or (older
    checkpoints) the ``hyper_parameters`` that name the model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        content = _load(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file ends in one line
        raise ValueError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    hp = content.get("hyper_parameters") if isinstance(content, dict) else None
    if not isinstance(content, dict) or not isinstance(content.get("state_dict"), Mapping) \
            or (RECORD_KEY not in content and not (isinstance(hp, Mapping) and "model_name" in hp)):
        raise ValueError(f"{path}: not a vitlab training checkpoint (no run record, no model hyperparameters)")
    return content


# ---------------------------------------------------------------------------------------------- the opened run


@dataclass
class Run:
    """A training run opened by :func:`open_run`.

    Attributes:
        record: What built the run.
        recorded: False when :func:`fallback_record` made ``record`` (an older checkpoint / config).
        checkpoint: The checkpoint read (None: a config alone; the model is then untrained).
        config_file: The config read (the run's own ``config.yaml`` when found), or None.
        config: Its content (empty without one).
        hparams: The task module's hyperparameters (the checkpoint's, else the config's ``model`` section).
        state: The checkpoint's state dict (the task module's: ``model.``-prefixed), or None.
    """

    record: RunRecord
    recorded: bool = True
    checkpoint: Path | None = None
    config_file: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    state: dict[str, torch.Tensor] | None = None

    @property
    def task(self) -> str:
        return self.record.task

    @property
    def folder(self) -> Path | None:
        """``runs/<name>/<version>``: the checkpoint's run folder, else the folder of a run's ``config.yaml``."""
        if self.checkpoint is not None:
            return run_folder(self.checkpoint)
        if self.config_file is not None and self.config_file.name == "config.yaml":
            return self.config_file.resolve().parent
        return None

    @property
    def label(self) -> str | None:
        """``"<name>-<version>"`` of the run folder (:func:`run_label`), else None."""
        return run_label(self.folder)

    def model(self, device: str | torch.device = "cpu") -> nn.Module:
        """The network the analyses read (:meth:`~vitlab.run_record.ModelCall.network`), in eval mode on ``device``: the checkpoint's
        weights loaded (none without a checkpoint: untrained), then the run's ablation applied."""
        call, _ = self.record.model.network()
        network = models.build_model(**call)
        if self.state is not None:
            models.load_weights(network, self.state)
        if self.record.ablate:
            models.ablate(network, **self.record.ablate)
        return network.to(device).eval()

    def data(self, **overrides: Any) -> Any:
        """The run's data module (the embedded set when none was recorded), ``overrides`` replacing arguments."""
        return (self.record.data or EMBEDDED).build(**overrides)

    def snapshots(self) -> list[Path]:
        """The run's Q/K/V snapshots (``qkv/epoch_*.safetensors``) in epoch order."""
        folder = self.folder
        return sorted((folder / "qkv").glob("epoch_*.safetensors")) if folder is not None else []

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        """(step, value) of one TensorBoard scalar of the run folder, in logged order (empty when never logged)."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        if self.folder is None:
            return []
        events = EventAccumulator(str(self.folder), size_guidance={"scalars": 0})
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def open_run(path: str | Path | None = None, *, checkpoint: str | Path | None = None,
             config: str | Path | None = None) -> Run:
    """Open a run from ``path`` (a run folder, a config ``.yaml`` or a checkpoint), or from ``checkpoint`` and / or
    ``config`` given apart.

    A checkpoint gives the weights and (its record) the model, task and data; the run folder's ``config.yaml`` is
    read beside it. A config alone gives the weights of ``checkpoints/last.ckpt`` beside it when present, else an
    untrained model. A config given with a checkpoint gives the data (its record's, else its ``data`` section).

    Raises:
        FileNotFoundError / ValueError: one line naming the file (missing, unreadable, not a vitlab run).
    """
    if path is not None:
        path = Path(path)
        if path.is_dir():
            config = path / "config.yaml"
            if not config.is_file():
                raise FileNotFoundError(f"{path}: not a run folder (no config.yaml; expected runs/<name>/<version>)")
        elif path.suffix in (".yaml", ".yml"):
            config = path
        else:
            checkpoint = path
    given = config is not None and checkpoint is not None  # the config's data replaces the checkpoint's
    cfg = read_config(config) if config is not None else None
    if checkpoint is None and config is not None and (Path(config).parent / "checkpoints" / "last.ckpt").is_file():
        checkpoint = Path(config).parent / "checkpoints" / "last.ckpt"
    if checkpoint is None:
        assert cfg is not None, "open_run needs a path, a checkpoint or a config"
        record, recorded = config_record(cfg, str(config))
        return Run(record, recorded, None, Path(config), cfg, dict(cfg["model"]))
    checkpoint = Path(checkpoint)
    content = read_checkpoint(checkpoint)
    folder = run_folder(checkpoint)
    if cfg is None and folder is not None and (folder / "config.yaml").is_file():
        config, cfg = folder / "config.yaml", read_config(folder / "config.yaml")
    hp, state = dict(content.get("hyper_parameters") or {}), dict(content["state_dict"])
    recorded = RECORD_KEY in content
    if recorded:
        record = RunRecord.from_dict(content[RECORD_KEY], str(checkpoint))
    else:
        record = fallback_record(hp, state, (cfg or {}).get("data"))
    if given:
        record = replace(record, data=config_data(cfg, str(config)))
    return Run(record, recorded, checkpoint, None if config is None else Path(config), cfg or {}, hp, state)


def config_record(cfg: dict[str, Any], source: str) -> tuple[RunRecord, bool]:
    """The record of a config (its ``vitlab`` key; else :func:`fallback_record` from its sections) and whether it
    was recorded."""
    if cfg.get(RECORD_KEY) is not None:
        return RunRecord.from_dict(cfg[RECORD_KEY], source), True
    return fallback_record(dict(cfg["model"]), None, cfg.get("data"), _config_task(cfg, source)), False


def config_data(cfg: dict[str, Any], source: str) -> DataRecord | None:
    """The data module of a config (its record's, else :func:`fallback_data` of its ``data`` section)."""
    if cfg.get(RECORD_KEY) is not None:
        return RunRecord.from_dict(cfg[RECORD_KEY], source).data
    return fallback_data(cfg.get("data"), _config_task(cfg, source))


def _config_task(cfg: dict[str, Any], source: str) -> str:
    task = cfg.get("task") or "classification"
    if task not in TASKS:
        raise ValueError(f"{source}: task {task!r} is not one of {', '.join(TASKS)}")
    return task
