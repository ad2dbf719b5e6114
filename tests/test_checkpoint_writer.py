"""The background checkpoint writer: a copy taken when the checkpoint is saved, written after the run's barrier,
writes and removals in the order they were asked for, errors raised in the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from vitlab.checkpoint_writer import BackgroundCheckpointIO, settles_checkpoints


def test_the_written_checkpoint_holds_the_values_of_the_moment_it_was_saved(tmp_path):
    weights, step = torch.randn(4, 3), torch.tensor(7.0)
    release = threading.Event()
    io = BackgroundCheckpointIO(settle=lambda ckpt: release.wait(10))
    expected = weights.clone()
    io.save_checkpoint({"state_dict": {"w": weights}, "optimizer_states": [{"step": step}], "epoch": 3}, tmp_path / "a.ckpt")
    weights.add_(1.0)  # the training goes on: in-place updates of the weights and the optimiser's step count
    step.add_(1.0)
    assert not (tmp_path / "a.ckpt").exists()  # held by the barrier
    release.set()
    io.wait()
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert torch.equal(ckpt["state_dict"]["w"], expected) and ckpt["optimizer_states"][0]["step"].item() == 7.0
    assert ckpt["epoch"] == 3 and io.writes == 1
    io.teardown()


def test_settle_runs_before_the_write_and_may_change_the_copy(tmp_path):
    order = []

    def settle(ckpt):
        order.append("settle")
        assert not (tmp_path / "a.ckpt").exists()
        ckpt.pop("_private")
        ckpt["callbacks"]["X"]["figures"] = ["late"]

    io = BackgroundCheckpointIO(settle=settle)
    original = {"_private": 1, "callbacks": {"X": {"figures": []}}}
    io.save_checkpoint(original, tmp_path / "a.ckpt")
    io.teardown()
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert order == ["settle"] and "_private" not in ckpt and ckpt["callbacks"]["X"]["figures"] == ["late"]
    assert original["callbacks"]["X"]["figures"] == [] and "_private" in original  # the caller's dict is untouched
    assert settles_checkpoints(io) and not settles_checkpoints(BackgroundCheckpointIO())


def _best_replaced(tmp_path, max_pending: int):
    """A writer whose barrier holds every write until ``release`` is set, asked to write a new best checkpoint and
    to remove the old one (a file already on disk), as a ModelCheckpoint replacing its best does."""
    old = tmp_path / "old.ckpt"
    torch.save({"x": 1}, old)
    release = threading.Event()
    io = BackgroundCheckpointIO(settle=lambda ckpt: release.wait(10), max_pending=max_pending)
    io.save_checkpoint({"x": torch.ones(2)}, tmp_path / "best.ckpt")
    io.remove_checkpoint(old)
    return io, old, release


def test_a_removal_waits_for_the_writes_asked_for_before_it(tmp_path):
    """A ModelCheckpoint that replaces its best writes the new file, then removes the old: never neither."""
    io, old, release = _best_replaced(tmp_path, max_pending=4)
    assert old.exists()  # still: the new one is not written yet
    release.set()
    io.wait()
    assert not old.exists() and (tmp_path / "best.ckpt").exists()
    io.teardown()


def test_at_most_max_pending_writes_wait(tmp_path):
    release, started = threading.Event(), []

    def settle(ckpt):
        started.append(1)
        release.wait(10)

    io = BackgroundCheckpointIO(settle=settle, max_pending=1)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    waiter = threading.Thread(target=io.save_checkpoint, args=({"x": torch.ones(1)}, tmp_path / "b.ckpt"))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # the second save waits for the first write
    release.set()
    waiter.join(10)
    io.teardown()
    assert (tmp_path / "a.ckpt").exists() and (tmp_path / "b.ckpt").exists()


def test_removals_do_not_count_towards_the_writes_that_may_wait(tmp_path):
    """An epoch's best replaced (a write and a removal) and its last saved: the removal holds no copy, so the last's
    save does not wait for the best's write; a third write beyond max_pending does."""
    io, old, release = _best_replaced(tmp_path, max_pending=2)
    last = threading.Thread(target=io.save_checkpoint, args=({"x": torch.ones(1)}, tmp_path / "last.ckpt"))
    last.start()
    last.join(5)
    assert not last.is_alive()  # did not wait: one write was waiting, max_pending - 1 may
    third = threading.Thread(target=io.save_checkpoint, args=({"x": torch.ones(1)}, tmp_path / "next.ckpt"))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # two writes wait: this save waits for the oldest
    release.set()
    third.join(10)
    io.teardown()
    assert not old.exists() and all((tmp_path / f"{n}.ckpt").exists() for n in ("best", "last", "next"))


def test_a_failed_write_is_raised_at_the_next_call(tmp_path):
    def settle(ckpt):
        raise OSError("disk full")

    io = BackgroundCheckpointIO(settle=settle)
    io.save_checkpoint({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    with pytest.raises(OSError, match="disk full"):
        io.wait()
    io.teardown()


def test_pinned_buffers_are_reused_for_checkpoints_of_the_same_layout(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("pinned host buffers are for GPU tensors")
    io = BackgroundCheckpointIO()
    weights = torch.randn(64, 64, device="cuda")
    io.save_checkpoint({"w": weights}, tmp_path / "a.ckpt")
    io.wait()
    (buffers,) = [io._latest.buffers]
    assert buffers[0].is_pinned()
    weights.mul_(2)
    io.save_checkpoint({"w": weights}, tmp_path / "b.ckpt")  # (no step: nothing shared) free once a was written
    io.wait()
    assert io._latest.buffers is buffers
    assert torch.equal(torch.load(tmp_path / "b.ckpt", weights_only=True)["w"], weights.cpu())
    io.teardown()


def checkpoint(step: int, weights: torch.Tensor, moment: torch.Tensor, rng: torch.Tensor) -> dict:
    """What Lightning hands a checkpoint writer, in small: the epoch and step, the model's and the optimiser's
    tensors (the same objects at every save), a tensor made anew at each save (a random generator's state)."""
    return {"epoch": step // 10, "global_step": step, "state_dict": {"w": weights, "w_view": weights[1:]},
            "optimizer_states": [{"state": {0: {"exp_avg": moment}}}], "callbacks": {"R": {"rng": rng}}}


def shared_copy_writes(tmp_path, device: str):
    """Saves of one step with a write held back: best, then last (one tensor updated in place before it); then a
    save of the next step. Returns the writer, what each file must hold and the tensors of each save."""
    torch.manual_seed(0)
    weights, moment = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
    release = threading.Event()
    io = BackgroundCheckpointIO(settle=lambda ckpt: release.wait(10))
    expected = {}
    io.save_checkpoint(checkpoint(20, weights, moment, torch.randn(5)), tmp_path / "best.ckpt")
    expected["best.ckpt"] = (weights.clone(), moment.clone())
    moment.add_(1.0)  # changed in place between two saves of one step (its version counter moves): copied again
    io.save_checkpoint(checkpoint(20, weights, moment, torch.randn(5)), tmp_path / "last.ckpt")
    expected["last.ckpt"] = (weights.clone(), moment.clone())
    assert io.copies == 4 + 2  # w, w_view, exp_avg, rng; then exp_avg and the new rng only
    weights.mul_(2.0)
    io.save_checkpoint(checkpoint(30, weights, moment, torch.randn(5)), tmp_path / "next.ckpt")
    expected["next.ckpt"] = (weights.clone(), moment.clone())
    assert io.copies == 6 + 4  # another step: everything
    release.set()
    io.wait()
    return io, expected


def test_the_saves_of_one_step_share_the_copy_of_what_did_not_change(tmp_path):
    """An epoch's best and last checkpoints are saved at the same epoch and step: the second copies only the tensors
    that are new or were written since (a checkpoint of ViT-B holds about 1 GB of weights and optimiser state)."""
    io, expected = shared_copy_writes(tmp_path, "cpu")
    for name, (weights, moment) in expected.items():
        ckpt = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(ckpt["state_dict"]["w"], weights) and torch.equal(ckpt["state_dict"]["w_view"], weights[1:])
        assert torch.equal(ckpt["optimizer_states"][0]["state"][0]["exp_avg"], moment), name
        assert ckpt["epoch"] in (2, 3) and ckpt["callbacks"]["R"]["rng"].shape == (5,)
    # every copy is released by the writes that used it, except the latest save's (a save of its step may follow)
    assert io._latest.users == 1 and io._latest.borrowed == []
    io.teardown()
    assert io._latest is None


def test_a_chain_of_saves_of_one_step_holds_every_copy_it_shares(tmp_path):
    """A third save of a step shares copies made by the first: they stay held until a save of another step."""
    weights, rng = torch.randn(3), torch.randn(2)
    io = BackgroundCheckpointIO()
    for name in ("a", "b", "c"):
        io.save_checkpoint(checkpoint(5, weights, weights, torch.randn(2)), tmp_path / f"{name}.ckpt")
    io.wait()
    first = io._latest.borrowed[-1]
    # w, w_view (exp_avg: w again, copied once), rng; then the new rng only, twice
    assert [c.users for c in (io._latest, *io._latest.borrowed)] == [1, 1, 1] and io.copies == 3 + 1 + 1
    io.save_checkpoint(checkpoint(6, weights, weights, rng), tmp_path / "d.ckpt")
    io.wait()
    assert first.users == 0 and io._latest.users == 1 and io.copies == 5 + 3
    for name in "abcd":
        assert torch.equal(torch.load(tmp_path / f"{name}.ckpt", weights_only=True)["state_dict"]["w"], weights)
    io.teardown()


def test_a_tensor_without_a_version_counter_is_copied_at_every_save(tmp_path):
    with torch.inference_mode():
        made = torch.arange(3.0)  # (an inference tensor: in-place writes to it are not counted)
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"epoch": 0, "global_step": 1, "x": made}, tmp_path / "a.ckpt")
    with torch.inference_mode():
        made.add_(1.0)
    io.save_checkpoint({"epoch": 0, "global_step": 1, "x": made}, tmp_path / "b.ckpt")
    io.teardown()
    assert io.copies == 2
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["x"].tolist() == [0.0, 1.0, 2.0]
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["x"].tolist() == [1.0, 2.0, 3.0]


def test_the_saves_of_one_step_share_pinned_buffers_held_until_written(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("pinned host buffers are for GPU tensors")
    io, expected = shared_copy_writes(tmp_path, "cuda")
    for name, (weights, moment) in expected.items():
        ckpt = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(ckpt["state_dict"]["w"], weights.cpu()) and torch.equal(ckpt["state_dict"]["w_view"], weights[1:].cpu())
        assert torch.equal(ckpt["optimizer_states"][0]["state"][0]["exp_avg"], moment.cpu()), name
    io.teardown()


def test_local_files_are_written_straight_to_disk_and_are_lightnings_bytes(tmp_path, monkeypatch):
    """For Lightning's plain writer and a local path the file is written by torch.save into the open file (not
    through an in-memory buffer): the bytes Lightning's writer writes; a failed write leaves the previous file."""
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    torch.manual_seed(0)
    ckpt = {"state_dict": {f"w{i}": torch.randn(5, 3) for i in range(4)}, "optimizer_states": [{"step": torch.tensor(2.0)}],
            "epoch": 1, "hyper_parameters": {"lr": 1e-3, "names": ["a", "b"]}}
    TorchCheckpointIO().save_checkpoint(ckpt, tmp_path / "lightning.ckpt")
    io = BackgroundCheckpointIO()
    saved = []
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", lambda self, c, path, storage_options=None: saved.append(path))
    io.save_checkpoint(ckpt, tmp_path / "sub" / "vitlab.ckpt")
    io.wait()
    assert saved == []  # (not Lightning's writer)
    assert (tmp_path / "sub" / "vitlab.ckpt").read_bytes() == (tmp_path / "lightning.ckpt").read_bytes()
    io.save_checkpoint({"bad": threading.Lock()}, tmp_path / "sub" / "vitlab.ckpt")  # a value that does not pickle
    with pytest.raises(TypeError):
        io.wait()
    assert (tmp_path / "sub" / "vitlab.ckpt").read_bytes() == (tmp_path / "lightning.ckpt").read_bytes()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["vitlab.ckpt"]  # no temp file left
    io.save_checkpoint(ckpt, "memory://run/remote.ckpt")  # a remote path: Lightning's writer
    io.wait()
    assert saved == ["memory://run/remote.ckpt"]
    io.teardown()


def _epoch_end(io, tmp_path, weights, epoch, extra=None):
    """An epoch's best and last checkpoints, as train.py's two ModelCheckpoints save them: the same step, the same
    tensors, the same other values (unless ``extra`` changes the last's)."""
    best = {"state_dict": {"w": weights}, "epoch": epoch, "global_step": 10 * epoch, "callbacks": {"cb": {"n": epoch}}}
    last = {**best, "callbacks": {"cb": {"n": epoch, **(extra or {})}}}
    io.save_checkpoint(best, tmp_path / f"best-{epoch}.ckpt")
    io.save_checkpoint(last, tmp_path / "last.ckpt")


def test_an_epochs_last_checkpoint_equal_to_its_best_is_a_hard_link_to_it(tmp_path):
    import os

    weights = torch.randn(8, 8)
    io = BackgroundCheckpointIO(settle=lambda ckpt: None)
    _epoch_end(io, tmp_path, weights, epoch=1)
    io.wait()
    best, last = tmp_path / "best-1.ckpt", tmp_path / "last.ckpt"
    assert io.links == 1 and os.stat(best).st_ino == os.stat(last).st_ino
    assert torch.equal(torch.load(last, weights_only=True)["state_dict"]["w"], weights)
    # the bytes a write of the last checkpoint alone makes
    alone = BackgroundCheckpointIO(settle=lambda ckpt: None)
    alone.save_checkpoint({"state_dict": {"w": weights}, "epoch": 1, "global_step": 10, "callbacks": {"cb": {"n": 1}}},
                          tmp_path / "alone.ckpt")
    alone.teardown()
    assert (tmp_path / "alone.ckpt").read_bytes() == last.read_bytes()
    (tmp_path / "alone.ckpt").unlink()
    # the next epoch: new weights, a new best replaces the old (removed), the last rewritten: no file changed under
    # another's name
    weights.add_(1.0)
    _epoch_end(io, tmp_path, weights, epoch=2)
    io.remove_checkpoint(best)
    io.wait()
    assert not best.exists() and io.links == 2
    assert os.stat(tmp_path / "best-2.ckpt").st_ino == os.stat(last).st_ino
    assert torch.equal(torch.load(last, weights_only=True)["state_dict"]["w"], weights)
    assert torch.load(last, weights_only=True)["epoch"] == 2
    io.teardown()


@pytest.mark.parametrize("change", ["value", "tensor", "settle", "step"])
def test_a_checkpoint_that_differs_from_the_one_before_is_written(tmp_path, change):
    """Any difference writes the file: another plain value, a tensor changed in place between the saves, a value the
    barrier sets differently, another step."""
    import os

    weights = torch.randn(8, 8)
    calls = []

    def settle(ckpt):
        calls.append(1)
        if change == "settle":
            ckpt["callbacks"]["cb"]["pending"] = len(calls)

    io = BackgroundCheckpointIO(settle=settle)
    best = {"state_dict": {"w": weights}, "epoch": 1, "global_step": 10, "callbacks": {"cb": {"n": 1}}}
    io.save_checkpoint(best, tmp_path / "best.ckpt")
    last = {**best, "callbacks": {"cb": {"n": 1}}}
    if change == "value":
        last["callbacks"]["cb"]["n"] = 2
    elif change == "tensor":
        weights.add_(1.0)
    elif change == "step":
        last["global_step"] = 11
    io.save_checkpoint(last, tmp_path / "last.ckpt")
    io.wait()
    assert io.links == 0 and os.stat(tmp_path / "best.ckpt").st_ino != os.stat(tmp_path / "last.ckpt").st_ino
    loaded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], weights)
    io.teardown()


def test_where_links_cannot_be_made_the_checkpoint_is_written(tmp_path, monkeypatch):
    import os

    def no_links(*args, **kwargs):
        raise OSError("links not supported here")

    monkeypatch.setattr(os, "link", no_links)
    weights = torch.randn(4)
    io = BackgroundCheckpointIO(settle=lambda ckpt: None)
    _epoch_end(io, tmp_path, weights, epoch=1)
    io.teardown()
    assert io.links == 0 and torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["w"], weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-1.ckpt", "last.ckpt"]  # (no temp file left)
