"""TensorBoard: the run's writer, the steps outputs are written at, resume purging, scalars in one event,
PNG images and the custom-scalars layout."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any


def fast_event_checksums() -> bool:
    """Every record of a TensorBoard event file ends with a masked CRC-32C of its bytes, which TensorBoard without
    TensorFlow computes in pure Python, a byte at a time (``tensorboard.compat.tensorflow_stub``), holding the
    interpreter's lock: tens of milliseconds for a figure's PNG, on the event writer's thread beside training (a
    GPU training thread needs that lock at every launch). This puts ``google_crc32c``'s C implementation in its
    place, for writing and for reading event files: the same values (tested against TensorBoard's own function).
    Returns whether it is in place (not when ``google_crc32c`` has no compiled implementation here)."""
    try:
        import google_crc32c
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", None) != "c":
        return False
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    record_writer.masked_crc32c = pywrap_tensorflow.masked_crc32c = masked_crc32c
    return True


def masked_crc32c(data: bytes) -> int:
    """TensorBoard's masked CRC-32C of ``data`` (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow``'s), in C."""
    import google_crc32c

    crc = google_crc32c.value(data if isinstance(data, bytes) else bytes(data))
    return ((((crc >> 15) | ((crc << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF)


def tensorboard_writer(trainer: Any):
    """The ``SummaryWriter`` of the trainer's first TensorBoard logger, or ``None`` when it has none."""
    from pytorch_lightning.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []) or []:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def require_tensorboard(trainer: Any, owner: str) -> None:
    """Raise at ``setup`` when a callback that writes TensorBoard images has no TensorBoard logger."""
    from pytorch_lightning.loggers import TensorBoardLogger

    if not any(isinstance(lg, TensorBoardLogger) for lg in getattr(trainer, "loggers", []) or []):
        raise RuntimeError(
            f"{owner} needs a TensorBoardLogger: set trainer.logger to "
            "pytorch_lightning.loggers.TensorBoardLogger (the vitlab default) instead of "
            f"{[type(lg).__name__ for lg in trainer.loggers] or 'no logger'}"
        )


def logging_step(trainer: Any) -> int:
    """The step Lightning's own ``self.log`` writes at now (batches that stepped; as LearningRateMonitor uses)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step if step is not None else getattr(trainer, "global_step", 0))


def epoch_end_step(trainer: Any) -> int:
    """The step of an epoch's outputs written in ``on_train_epoch_end``: the step Lightning gives the epoch's
    ``val/*`` and ``train/*`` epoch metrics (its last batch), so drift, spectra and accuracy of one epoch
    share one x value, and every output of an epoch lies below the step its checkpoint resumes at."""
    return max(logging_step(trainer) - 1, 0)


def checkpoint_logging_step(ckpt_path: str | os.PathLike) -> int:
    """The logging step a run resumed from ``ckpt_path`` continues at (read without loading the tensors)."""
    import torch

    ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=True, mmap=True)
    loop_state = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    return int(loop_state.get("_batches_that_stepped", ckpt.get("global_step", 0)))


def purge_after_checkpoint(trainer: Any, ckpt_path: str | os.PathLike) -> int | None:
    """Make a resumed run's TensorBoard writers discard what a killed run wrote after its last checkpoint.

    The writer opens with ``purge_step`` = the checkpoint's logging step: TensorBoard drops every event at
    that step or later written before the restart (everything the resumed run logs again), so each tag keeps
    one point per step. Call before the writer is first used (before ``trainer.fit``). Returns the step.
    """
    from pytorch_lightning.loggers import TensorBoardLogger

    loggers = [lg for lg in getattr(trainer, "loggers", []) or [] if isinstance(lg, TensorBoardLogger)]
    if not loggers:
        return None
    step = checkpoint_logging_step(ckpt_path)
    for logger in loggers:
        if logger._experiment is not None:  # opened early: reopen it with the purge step
            logger._experiment.close()
            logger._experiment = None
        logger._kwargs["purge_step"] = step
    return step


def resume_step(trainer: Any) -> int:
    """The step a resumed run continues from (its TensorBoard purge step), or 0 for a fresh run."""
    from pytorch_lightning.loggers import TensorBoardLogger

    steps = [lg._kwargs.get("purge_step") for lg in getattr(trainer, "loggers", []) or [] if isinstance(lg, TensorBoardLogger)]
    return int(next((s for s in steps if s is not None), 0))


def figures_due(trainer: Any, completed_epochs: int, every_n_epochs: int | None = None) -> bool:
    """Whether an epoch's figures are drawn: every N-th completed epoch, the first and the last.

    ``None``: N = ceil(max_epochs / 4), about 5 sets a run (30 epochs: after epochs 1, 8, 16, 24 and 30;
    TensorBoard keeps up to 10 images per tag); every epoch's values are in the scalars and tables.
    """
    max_epochs = getattr(trainer, "max_epochs", None) or 0
    if every_n_epochs is None:
        every_n_epochs = max(1, math.ceil(max_epochs / 4))
    return completed_epochs <= 1 or completed_epochs % every_n_epochs == 0 or (max_epochs > 0 and completed_epochs >= max_epochs)


def add_scalars(writer, values: Mapping[str, float], step: int) -> None:
    """``writer.add_scalar(tag, value, step)`` for every item, written as one event: a Summary holding one value per
    tag, as each ``add_scalar`` event holds one (TensorBoard reads them the same; the Q/K/V callbacks log about
    200 scalars an epoch). A writer without TensorBoard's file writer gets the ``add_scalar`` calls."""
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()]), step)


def write_png(writer, tag: str, png: bytes, step: int, walltime: float | None = None) -> None:
    """An encoded RGB PNG as the image event ``writer.add_image`` would write for it."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step, walltime)


def log_figure(writer, tag: str, step: int, figure, worker=None) -> None:
    """Write a :mod:`vitlab.outputs.figures` object as image ``tag`` at ``step``: through ``worker`` (a
    :class:`vitlab.runtime.FigureWorker`, which keeps and updates the figure between epochs) when given, else
    drawn at once."""
    if worker is not None:
        worker.submit(writer, tag, step, figure)
        return
    from vitlab.outputs.figures import render_png

    write_png(writer, tag, render_png(figure), step)


def write_layout_once(trainer: Any) -> None:
    """Write one merged custom-scalars layout for every callback that offers ``tensorboard_layout()``.

    TensorBoard's custom-scalars plugin reads only the first layout of a run, so callbacks must not each
    write their own: the first one to log calls this and the layouts of all of them are merged. Written once per
    run, at the step it is first due: a resumed run does not write it again.
    """
    writer = tensorboard_writer(trainer)
    if writer is None or getattr(writer, "_vitlab_layout_written", False):
        return
    layout: dict[str, Any] = {}
    for callback in getattr(trainer, "callbacks", []):
        make = getattr(callback, "tensorboard_layout", None)
        if callable(make):
            layout.update(make())
    if layout and resume_step(trainer) == 0:  # once per run: a resumed run's first start wrote it (before any checkpoint)
        from torch.utils.tensorboard.summary import custom_scalars

        writer._get_file_writer().add_summary(custom_scalars(layout), logging_step(trainer))
    writer._vitlab_layout_written = True


def written_images(log_dir: str | os.PathLike) -> Counter[tuple[str, int]]:
    """How many images of each ``(tag, step)`` the event files of ``log_dir`` hold, as TensorBoard reads them back:
    a resumed writer's restart marker (its ``purge_step``) drops the images at that step or later written before
    it; a record cut short by a kill ends its file."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    images: Counter[tuple[str, int]] = Counter()
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):  # (the names begin with the time they were opened)
        for event in LegacyEventFileLoader(str(path)).Load():  # (as written: the other loader migrates images to tensors)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                images = Counter({key: n for key, n in images.items() if key[1] < event.step})
            for value in event.summary.value:
                if value.HasField("image"):
                    images[(value.tag, event.step)] += 1
    return images
