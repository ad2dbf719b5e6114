"""A progress bar that reads values off the device only at the logging steps.

Lightning converts every value logged with ``prog_bar=True`` and ``on_step=True`` to a Python number after every
training batch, and its default bar (Rich's, since vitlab installs ``rich``) reads them after every batch too. On a
GPU each such read makes the host wait for the step to finish before it launches the next one: the GPU idles while
the host prepares every step. vitlab's tasks therefore log their step loss for the logger only (no ``prog_bar``),
and this bar shows it: it advances its count every batch, but reads ``metrics`` (and whatever is logged with
``prog_bar=True``) at the steps the logger reads them anyway (every ``trainer.log_every_n_steps`` batches), at the
last batch of an epoch and at the epoch's and validation's ends; in between it shows the values last read.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.callbacks import RichProgressBar

__all__ = ["LogStepProgressBar"]


class LogStepProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, reading its values at the logging steps only.

    Args:
        refresh_rate: Redraws per second, at most (Lightning's default: 100). Rich redraws in a thread of the training
            process, in Python: each redraw holds the interpreter's lock, which the training thread, releasing that
            lock at every torch operation, then waits for (``benchmarks/bench_gpu_ladder.py`` measures the bar's
            share of a step).
        leave: Leave the finished epoch's bar on screen (``RichProgressBar``'s).
        theme: Its ``RichProgressBarTheme`` (None: Lightning's).
        console_kwargs: Arguments of Rich's ``Console`` (``RichProgressBar``'s).
        metrics: Logged values to show besides those logged with ``prog_bar=True`` (those of them not logged are
            left out).
    """

    def __init__(self, refresh_rate: int = 2, leave: bool = False, theme: Any = None,
                 console_kwargs: dict[str, Any] | None = None,
                 metrics: tuple[str, ...] | list[str] = ("train/loss", "val/loss")) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, console_kwargs=console_kwargs,
                         **({"theme": theme} if theme is not None else {}))
        self.metrics = tuple(metrics)
        self._read_now = True
        self._shown: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = max(int(trainer.log_every_n_steps), 1)
        total = self.total_train_batches
        last = isinstance(total, int) and batch_idx + 1 >= total
        self._read_now = (batch_idx + 1) % every == 0 or last or trainer.should_stop
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._read_now = True  # (every other caller: epoch ends, validation, test)

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        if self._read_now or self._shown is None:
            shown = super().get_metrics(trainer, pl_module)
            logged = trainer.callback_metrics  # (device tensors: read here, at this step only)
            for name in self.metrics:
                if name in logged and name not in shown:
                    value = logged[name]
                    shown[name] = value.item() if hasattr(value, "item") else value
            self._shown = shown
        return self._shown
