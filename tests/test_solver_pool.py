"""The solver pool: single-threaded torch workers that leave every other thread's setting alone, and the spectra
it solves in chunks, which equal the spectra solved as one batch."""

from __future__ import annotations

import threading

import pytest
import torch

from vitlab.analysis.spectra import _FIELDS, block_spectra
from vitlab.qkv.worker import QKVWorker
from vitlab.solver_pool import SolverPool


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _in_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_pool_threads_run_on_one_thread_and_every_other_thread_keeps_its_count(two_torch_threads):
    before = set(threading.enumerate())
    with SolverPool(3) as pool:
        started = [t for t in set(threading.enumerate()) - before if t.name.startswith("vitlab-solver")]
        assert pool.threads == 3 and len(started) == 3  # (all started in the constructor)
        assert {pool.submit(torch.get_num_threads).result() for _ in range(12)} == {1}
        assert torch.get_num_threads() == 2 and _in_new_thread(torch.get_num_threads) == 2
    with SolverPool() as pool:
        assert pool.threads == 2  # (by default the creating thread's count)


def _random_state(seed: int):
    """Blocks of two shapes (so two groups of problems), random weights of different scales."""
    g = torch.Generator().manual_seed(seed)
    state, heads = {}, {}
    for i, (num_heads, rows, width) in enumerate([(4, 32, 48)] * 3 + [(2, 16, 16)] * 2):
        for m in "qkv":
            state[f"blocks.{i}.{m}.weight"] = torch.randn(rows, width, generator=g) * (0.5 + torch.rand(1, generator=g))
        heads[f"blocks.{i}"] = num_heads
    return state, heads


def _fields(spectra, name):
    return [getattr(s, name) for s in spectra.values()] + [getattr(s.summed, name) for s in spectra.values()]


@pytest.mark.parametrize("antisymmetric", [True, False])
def test_spectra_solved_in_chunks_on_the_pool_equal_one_batch_and_do_not_depend_on_its_size(antisymmetric):
    state, heads = _random_state(seed=7)
    batch = block_spectra(state, heads, antisymmetric=antisymmetric)
    by_size = {}
    for threads in (1, 3, 16):  # (16: more threads than the 3 and 2 head-summed matrices of the two groups)
        with SolverPool(threads) as pool:
            by_size[threads] = block_spectra(state, heads, antisymmetric=antisymmetric, executor=pool)
    assert list(by_size[3]) == list(heads)
    for name in _FIELDS:
        if name == "asym_imag" and not antisymmetric:
            assert all(v is None for v in _fields(by_size[3], name))
            continue
        for one, chunked, wide, whole in zip(*(_fields(by_size[t], name) for t in (1, 3, 16)), _fields(batch, name)):
            assert torch.equal(one, chunked) and torch.equal(one, wide)  # (each problem solved alone, on one core)
            scale = whole.abs().max()
            torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10 * float(scale))  # (vs. multithreaded LAPACK)


def test_the_qkv_worker_sizes_its_pool_where_it_is_made_and_ends_it_with_its_thread(two_torch_threads):
    inline = QKVWorker(background=False)
    pool = inline.solvers
    assert pool.threads == 2 and inline.solvers is pool
    inline.close()
    with pytest.raises(RuntimeError):
        pool.submit(int)
    worker = QKVWorker(background=True)
    worker.submit(lambda: worker.solvers.submit(int).result())
    worker.flush()
    pool, thread = worker._solvers, worker._thread
    worker.close()
    worker.close()  # (a second close leaves the ending to the thread)
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        pool.submit(int)


def test_vitlabs_background_threads_run_torch_on_one_thread_and_leave_the_training_threads(two_torch_threads):
    """A second thread's multithreaded operations would slow the training thread's LAPACK for the rest of the
    process: the Q/K/V worker's and the checkpoint writer's threads run on one."""
    from vitlab.checkpoint_writer import BackgroundCheckpointIO

    worker, seen = QKVWorker(background=True), []
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.flush()
    worker.close()
    io = BackgroundCheckpointIO()
    seen.append(io._submit(torch.get_num_threads).result())
    io.teardown()
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2 and _in_new_thread(torch.get_num_threads) == 2
