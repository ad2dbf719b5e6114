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
its best never leaves a moment with neither). At most ``max_pending`` writes wait: a disk slower than the epochs
makes training wait, not memory grow. Errors of a write are raised in the training thread at the next call.
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
        max_pending: Writes (and removals) that may wait before a new save waits for the oldest (default: two
            epochs of a best and a last checkpoint).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, settle: Callable[[dict[str, Any]], None] | None = None,
                 max_pending: int = 4) -> None:
        super().__init__(checkpoint_io or TorchCheckpointIO())
        self.settle = settle
        self.max_pending = max(1, max_pending)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()
        self._error: BaseException | None = None
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}  # pinned buffer sets by layout, ready for reuse
        self._lock = threading.Lock()
        self.writes = 0

    # -------------------------------------------------------------------------------------------------- saving
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._raise_error()
        self._wait_pending(self.max_pending - 1)
        host, buffers, layout, event = self._host_copy(checkpoint)

        def write() -> None:
            try:
                if event is not None:
                    event.synchronize()
                if self.settle is not None:
                    self.settle(host)
                self._write(host, path, storage_options)
                self.writes += 1
            except BaseException as exc:  # noqa: BLE001  (raised in the training thread at its next call)
                self._error = self._error or exc
            finally:
                if buffers:
                    with self._lock:
                        self._free.setdefault(layout, []).append(buffers)

        self._submit(write)

    def remove_checkpoint(self, path: Any) -> None:
        self._raise_error()
        self._submit(lambda: self.checkpoint_io.remove_checkpoint(path))

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
            self._free.clear()
            super().teardown()

    # ------------------------------------------------------------------------------------------------- helpers
    def _write(self, host: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        """Lightning's writer, or for its plain writer and a local path the same file written straight to disk.

        Lightning's ``TorchCheckpointIO`` pickles the checkpoint into an in-memory buffer and then writes the buffer:
        growing that buffer, and copying it out, holds the interpreter's lock for much of the write, and the
        training thread on the GPU waits for that lock at every launch. ``torch.save`` into an open file writes
        the same bytes (tested) and holds the lock about a fifth as long (``benchmarks/bench_beside_training.py``)."""
        if type(self.checkpoint_io) is not TorchCheckpointIO or storage_options is not None or "://" in str(path):
            self.checkpoint_io.save_checkpoint(host, path, storage_options=storage_options)
            return
        from vitlab.outputs.files import atomic_path

        with atomic_path(path) as tmp, open(tmp, "wb") as handle:
            torch.save(host, handle)

    def _submit(self, job: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitlab-checkpoint")
        self._pending.append(self._executor.submit(job))

    def _wait_pending(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()
        while self._pending and self._pending[0].done():
            self._pending.popleft()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _host_copy(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor], tuple, Any]:
        """A copy of ``checkpoint`` whose tensors live in host memory: GPU tensors copied (queued, non-blocking) to
        pinned buffers reused across checkpoints of the same layout, host tensors cloned (the optimiser updates
        some in place, e.g. its step counts), other values copied as they are."""
        tensors: list[torch.Tensor] = []
        apply_to_collection(checkpoint, torch.Tensor, tensors.append)
        on_gpu = [t for t in tensors if t.is_cuda]
        layout = tuple((tuple(t.shape), t.dtype) for t in on_gpu)
        with self._lock:
            sets = self._free.get(layout)
            buffers = sets.pop() if sets else None
        if buffers is None:
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_gpu]
        targets = iter(buffers)

        def copy(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t.detach().clone()
            target = next(targets)
            target.copy_(t.detach(), non_blocking=True)
            return target

        host = apply_to_collection(checkpoint, torch.Tensor, copy)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        return host, buffers, layout, event


def settles_checkpoints(checkpoint_io: Any) -> bool:
    """Whether ``checkpoint_io`` waits for the run's background work before it writes (see :class:`BackgroundCheckpointIO`)."""
    return isinstance(checkpoint_io, BackgroundCheckpointIO) and checkpoint_io.settle is not None
