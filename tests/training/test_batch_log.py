"""vitlab.training.batch_log: values logged every batch give what Lightning's own ``self.log`` gives.

Two fits of one module, one logging through ``LightningModule.log``, one through :class:`BatchLog`, the same random
values and batch sizes: every TensorBoard point (step and value), ``trainer.callback_metrics`` after every batch and
at the end, and the logged epoch means are equal, bit for bit; and the fast path was taken.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from tests.helpers.runs import all_points
from vitlab.training.batch_log import BatchLog


def value(stage: str, epoch: int, batch_idx: int, which: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * epoch + 10 * batch_idx + which + (500 if stage == "val" else 0))
    return torch.rand((), generator=generator) * 10 ** torch.randint(-3, 3, (), generator=generator)


class Logging(pl.LightningModule):
    def __init__(self, through_batch_log: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))
        self.batch_log = BatchLog() if through_batch_log else None
        self.full_calls = 0

    def log(self, *args, **kwargs):
        self.full_calls += 1
        super().log(*args, **kwargs)

    def _log(self, name, value, **options):
        if self.batch_log is None:
            self.log(name, value, **options)
        else:
            self.batch_log(self, name, value, **options)

    def training_step(self, batch, batch_idx):
        size = batch_idx % 3 + 1  # (unequal batch sizes: the epoch mean is weighted)
        epoch = self.current_epoch
        self._log("train/loss", value("train", epoch, batch_idx, 0), on_step=True, on_epoch=True, batch_size=size)
        self._log("train/other", value("train", epoch, batch_idx, 1), on_step=False, on_epoch=True, batch_size=size,
                  sync_dist=True)
        self._log("train/step_only", value("train", epoch, batch_idx, 2), on_step=True, on_epoch=False, batch_size=size)
        return (self.weight * batch).sum() ** 2

    def validation_step(self, batch, batch_idx):
        self._log("val/loss", value("val", self.current_epoch, batch_idx, 0), on_epoch=True, batch_size=batch_idx % 2 + 1,
                  sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Watch(pl.Callback):
    """``callback_metrics`` after every training batch (what a checkpoint monitor or a bar would read)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in trainer.callback_metrics.items()})


def run(tmp_path, through_batch_log: bool, every: int):
    module, watch = Logging(through_batch_log), Watch()
    trainer = pl.Trainer(max_epochs=3, limit_train_batches=7, limit_val_batches=4, accelerator="cpu", devices=1,
                         log_every_n_steps=every, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[watch],
                         logger=TensorBoardLogger(tmp_path, name=f"fast{through_batch_log}", default_hp_metric=False))
    data = torch.randn(16, 3)
    trainer.fit(module, DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    return trainer, module, watch.seen, all_points(tmp_path / f"fast{through_batch_log}" / "version_0")


@pytest.mark.parametrize("every", [1, 3])
def test_batch_log_gives_what_lightnings_log_gives(tmp_path, every):
    lightning, plain, seen, points = run(tmp_path, False, every)
    fast_trainer, fast, fast_seen, fast_points = run(tmp_path, True, every)

    assert points == fast_points
    assert {f"scalars:{tag}" for tag in ("train/loss_step", "train/loss_epoch", "train/other", "train/step_only",
                                         "val/loss")} <= set(points)
    assert len(seen) == len(fast_seen) == 21
    for before, after in zip(seen, fast_seen):
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), (before, after)
    final, fast_final = lightning.callback_metrics, fast_trainer.callback_metrics
    assert final.keys() == fast_final.keys() and all(torch.equal(final[k], fast_final[k]) for k in final)

    # the epoch mean is the batch-size-weighted mean of the epoch's values, computed independently
    for epoch, (step, logged) in enumerate(points["scalars:train/loss_epoch"]):
        sizes = torch.tensor([b % 3 + 1 for b in range(7)], dtype=torch.float64)
        values = torch.stack([value("train", epoch, b, 0) for b in range(7)]).double()
        assert logged == pytest.approx(float((values * sizes).sum() / sizes.sum()), rel=1e-6)

    # Lightning's call: 3 values x 21 batches + 4 x 3 validation batches; BatchLog's: each value once, then the first
    # value of each later training epoch (where Lightning's call resets the epoch's running values; the validation
    # loop resets its own)
    assert plain.full_calls == 3 * 21 + 4 * 3
    assert fast.full_calls == 3 + 1 + 2


def test_batch_log_is_dropped_when_a_module_is_copied():
    import copy
    import pickle

    log = BatchLog()
    log._known["k"] = (("n",), object())
    assert copy.deepcopy(log)._known == {} and pickle.loads(pickle.dumps(log))._known == {}
