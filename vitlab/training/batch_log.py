"""``self.log`` of a value every batch at about a fifteenth of its host cost: the same values, the same logs.

Lightning's ``LightningModule.log`` checks its arguments, builds the value's metadata, compares it with the stored
one, moves the stored result to the value's device (a walk over the result object's attributes, copying its
metadata) and only then adds the value to the running mean. Logging a task's loss that way cost about 0.2-0.6 ms a
step on the host (2 cores; ``benchmarks/bench_step_overhead.py``), the largest part of a step that is vitlab's, and
a host-bound GPU step waits for it.

:class:`BatchLog` makes Lightning's full call the first time a name is logged in a loop, at the first batch of every
epoch (where Lightning resets the loop's running values) and whenever anything differs; in between it passes the
value to the same update Lightning's call ends in (``_ResultCollection.update_metrics``): the same arithmetic on the
same tensors, so the step values, the epoch means, ``trainer.callback_metrics`` and the logger's points are the
values Lightning's own call gives. Lightning has no public API for this: ``tests/training/test_batch_log.py`` fits a
module both ways and compares every logged point and ``callback_metrics`` after every batch, so a Lightning upgrade
that changes these internals fails there.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["BatchLog"]


class BatchLog:
    """Logs values of one LightningModule every batch (see the module docstring)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, Any]] = {}  # key -> (arguments, the stored result's metadata)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # (a pickled or copied module starts afresh: the metadata refers to its trainer)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def __call__(self, module: pl.LightningModule, name: str, value: torch.Tensor, *, batch_size: int,
                 **options: Any) -> None:
        """``module.log(name, value, batch_size=batch_size, **options)``, the same values."""
        arguments = (name, tuple(sorted(options.items())))
        target = self._target(module, name, value, options)
        if target is not None and not module.trainer._logger_connector.should_reset_tensors(target[2]):
            results, key, fx = target
            known = self._known.get(key)
            metric = results.get(key)
            if (known is not None and metric is not None and known[0] == arguments and metric.meta is known[1]
                    and metric.is_tensor and metric.value.device == value.device):
                results.update_metrics(key, value.detach(), batch_size)
                module.trainer._logger_connector._current_fx = fx  # (as Lightning's call leaves it)
                return
        # Lightning's call: the first time, at a loop's first batch (it resets the loop's values), or anything new
        module.log(name, value, batch_size=batch_size, **options)
        if target is not None:
            results, key, _ = target
            metric = results.get(key)
            if metric is not None:
                self._known[key] = (arguments, metric.meta)

    @staticmethod
    def _target(module: pl.LightningModule, name: str, value: Any, options: dict[str, Any]):
        """``(results, key, hook name)`` of a value that may skip Lightning's checks once it is known, else None."""
        trainer = module._trainer
        if (trainer is None or module._fabric is not None or trainer.barebones or options.get("enable_graph")
                or not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point()):
            return None
        results, fx = trainer._results, module._current_fx_name
        if results is None or fx is None:
            return None
        key = f"{fx}.{name}"
        if options.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
            key += f".{results.dataloader_idx}"
        return results, key, fx
