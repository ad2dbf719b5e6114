"""Checkpoints written beside a GPU's training, never in its way.

Lightning writes a checkpoint in the training thread: the model's and the optimiser's tensors are copied from the
GPU (waiting for every kernel queued), pickled and written, while no training kernel is launched (about half a
second per ViT-B checkpoint, two checkpoints an epoch). :class:`BackgroundCheckpointIO` instead queues the copies
to reused pinned host buffers (one kernel-ordered copy per tensor, no wait: the values are those of the moment
the checkpoint is taken, since later kernels run after the copies) and hands the writing to one background
thread, which

1. waits for those copies (a CUDA event),
2. calls ``settle(checkpoint)``: the run's own barrier: the Q/K/V callbacks' work of the epochs the checkpoint
   covers is on disk, the figures still pending are listed in it, the loggers are flushed
   (:class:`vitlab.callbacks.RuntimeCallback`), so a run killed at any moment and resumed from this checkpoint
   misses nothing,
3. writes the file as Lightning's own writer does (atomically),

and removes checkpoints in the same order, after the writes queued before (a ``ModelCheckpoint`` that replaces
its best never leaves a moment with neither). Checkpoints saved at the same epoch and step (an epoch's best and
last) share one host copy of the tensors they have in common: the second copies only what changed, and when nothing
changed at all (every tensor shared, every other value equal once settled: ``train.py``'s best and last checkpoints
of an epoch that improved) its file is a hard link to the first's instead of a second write of the same bytes
(a ViT-B checkpoint with its AdamW state is about 1 GB); where links cannot be made it is written. At most
``max_pending`` writes wait (removals, which hold no copy, are not counted): a disk slower than the epochs makes
training wait, not memory grow. Errors of a write
are raised in the training thread at the next call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.apply_func import apply_to_collection
from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO


class BackgroundCheckpointIO(_WrappingCheckpointIO):
    """Writes checkpoints on a background thread from a host copy taken when they are saved.

    Args:
        checkpoint_io: The writer that writes the file (default Lightning's :class:`TorchCheckpointIO`).
        settle: Called on the background thread with the host copy of each checkpoint, after its tensors are
            copied and before it is written; may wait, and may change the copy's plain values.
        max_pending: Writes that may wait before a new save waits for the oldest (default: two epochs of a best and
            a last checkpoint). Removals are not counted: they hold no host copy (a ``ModelCheckpoint`` that replaces
            its best asks for one every epoch, and counting it made the next epoch's save wait for a write that had
            room to wait).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, settle: Callable[[dict[str, Any]], None] | None = None,
                 max_pending: int = 4) -> None:
        super().__init__(checkpoint_io or TorchCheckpointIO())
        self.settle = settle
        self.max_pending = max(1, max_pending)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()  # writes and removals, in the order they were asked for
        self._writes: deque[Future] = deque()  # the writes among them (each holds a host copy)
        self._error: BaseException | None = None
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}  # pinned buffer sets by layout, ready for reuse
        self._latest: _HostCopy | None = None  # the last save's copy (held: the next save of the same step shares it)
        self._lock = threading.Lock()
        self._last_file: tuple | None = None  # (path, step, skeleton, host copy) of the last file written here
        self.links = 0  # checkpoints written as a hard link to the file written before them (the same bytes)
        self.writes = 0
        self.copies = 0  # tensors copied from the checkpoints handed in (a tensor shared with the save before is not)

    # -------------------------------------------------------------------------------------------------- saving
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._raise_error()
        self._wait_writes(self.max_pending - 1)
        host, copies = self._host_copy(checkpoint)
        step = (checkpoint.get("epoch"), checkpoint.get("global_step"))

        def write() -> None:
            try:
                for copy in copies:
                    if copy.event is not None:
                        copy.event.synchronize()
                if self.settle is not None:
                    self.settle(host)
                skeleton = _skeleton(host) if None not in step and self._plain(path, storage_options) else None
                last, self._last_file = self._last_file, None
                if skeleton is not None and last is not None and last[1:3] == (step, skeleton) and _link(last[0], path):
                    self.links += 1  # (the large tensors the very objects the last file holds, every other value equal)
                else:
                    self._write(host, path, storage_options)
                if skeleton is not None:  # (its host copy kept with it: no other tensor takes the identities compared)
                    self._last_file = (str(path), step, skeleton, host)
                self.writes += 1
            except BaseException as exc:  # noqa: BLE001  (raised in the training thread at its next call)
                self._error = self._error or exc
            finally:
                for copy in copies:
                    self._release(copy)

        self._writes.append(self._submit(write))

    def remove_checkpoint(self, path: Any) -> None:
        self._raise_error()

        def remove() -> None:
            if self._last_file is not None and self._last_file[0] == str(path):
                self._last_file = None
            self.checkpoint_io.remove_checkpoint(path)

        self._submit(remove)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        return self.checkpoint_io.load_checkpoint(*args, **kwargs)

    def wait(self) -> None:
        """Block until every write and removal queued so far is done; raise the first error one met."""
        self._wait_pending(0)
        self._raise_error()

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._latest is not None:
                self._release_latest(self._latest)
                self._latest = None
            self._free.clear()
            super().teardown()

    # ------------------------------------------------------------------------------------------------- helpers
    def _plain(self, path: Any, storage_options: Any | None) -> bool:
        """Whether this save is a local file written by Lightning's plain writer (the files :meth:`_write` writes itself)."""
        return type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None and "://" not in str(path)

    def _write(self, host: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        """Lightning's writer, or for its plain writer and a local path the same file written straight to disk.

        Lightning's ``TorchCheckpointIO`` pickles the checkpoint into an in-memory buffer and then writes the buffer:
        growing that buffer, and copying it out, holds the interpreter's lock for much of the write, and the
        training thread on the GPU waits for that lock at every launch. ``torch.save`` into an open file writes
        the same bytes (tested) and holds the lock about a fifth as long (``benchmarks/bench_beside_training.py``)."""
        if not self._plain(path, storage_options):
            self.checkpoint_io.save_checkpoint(host, path, storage_options=storage_options)
            return
        from vitlab.outputs.files import atomic_path

        with atomic_path(path) as tmp, open(tmp, "wb") as handle:
            torch.save(host, handle)

    def _submit(self, job: Callable[[], None]) -> Future:
        if self._executor is None:
            from vitlab.solver_pool import one_thread  # (its copies on one core: see vitlab.solver_pool)

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitlab-checkpoint", initializer=one_thread)
        future = self._executor.submit(job)
        self._pending.append(future)
        return future

    def _wait_pending(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        self._writes = deque(f for f in self._writes if not f.done())

    def _wait_writes(self, keep: int) -> None:
        """Block until at most ``keep`` writes wait (the removals asked for before them run first: one thread)."""
        while len(self._writes) > keep:
            self._writes.popleft().result()
        while self._writes and self._writes[0].done():
            self._writes.popleft()
        while self._pending and self._pending[0].done():
            self._pending.popleft()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _host_copy(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[_HostCopy]]:
        """A copy of ``checkpoint`` whose tensors live in host memory, and the host copies its write holds.

        GPU tensors are copied (queued, non-blocking) to pinned buffers reused across checkpoints of the same layout,
        host tensors cloned (the optimiser updates some in place, e.g. its step counts), other values kept as they
        are. A tensor of the previous save, unchanged (the same memory, the same version, nothing written to it
        since) and saved at the same epoch and step, is not copied again: the epoch's best and last checkpoints
        share one copy of the weights and the optimiser's state (on a GPU, a second copy of about 1 GB for ViT-B
        would hold up the training stream and take as much pinned memory again)."""
        tensors: list[torch.Tensor] = []
        apply_to_collection(checkpoint, torch.Tensor, tensors.append)
        keys = [_identity(t) for t in tensors]
        step = (checkpoint.get("epoch"), checkpoint.get("global_step"))
        latest = self._latest
        shared = latest if latest is not None and None not in step and latest.step == step else None
        if latest is not None and shared is None:
            self._latest = None
            self._release_latest(latest)  # (first: its buffers may be free for this copy)
        index: dict[tuple, torch.Tensor] = {}  # identity -> host copy, of every tensor of this checkpoint
        fresh: list[int] = []  # positions in ``tensors`` of the tensors to copy now
        for i, key in enumerate(keys):
            if key is None or key not in index:
                if shared is not None and key is not None and key in shared.index:
                    index[key] = shared.index[key]
                else:
                    fresh.append(i)
                    if key is not None:
                        index[key] = tensors[i]  # (its copy below)
        on_gpu = [tensors[i] for i in fresh if tensors[i].is_cuda]
        layout = tuple((tuple(t.shape), t.dtype) for t in on_gpu)
        with self._lock:
            sets = self._free.get(layout)
            buffers = sets.pop() if sets else None
        if buffers is None:
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_gpu]
        targets = iter(buffers)
        host_tensors = list(tensors)  # the host tensor of each position
        for i in fresh:
            t = tensors[i].detach()
            if t.is_cuda:
                host_tensors[i] = next(targets)
                host_tensors[i].copy_(t, non_blocking=True)
            else:
                host_tensors[i] = t.clone()
            if keys[i] is not None:
                index[keys[i]] = host_tensors[i]
        for i, key in enumerate(keys):
            if key is not None:
                host_tensors[i] = index[key]
        self.copies += len(fresh)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        own = _HostCopy(step, buffers, layout, event, index, originals=tensors)
        own.borrowed = [] if shared is None else [shared, *shared.borrowed]
        held = [own, *own.borrowed]
        with self._lock:
            for copy in held:
                copy.users += 2  # this save's write, and the record of the latest save (a save of its step may follow)
        self._latest = own  # (a save that failed before here left the latest record as it was)
        if shared is not None:
            self._release_latest(shared)
        positions = iter(host_tensors)
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: next(positions)), held

    def _release_latest(self, latest: _HostCopy) -> None:
        for copy in (latest, *latest.borrowed):
            self._release(copy)

    def _release(self, copy: _HostCopy) -> None:
        """One user less of ``copy``; when none is left its pinned buffers can be reused."""
        with self._lock:
            copy.users -= 1
            if copy.users == 0 and copy.buffers:
                self._free.setdefault(copy.layout, []).append(copy.buffers)


class _HostCopy:
    """The host copies one save made: pinned buffers (of its GPU tensors, ready after ``event``) and clones, by the
    identity of the tensor each copies (``index``: also the tensors it shares with the saves it ``borrowed`` from);
    ``users``: the writes that use it, and the writer's record of the latest save. ``originals`` keeps the tensors
    copied alive, so that no other tensor takes their memory while their copies may be shared."""

    def __init__(self, step: tuple, buffers: list[torch.Tensor], layout: tuple, event: Any, index: dict[tuple, torch.Tensor],
                 originals: list[torch.Tensor]) -> None:
        self.step, self.buffers, self.layout, self.event = step, buffers, layout, event
        self.index, self.originals = index, originals
        self.borrowed: list[_HostCopy] = []
        self.users = 0


def _identity(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same values while both are alive: the same memory, view and version counter
    (every in-place operation bumps it); None for a tensor without a version counter (inference mode) or without
    memory of its own to point at (a tensor subclass): such a tensor is always copied."""
    try:
        return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


SMALL_TENSOR = 1 << 16  # bytes: tensors up to this size are compared by value (random states, figures' arrays)


def _skeleton(host: dict[str, Any]) -> bytes | None:
    """``host`` (a host copy: its tensors on the CPU) pickled with every tensor replaced by its dtype, shape and
    bytes when small, else by the identity of the Python object; None when it does not pickle. Two checkpoints of one
    step with equal skeletons hold the same values (the large tensors are the very host copies a save shares with the
    save before it at the same step; see :meth:`BackgroundCheckpointIO._host_copy`), which ``torch.save`` writes as
    the same bytes. (The caller keeps the compared host copy alive: no other tensor can take its identities.)"""
    import pickle

    def token(t: torch.Tensor) -> tuple:
        if t.numel() * t.element_size() <= SMALL_TENSOR:
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return ("value", str(t.dtype), tuple(t.shape), raw)
        return ("object", id(t), str(t.dtype), tuple(t.shape), t.stride())

    try:
        return pickle.dumps(apply_to_collection(host, torch.Tensor, token), protocol=4)
    except Exception:  # noqa: BLE001  (a value that does not pickle here: the file is written, not linked)
        return None


def _link(previous: str, path: Any) -> bool:
    """Make ``path`` a hard link to the file ``previous`` (atomically: a link beside it, renamed onto it); False
    where that fails (no such file, links not supported, another file system)."""
    import os

    from vitlab.outputs.files import atomic_path

    try:
        with atomic_path(path) as tmp:
            tmp.unlink()
            os.link(previous, tmp)
    except OSError:
        return False
    return True


def settles_checkpoints(checkpoint_io: Any) -> bool:
    """Whether ``checkpoint_io`` waits for the run's background work before it writes (see :class:`BackgroundCheckpointIO`)."""
    return isinstance(checkpoint_io, BackgroundCheckpointIO) and checkpoint_io.settle is not None
