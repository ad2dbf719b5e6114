"""A dense batch's target dicts cross from a loader worker to the training process as a few flat tensors and arrive as
the same list of dicts, bit for bit: values, dtypes, shapes (empty ones included) and key order; the label maps travel
as uint8 and the data module's hook after the transfer widens them back to int64."""

from __future__ import annotations

import pickle

import torch

from vitlab.data import DenseDataModule
from vitlab.data.datasets.targets import PackedTargets, widen_label_maps


def _same_targets(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        list(x) == list(y) and all(
            (torch.is_tensor(x[k]) and torch.is_tensor(y[k]) and x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
             and torch.equal(x[k], y[k])) or (not torch.is_tensor(x[k]) and x[k] == y[k]) for k in x)
        for x, y in zip(a, b))


def test_packed_targets_unpickle_as_the_same_list_of_dicts():
    g = torch.Generator().manual_seed(0)
    targets = []
    for n in (2, 0, 3):  # instances per image; an image without any
        targets.append({"mask": torch.randint(0, 3, (8, 8), generator=g), "boxes": torch.rand(n, 4, generator=g),
                        "labels": torch.randint(1, 3, (n,), generator=g), "masks": torch.randint(0, 2, (n, 8, 8), generator=g).to(torch.uint8)})
    targets[1]["name"] = "negative"  # a value that is not a tensor, in one dict only
    targets[2]["score"] = torch.tensor(0.5, dtype=torch.float64)  # a key of one dict
    targets[0]["score"] = torch.tensor(0.25)  # ... of another dtype in another
    out = pickle.loads(pickle.dumps(PackedTargets(targets)))
    assert type(out) is list and _same_targets(out, targets)
    assert out[0]["boxes"].untyped_storage().data_ptr() == out[2]["boxes"].untyped_storage().data_ptr()  # sent as one
    assert pickle.loads(pickle.dumps(PackedTargets([]))) == []
    narrow = PackedTargets(targets)
    narrow.narrow_label_maps = True  # (batches on their way to a GPU)
    out = pickle.loads(pickle.dumps(narrow))
    assert all(t["mask"].dtype == torch.uint8 for t in out) and out[0]["labels"].dtype == torch.int64  # label maps only
    assert _same_targets(widen_label_maps(out), targets)  # ... widened, the same values


def test_label_maps_that_do_not_fit_in_a_byte_travel_as_they_are():
    for low, high in ((0, 300), (-1, 2)):  # (a label above 255; a negative one)
        targets = [{"mask": torch.tensor([[0, 1], [low, high]])}, {"mask": torch.zeros(2, 2, dtype=torch.int64)}]
        packed = PackedTargets(targets)
        packed.narrow_label_maps = True
        out = pickle.loads(pickle.dumps(packed))
        assert all(t["mask"].dtype == torch.int64 for t in out) and _same_targets(out, targets)
    assert widen_label_maps(targets) is targets  # (nothing narrow: the same list)


def test_a_dense_loader_with_workers_gives_the_batches_it_gives_without():
    kwargs = dict(root=None, embedded_kwargs={"patients": 4, "slices": 3, "size": 32, "difficulty": 0.0}, image_size=32,
                  batch_size=4, augment="default", val_fraction=0.34)
    batches = {}
    for workers, narrow in ((0, False), (2, False), (2, True)):  # (narrow: as beside a GPU)
        dm = DenseDataModule(**kwargs, num_workers=workers)
        dm.narrow_label_maps = narrow
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        batches[workers, narrow] = list(loader)
    assert len(batches[0, False]) == len(batches[2, False]) == len(batches[2, True]) > 1
    for (x, t), (y, u), (z, v) in zip(batches[0, False], batches[2, False], batches[2, True]):
        assert type(t) is list and type(u) is list and torch.equal(x, y) and _same_targets(t, u)
        shared = {target["mask"].untyped_storage().data_ptr() for target in u}
        assert len(shared) == 1  # the workers' targets came packed: every label map a view of one tensor
        assert all(target["mask"].dtype == torch.uint8 for target in v)  # a byte a label on the way to a GPU
        z2, v2 = dm.on_after_batch_transfer((z, v), 0)  # what the step sees: int64 again, the same batch
        assert type(v2) is list and torch.equal(x, z2) and _same_targets(t, v2)
        assert dm.on_after_batch_transfer((x, t), 0)[1] is t  # (nothing narrow: nothing to widen)
