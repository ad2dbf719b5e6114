"""Batches copied to the device one batch ahead (``AheadLoader`` / ``DeviceAhead``): the loader's batches, in its
order, whatever the loader (early-started epochs, loaders Lightning remakes), and a fit that trains the same."""

from __future__ import annotations

import pytest
import torch

from tests.data.test_sampling import DistributedSamplerWrapper, _Keyed, _same, _set_sampler_epoch
from vitlab.data.sampling import AheadLoader, DeviceAhead, EpochLoader, EpochSampler

CUDA = torch.cuda.is_available()


def _loader(cls=EpochLoader, device=None, workers: int = 2):
    sampler = EpochSampler(12, seed=3)
    return cls(_Keyed(), batch_size=4, sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
               generator=torch.Generator().manual_seed(0), pin_memory=CUDA, device=device)


def _batches(batches):
    return [(x.cpu().clone(), i.cpu().clone()) for x, i in batches]


def test_device_ahead_hands_over_the_batches_in_order_and_takes_the_next_one_ahead():
    taken = []

    def source():
        for k in range(3):
            taken.append(k)
            yield {"x": torch.full((2,), float(k)), "k": k}

    ahead = DeviceAhead(source(), "cpu")
    assert taken == [0]  # the first batch is taken (and copied) when the iterator is made
    first = next(ahead)
    assert taken == [0, 1] and first["k"] == 0 and torch.equal(first["x"], torch.zeros(2))
    assert [b["k"] for b in ahead] == [1, 2] and taken == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(ahead)


def test_a_loader_without_a_device_is_a_data_loader():
    loader = _loader(AheadLoader, device=None, workers=0)
    assert not isinstance(iter(loader), DeviceAhead) and loader.device is None


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_an_epoch_loader_copying_ahead_gives_the_batches_of_one_that_does_not(device):
    """Two epochs, the second started early (``start_epoch``), as the training loop runs them: the same batches,
    now on the device."""
    ahead, plain = _loader(device=device), _loader()
    for epoch in (0, 1):
        for loader in (ahead, plain):
            _set_sampler_epoch(loader, epoch)
        handed = iter(ahead)
        assert isinstance(handed, DeviceAhead)
        batches = list(handed)
        assert all(x.device.type == device for x, _ in batches)
        assert _same(_batches(batches), _batches(plain))
        if epoch == 0:
            assert ahead.start_epoch(1) and plain.start_epoch(1)


def test_a_loader_lightning_remakes_keeps_its_device():
    """Under DDP Lightning makes the loader again from its arguments around a distributed sampler."""
    from pytorch_lightning.utilities.data import _update_dataloader

    for cls in (EpochLoader, AheadLoader):
        loader = _loader(cls, device="cpu", workers=0)
        remade = _update_dataloader(loader, DistributedSamplerWrapper(loader.sampler, num_replicas=1, rank=0, shuffle=False))
        assert type(remade) is cls and remade.device == torch.device("cpu")


def test_a_fit_with_batches_copied_ahead_trains_as_one_without(tiny_dataset):
    """A tiny classification fit on the CPU with its loaders copying ahead (to the CPU: the same path without
    streams) against the same fit without: the same weights after the same steps."""
    import pytorch_lightning as pl

    from tests.helpers.runs import TINY_SWIN
    from vitlab.data.datamodule import MedicalDataModule
    from vitlab.training import ClassificationModule

    weights = []
    for ahead in (False, True):
        pl.seed_everything(0)
        data = MedicalDataModule(root=str(tiny_dataset), image_size=32, batch_size=4, augment="default", val_fraction=0.25,
                                 num_workers=1, seed=0)
        module = ClassificationModule(num_classes=2, **TINY_SWIN)
        if ahead:
            data.copy_ahead_device = torch.device("cpu")
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
        trainer.fit(module, datamodule=data)
        assert isinstance(iter(trainer.train_dataloader), DeviceAhead) is ahead
        weights.append({k: v.clone() for k, v in module.state_dict().items()})
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.skipif(not CUDA, reason="CUDA streams")
def test_on_cuda_a_batch_is_read_after_its_copy_and_its_memory_is_not_reused_while_read():
    """A slow consumer (a long kernel queued before it reads each batch) against batches copied ahead on the side
    stream: every batch read is the loader's, although later copies run meanwhile and the earlier batches' memory
    is freed as the consumer goes."""
    host = [torch.randn(256, 1024).pin_memory() for _ in range(16)]
    expected = [h.cuda() for h in host]  # (copied before, the plain way)
    torch.cuda.synchronize()
    wrong = []
    for i, batch in enumerate(DeviceAhead(iter([(h,) for h in host]), "cuda")):
        torch.cuda._sleep(2_000_000)  # (about a millisecond of GPU time before the batch is read)
        wrong.append((batch[0] != expected[i]).sum())  # (elements that differ, counted on the GPU when it reads them)
        del batch
    torch.cuda.synchronize()
    assert [int(w) for w in wrong] == [0] * len(host)


@pytest.mark.skipif(not CUDA, reason="CUDA streams")
def test_on_cuda_the_training_steps_get_the_batches_of_a_fit_without_copying_ahead(tiny_dataset):
    """A fit on the GPU with ``RuntimeCallback(copy_ahead="on")``: every training and validation step sees the
    batch (its images normalised on the device, its labels) that the same fit without it sees."""
    import pytorch_lightning as pl

    from tests.helpers.runs import TINY_SWIN
    from vitlab.callbacks import RuntimeCallback
    from vitlab.data.datamodule import MedicalDataModule
    from vitlab.training import ClassificationModule

    class Recording(ClassificationModule):
        def training_step(self, batch, batch_idx):
            self.seen.append(("train", batch[0].double().sum().item(), batch[1].tolist(), batch[0].device.type))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.seen.append(("val", batch[0].double().sum().item(), batch[1].tolist(), batch[0].device.type))
            return super().validation_step(batch, batch_idx)

    seen = {}
    for ahead in ("off", "on"):
        pl.seed_everything(0)
        data = MedicalDataModule(root=str(tiny_dataset), image_size=32, batch_size=4, augment="default", val_fraction=0.25,
                                 num_workers=2, seed=0)
        module = Recording(num_classes=2, **TINY_SWIN)
        module.seen = []
        runtime = RuntimeCallback(figures="off", copy_ahead=ahead)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[runtime])
        trainer.fit(module, datamodule=data)
        assert (data.copy_ahead_device is not None) is (ahead == "on")
        seen[ahead] = module.seen
    assert seen["on"] == seen["off"] and {s[3] for s in seen["on"]} == {"cuda"}
