"""The nonblocking all-reduce: the synchronous one's bits, many in flight, waited for in any
order, progress while the caller does something else, errors on every rank from wait()."""

from __future__ import annotations

import threading
import time

import fake_cupy
import numpy as np
import pytest
from allreduce_matrix import INT_DTYPES, available_dtypes, lengths_for, make_buffer, rank_input, raw_bytes
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, needs_torch

import collectives
from collectives import ArgumentError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.mark.parametrize("collective", ["ring", "shm"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_case_in_flight_at_once_gives_the_synchronous_bits(size: int, collective: str) -> None:
    """Every op x dtype x length is started before any is waited for, then they are waited
    for last first: each buffer is returned holding, bitwise, what the synchronous
    all-reduce of the same inputs gives (which tests/test_allreduce.py checks against
    MPI_Allreduce and a float64 reference), while the later ones may still be running."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    started = []
    for dtype in available_dtypes():
        for op in collectives.OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            for length in lengths_for(n):
                buf = make_buffer(rank_input(rank, length, op), dtype)
                started.append(((dtype, op, length), buf, collectives.allreduce_async(buf, comm, op, collective)))
    failures = []
    for (dtype, op, length), buf, handle in reversed(started):
        out = handle.wait()
        expected = collectives.allreduce(make_buffer(rank_input(rank, length, op), dtype), comm, op, collective)
        if out is not buf or not handle.test() or raw_bytes(buf) != raw_bytes(expected):
            failures.append(f"{collective} {op} {dtype} len={length} n={n}")
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), failures[:10]


@needs_torch
@pytest.mark.parametrize("size", [2, 3])
def test_torch_tensors_and_synchronize(size: int) -> None:
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    t = torch.full((3, 4), float(rank + 1), requires_grad=True)
    handle = collectives.allreduce_async(t, comm, "avg")
    out = collectives.synchronize(handle)
    assert all_ok(comm, out is t and bool(torch.all(t == (n + 1) / 2)) and t.requires_grad)


@pytest.mark.parametrize("size", [2, 4])
def test_the_call_returns_at_once_and_the_all_reduce_goes_on_without_the_caller(size: int) -> None:
    """The caller issues the all-reduce, then sleeps without calling mpidl: test() turns
    True on its own. One rank issues it 0.3 s late; the others' calls still return at
    once (nothing waits for the peers before wait())."""
    comm = comm_of_size(size)
    rank = comm.Get_rank()
    x = np.full(1 << 16, float(rank))
    collectives.allreduce_async(np.zeros(1), comm).wait()  # the service thread exists
    comm.Barrier()
    if rank == 1:
        time.sleep(0.3)
    t0 = time.perf_counter()
    handle = collectives.allreduce_async(x, comm, "sum", "ring")
    issued = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while not handle.test() and time.monotonic() < deadline:
        time.sleep(0.005)
    n = comm.Get_size()
    ok = handle.test() and issued < 0.1 and bool(np.all(handle.wait() == n * (n - 1) / 2))
    assert all_ok(comm, ok), (issued, handle.test())


@pytest.mark.parametrize("size", [2, 3])
def test_synchronous_collectives_between_the_call_and_wait(size: int) -> None:
    """The nonblocking all-reduces run on a communicator of their own: synchronous
    collectives on the same communicator may come between the call and wait()."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    x, y, z = np.full(1000, rank + 1.0), np.full(10, rank + 1.0), np.full(7, float(rank))
    handle = collectives.allreduce_async(x, comm, "sum", "ring")
    collectives.allreduce(y, comm, "max")
    collectives.broadcast(z, comm, root=n - 1)
    handle.wait()
    ok = bool(np.all(x == n * (n + 1) / 2) and np.all(y == n) and np.all(z == n - 1))
    assert all_ok(comm, ok)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_bad_arguments_raise_from_wait_on_every_rank_and_leave_the_buffer(size: int) -> None:
    """A length that differs on the last rank: the call returns, wait() raises the same
    ArgumentError on every rank, the buffer is untouched; the next all-reduce works."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    x = np.arange(6 if rank < n - 1 else 5, dtype=np.float32) + rank
    before = x.copy()
    handle = collectives.allreduce_async(x, comm, "sum", "ring")
    with pytest.raises(ArgumentError, match="length differs across ranks") as info:
        handle.wait()
    with pytest.raises(ArgumentError):  # again: the same error
        handle.wait()
    text = str(info.value)
    after = collectives.allreduce_async(np.ones(3), comm).wait()
    ok = len(set(comm.allgather(text))) == 1 and np.array_equal(x, before) and bool(np.all(after == n))
    assert all_ok(comm, ok), text


def test_a_buffer_refused_on_one_rank_raises_on_every_rank() -> None:
    comm = comm_of_size(2)
    rank = comm.Get_rank()
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.ones(4) if rank == 0 else np.ones(4, np.complex64)
    handle = collectives.allreduce_async(x, comm)
    with pytest.raises(ArgumentError, match="invalid arguments on rank") as info:
        handle.wait()
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1 and bool(np.all(x == 1))), str(info.value)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_device_buffers_are_reduced_on_their_device(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """CuPy arrays on device 1 (the stand-in, tests/fake_cupy.py): the service thread makes
    device 1 current before it touches them, whatever the caller's device."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    fake_cupy.install(monkeypatch)
    x = fake_cupy.on(1, np.arange(10.0) * (rank + 1))
    collectives.allreduce_async(x, comm, "sum", "ring").wait()
    wrong = [e for e in fake_cupy.elsewhere(1) if e.thread.startswith("allreduce-async")]
    ok = not wrong and np.array_equal(x.host, np.arange(10.0) * n * (n + 1) / 2) and fake_cupy.current() == 0
    assert all_ok(comm, ok), wrong[:3]


def test_the_service_thread_is_one_per_communicator_and_freed_with_it() -> None:
    """A communicator's first nonblocking all-reduce starts its thread; freeing the
    communicator stops it."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    name = f"allreduce-async-rank{world.Get_rank()}"

    def serving() -> int:
        return sum(t.name == name for t in threading.enumerate())

    before = serving()
    collectives.allreduce_async(np.ones(2), comm).wait()
    collectives.allreduce_async(np.ones(2), comm).wait()
    started = serving() - before
    comm.Free()
    assert all_ok(world, started == 1 and serving() == before), (started, serving(), before)
