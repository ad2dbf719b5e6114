"""Checkpoints pickled and written by a child process, their tensors read from shared memory.

``torch.save`` pickles every tensor of a checkpoint in Python (a ViT-B checkpoint with its AdamW state has about
600) and holds the interpreter's lock while it does; a GPU training thread needs that lock at every launch. The
background checkpoint writer (:class:`vitlab.checkpoint_writer.BackgroundCheckpointIO`) therefore copies the
checkpoint's tensors into an :class:`Arena` (anonymous shared memory, ``memfd``, registered with CUDA as pinned
memory so that the copies from the GPU run asynchronously) and hands the rest of the checkpoint, each tensor
replaced by a :class:`Slot`, to :class:`CheckpointProcess`: a child Python process that maps the same memory,
rebuilds the checkpoint and writes it with ``torch.save`` into a temporary file renamed into place (Lightning's
bytes: tested). The training process waits for the child's answer without the lock.

The memory is anonymous: it ends with the last process that maps it (on Linux the kernel ends the child with the
training process), so a killed run leaves nothing behind, whatever the size of ``/dev/shm``. Linux only
(:func:`available`); elsewhere the writer pickles in its thread.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

_ALIGN = 64  # bytes: every tensor starts at a multiple (any dtype's view is aligned)


def available() -> bool:
    """Whether this platform has what the child process needs (``memfd_create``, passing descriptors)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


@dataclass(frozen=True)
class Slot:
    """A tensor of a checkpoint sent to the child: its index in the arena."""

    index: int


class Arena:
    """Shared memory holding one tensor per entry of ``layout`` ((shape, dtype) pairs), as :attr:`views`.

    Args:
        layout: The tensors' shapes and dtypes, in the order of the checkpoint's tensors.
        pin: Register the memory with CUDA as page-locked (copies from the GPU into it run asynchronously); if that
            fails the arena is not :attr:`usable`.
    """

    _next_id = 0

    def __init__(self, layout: list[tuple[tuple[int, ...], torch.dtype]], pin: bool) -> None:
        Arena._next_id += 1
        self.id = Arena._next_id
        self.slots: list[tuple[int, int, str, tuple[int, ...]]] = []  # (offset, numel, dtype name, shape)
        offset = 0
        for shape, dtype in layout:
            numel = 1
            for size in shape:
                numel *= size
            self.slots.append((offset, numel, str(dtype).removeprefix("torch."), tuple(shape)))
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.size = max(offset, mmap.PAGESIZE)
        self.fd = os.memfd_create("vitlab-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.views = [base[o : o + n * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)
                      for (o, n, _, _), (shape, dtype) in zip(self.slots, layout)]
        self._pinned = False
        self.usable = True
        if pin:
            try:
                code = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.size, 0)
                self._pinned = int(getattr(code, "value", code)) == 0
            except Exception:  # noqa: BLE001  (no such call here: not usable, the writer keeps its pinned buffers)
                self._pinned = False
            self.usable = self._pinned
        self._base_ptr = base.data_ptr()
        del base

    def own_copies(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with this arena's views replaced by copies with their own storage (as ``torch.save`` in
        this process must see them: views of one storage would be saved as that whole storage)."""
        from lightning_fabric.utilities.apply_func import apply_to_collection

        views = {id(view) for view in self.views}
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.clone() if id(t) in views else t)

    def close(self) -> None:
        """Unregister and unmap the memory (the child's mapping, if any, keeps its pages until it ends)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base_ptr)
            self._pinned = False
        self.views = []
        try:
            self._map.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CheckpointProcess:
    """The child process that writes checkpoints (see the module docstring). :meth:`write` returns once the file is
    written; safe to call from any thread, one write at a time. The child starts at the first write and ends at
    :meth:`close` (or with the training process). A child that ended is replaced at the next write; after
    :data:`MAX_LOSSES` children ended while writing, :attr:`broken` is set and every write is left to the caller."""

    MAX_LOSSES = 2

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._known: set[int] = set()  # arenas the running child has mapped
        self._lock = threading.Lock()
        self.losses = 0  # children that ended while writing (or could not start)
        self.broken = False

    def write(self, arena: Arena, checkpoint: dict[str, Any], path: str | os.PathLike) -> bool:
        """Write ``checkpoint`` (whose tensors are ``arena``'s views, or plain values) to ``path``. Returns False,
        having written nothing, when the child cannot rebuild it (an object whose class it cannot import, e.g. one
        defined in the training script) or ended (said in one line): the caller writes it itself. An error of the
        write itself (a full disk) is raised here."""
        if self.broken:
            return False
        from lightning_fabric.utilities.apply_func import apply_to_collection

        index = {id(view): i for i, view in enumerate(arena.views)}
        skeleton = apply_to_collection(checkpoint, torch.Tensor, lambda t: Slot(index[id(t)]) if id(t) in index else t)
        body = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                if arena.id not in self._known:
                    _send(self._sock, ("arena", arena.id, arena.size, arena.slots), fd=arena.fd)
                    self._known.add(arena.id)
                _send(self._sock, ("write", arena.id, body, str(path)))
                status, value = _receive(self._sock)
            except (OSError, EOFError):
                self._stop()
                code = None
                if self._proc is not None:
                    try:
                        code = self._proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                self.losses += 1
                self.broken = self.losses >= self.MAX_LOSSES
                print(f"vitlab: the checkpoint writer process ended (exit code {code}) before writing {path}: written by "
                      f"the training process{' from now on' if self.broken else ''}", file=sys.stderr)
                return False
        if status == "error":
            raise value
        return status == "ok"

    def close(self) -> None:
        """End the child (a write in progress is finished first)."""
        with self._lock:
            self._stop(wait=True)

    def _start(self) -> None:
        from vitlab.figure_worker import child_environment

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**child_environment(), "VITLAB_CHECKPOINT_SOCKET": str(theirs.fileno())}
        self._proc = subprocess.Popen([sys.executable, "-c", "from vitlab.checkpoint_process import serve; serve()"],
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._sock, self._known = ours, set()

    def _stop(self, wait: bool = False) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()  # the child ends when its socket does
        if wait and self._proc is not None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._known = set()


def _send(sock: socket.socket, message: Any, fd: int | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if fd is None:
        sock.sendall(b"M")
    else:
        socket.send_fds(sock, [b"F"], [fd])  # (the descriptor travels with this one byte)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _receive(sock: socket.socket) -> Any:
    kind, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not kind:
        raise EOFError
    size = int.from_bytes(_exactly(sock, 8), "little")
    message = pickle.loads(_exactly(sock, size))
    return (message, fds[0]) if kind == b"F" else message


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve() -> None:
    """The child's loop (``python -c "from vitlab.checkpoint_process import serve; serve()"``): map each arena it is
    sent, write each checkpoint it is asked for, answer ``(status, value)``: ``ok``, ``unreadable`` (the
    checkpoint's pickle could not be loaded here) or ``error`` with the exception."""
    from vitlab.figure_worker import child_setup

    child_setup()
    sock = socket.socket(fileno=int(os.environ["VITLAB_CHECKPOINT_SOCKET"]))
    from lightning_fabric.utilities.apply_func import apply_to_collection

    from vitlab.outputs.files import atomic_path

    arenas: dict[int, tuple[mmap.mmap, list]] = {}
    while True:
        try:
            message = _receive(sock)
        except (EOFError, OSError):
            return
        if isinstance(message[0], tuple):  # an arena and its descriptor
            (_, arena_id, size, slots), fd = message
            arenas[arena_id] = (mmap.mmap(fd, size), slots)
            os.close(fd)
            continue
        _, arena_id, body, path = message
        try:
            skeleton = pickle.loads(body)
        except Exception:  # noqa: BLE001  (a class this process cannot import: the training process writes it)
            _send(sock, ("unreadable", None))
            continue
        try:
            memory, slots = arenas[arena_id]

            def tensor(slot: Slot) -> torch.Tensor:
                offset, numel, dtype, shape = slots[slot.index]
                dtype = getattr(torch, dtype)
                if numel == 0:
                    return torch.empty(shape, dtype=dtype)
                return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(shape)

            checkpoint = apply_to_collection(skeleton, Slot, tensor)
            with atomic_path(path) as tmp, open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
            del checkpoint
            answer: tuple[str, Any] = ("ok", None)
        except Exception as exc:  # noqa: BLE001  (sent back: raised where the checkpoint was saved)
            answer = ("error", exc)
        try:
            _send(sock, answer)
        except (pickle.PicklingError, TypeError, AttributeError):
            _send(sock, ("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))


__all__ = ["Arena", "CheckpointProcess", "Slot", "available", "serve"]
