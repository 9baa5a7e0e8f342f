"""Broadcast from any root, and Horovod's helpers built on it: exact copies of the root's
bytes on every rank; bad or disagreeing arguments raise the same error on every rank
before anything moved."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from allreduce_matrix import available_dtypes, make_buffer, raw_bytes
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, needs_torch

import algorithms
import collectives
from collectives import ArgumentError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def same_error(comm: MPI.Comm, call, match: str) -> ArgumentError:
    """``call()`` raises an ArgumentError matching ``match``, with the same text on every rank of ``comm``."""
    with pytest.raises(ArgumentError, match=match) as info:
        call()
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1), str(info.value)
    return info.value


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_root_every_dtype_every_length(size: int) -> None:
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    failures = []
    for root in range(n):
        for dtype in available_dtypes():
            for length in (0, 1, max(n - 1, 1), 2 * n + 3, 257):
                values = (np.arange(length) * 3 + 7 * rank) % 11 - 5.0
                buf = make_buffer(values, dtype)
                out = collectives.broadcast(buf, comm, root=root)
                theirs = comm.bcast(raw_bytes(buf) if rank == root else None, root=root)
                if out is not buf or raw_bytes(buf) != theirs:
                    failures.append(f"root {root} {dtype} len={length}")
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), failures[:10]


@pytest.mark.parametrize("size", [2, 3])
def test_device_buffers(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    fake_cupy.install(monkeypatch)
    x = fake_cupy.on(0, np.arange(5.0) + rank)
    collectives.broadcast(x, comm, root=n - 1)
    assert all_ok(comm, np.array_equal(x.host, np.arange(5.0) + n - 1))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_disagreements_raise_everywhere_before_anything_moved(size: int) -> None:
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    last = rank == n - 1
    cases = [
        (np.full(4, float(rank)), {"root": 1 if last else 0}, r"root differs across ranks \(rank 0: 0"),
        (np.full(4 + last, float(rank)), {}, "length differs across ranks"),
        (np.full(4, rank, np.int32 if last else np.int64), {}, "dtype differs across ranks"),
        (np.full(4, float(rank)), {"root": n}, f"root {n} is not a rank of the communicator's {n}"),
        (np.full(4, float(rank)), {"root": -1}, "root -1 is not a rank"),
        (np.full(4, 1j if last else float(rank)), {}, rf"invalid arguments on rank\(s\) \[{n - 1}\]"),
    ]
    for buf, options, match in cases:
        before = buf.copy()
        same_error(comm, lambda buf=buf, options=options: collectives.broadcast(buf, comm, **options), match)
        assert all_ok(comm, np.array_equal(buf, before))


# --- Horovod's helpers --------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("size", [1, 2, 3])
def test_broadcast_parameters_of_a_state_dict_and_of_named_parameters(size: int) -> None:
    """Every tensor of the state (parameters, BatchNorm's float and int64 buffers) ends as
    rank ``root``'s, bit for bit; named_parameters() too."""
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3))  # running statistics of this rank's own
    model[1].num_batches_tracked += rank
    root = n - 1
    algorithms.broadcast_parameters(model.state_dict(), comm, root=root)
    state = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    same = all(theirs == state for theirs in comm.allgather(state))
    torch.manual_seed(10 + rank)
    other = torch.nn.Linear(3, 3)
    algorithms.broadcast_parameters(other.named_parameters(), comm, root=0)
    weights = other.weight.detach().numpy().tobytes()
    assert all_ok(comm, same and len(set(comm.allgather(weights))) == 1 and other.weight.requires_grad)


@needs_torch
@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_parameters_refuses_what_differs_before_anything_moved(size: int) -> None:
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    last = rank == n - 1
    model = torch.nn.Linear(3, 5 if last else 4)
    before = model.weight.detach().clone()
    same_error(
        comm,
        lambda: algorithms.broadcast_parameters(model.state_dict(), comm),
        rf"the tensors of rank {n - 1} and rank 0 differ at entry 0 \(name, shape, dtype\): \('bias', \(5,\)",
    )
    same_error(comm, lambda: algorithms.broadcast_parameters({"w": model.weight}, comm, root=rank), "different roots")
    same_error(
        comm,
        lambda: algorithms.broadcast_parameters({"flags": torch.zeros(2, dtype=torch.bool)}, comm),
        r"a tensor is refused on rank 0: .*unsupported dtype bool",
    )
    assert all_ok(comm, torch.equal(model.weight, before))
