"""Pins the Lightning internals vitlab relies on where Lightning has no public API, so that an upgrade that changes
them fails here, by name, rather than as a resumed run with a missing or doubled TensorBoard point.

- ``trainer.fit_loop.epoch_loop._batches_that_stepped``: the step ``self.log`` writes at (``logging_step``), which
  ``settle_outputs`` lowers by one while it writes the epoch's ``train/*`` metrics, as Lightning's fit loop does;
- ``trainer._logger_connector.update_train_epoch_metrics()``: writes those metrics now, before a checkpoint saved
  in ``on_train_epoch_end`` (Lightning writes them only after that hook) and never again for the same epoch;
- a checkpoint's ``loops/fit_loop/epoch_loop.state_dict/_batches_that_stepped``: the step a resumed run continues
  at (``checkpoint_logging_step``, the TensorBoard purge step).

``vitlab.callbacks.runtime.start_next_epoch`` reads ``trainer.fit_loop._combined_loader.flattened`` (the training
loaders), ``fit_loop.epoch_loop.batch_progress.is_last_batch`` and ``fit_loop.epoch_progress.current.processed``;
``tests/test_runtime.py``'s loader-workers test pins them (a fit whose workers start epoch 1 early, once).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import events, tiny_args
from vitlab.cli import fit
from vitlab.outputs.tensorboard import checkpoint_logging_step, logging_step


@pytest.mark.slow  # (CI runs it: a Lightning upgrade fails here)
def test_the_lightning_internals_vitlab_uses_exist_and_mean_what_it_assumes(tiny_dataset, tmp_path):
    cli = fit(tiny_args(tiny_dataset, tmp_path, epochs=2))
    trainer = cli.trainer
    loop = trainer.fit_loop.epoch_loop
    assert isinstance(loop._batches_that_stepped, int) and loop._batches_that_stepped == trainer.global_step
    assert logging_step(trainer) == trainer.global_step
    assert callable(trainer._logger_connector.update_train_epoch_metrics)

    last = next(tmp_path.rglob("last.ckpt"))
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == ckpt["global_step"]
    assert checkpoint_logging_step(last) == trainer.global_step

    # the epoch's train metrics, written early by settle_outputs before the epoch-end checkpoint: one point per
    # epoch, at the epoch's last batch (the step Lightning gives them), none doubled by Lightning's own write
    acc = events(next(tmp_path.rglob("version_0")))
    steps_per_epoch = trainer.global_step // 2
    for tag in (t for t in acc.Tags()["scalars"] if t.startswith("train/") and t.endswith("_epoch")):
        assert [e.step for e in acc.Scalars(tag)] == [steps_per_epoch - 1, 2 * steps_per_epoch - 1], tag
    assert any(t.startswith("train/") and t.endswith("_epoch") for t in acc.Tags()["scalars"])
