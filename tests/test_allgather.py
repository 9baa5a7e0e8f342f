"""All-gather of per-rank shapes: every rank's rows, in rank order, bit for bit, in a new
array of the input's kind; disagreements raise the same error on every rank before any
data moved."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from allreduce_matrix import available_dtypes, make_buffer
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, needs_torch

import collectives
from collectives import ArgumentError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def rows(rank: int, first: int, rest: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank``'s array: ``first`` rows of shape ``rest``, values exact in every dtype."""
    return (((np.arange(first * int(np.prod(rest, dtype=int))) * 5 + rank * 3) % 13) - 6.0).reshape(first, *rest)


def as_host(buf: object) -> np.ndarray:
    """The array's values as float64, for comparison."""
    if isinstance(buf, np.ndarray):
        return buf.astype(np.float64)
    return buf.float().numpy().astype(np.float64)  # type: ignore[attr-defined]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_per_rank_first_dimensions_every_dtype(size: int) -> None:
    """First dimensions 0, 1, several, different on every rank; later dimensions none, one,
    two, zero; every dtype (bfloat16 as a torch tensor): the concatenation in rank order,
    bitwise the same on every rank."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    failures = []
    for rest in ((), (3,), (2, 5), (0,)):
        for firsts in ([r % 3 for r in range(n)], [2 * r + 1 for r in range(n)], [0] * n):
            for dtype in available_dtypes():
                mine = make_buffer(rows(rank, firsts[rank], rest), dtype)
                out = collectives.allgather(mine, comm)
                expected = np.concatenate([rows(r, firsts[r], rest) for r in range(n)])
                case = f"{dtype} firsts {firsts} rest {rest}"
                if type(out) is not type(mine) or out.dtype != mine.dtype or tuple(out.shape) != expected.shape:
                    failures.append(f"{case}: got {type(out).__name__} {out.dtype} {tuple(out.shape)}")
                elif not np.array_equal(as_host(out), expected):
                    failures.append(f"{case}: wrong values")
                elif len(set(comm.allgather(as_host(out).tobytes()))) != 1:
                    failures.append(f"{case}: ranks differ")
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), failures[:10]


@pytest.mark.parametrize("size", [2, 3])
def test_the_input_is_only_read(size: int) -> None:
    """A read-only, strided, big-endian input is gathered as it is and left alone; the result
    is a native, contiguous array."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    base = rows(rank, 2 * (rank + 1), (4,)).astype(">f4")
    strided = base[::2]
    strided.flags.writeable = False
    out = collectives.allgather(strided, comm)
    expected = np.concatenate([rows(r, 2 * (r + 1), (4,))[::2] for r in range(n)])
    ok = out.dtype == np.float32 and out.dtype.isnative and out.flags.c_contiguous
    ok &= np.array_equal(out, expected) and np.array_equal(base, rows(rank, 2 * (rank + 1), (4,)))
    assert all_ok(comm, ok)


@needs_torch
@pytest.mark.parametrize("size", [2, 3])
def test_torch_tensors(size: int) -> None:
    """A tensor that requires grad gives a plain tensor of its dtype and device."""
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    t = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    out = collectives.allgather(t, comm)
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    assert all_ok(comm, torch.equal(out, expected) and not out.requires_grad and out.dtype == torch.float32)


@pytest.mark.parametrize("size", [2, 3])
def test_device_arrays(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """CuPy arrays (the stand-in, tests/fake_cupy.py) give a CuPy array on the input's device."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    fake_cupy.install(monkeypatch)
    out = collectives.allgather(fake_cupy.on(1, rows(rank, rank + 1, (3,))), comm)
    expected = np.concatenate([rows(r, r + 1, (3,)) for r in range(n)])
    ok = isinstance(out, fake_cupy.ndarray) and out.device.id == 1 and np.array_equal(out.host, expected)
    assert all_ok(comm, ok)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_disagreements_raise_everywhere_before_any_data_moved(size: int) -> None:
    """What must agree is checked: dtype, memory and the dimensions after the first; a
    refused input on one rank raises on all. The inputs are left as they were."""
    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    last = rank == n - 1
    cases = [
        (np.zeros((2, 4 if last else 3)), r"shape after the first dimension differs across ranks \(rank 0: \(3,\)"),
        (np.zeros((2, 3, 1) if last else (2, 3)), "shape after the first dimension differs"),
        (np.zeros(2, np.float32 if last else np.float64), r"dtype differs across ranks \(rank 0: float64"),
        (np.zeros(2, np.bool_ if last else np.float64), rf"on rank\(s\) \[{n - 1}\]: unsupported dtype bool"),
        (np.array(1.0) if last else np.zeros(1), "has no dimension to concatenate along"),
        ([1.0, 2.0] if last else np.zeros(2), "unsupported buffer builtins.list"),
    ]
    for buf, match in cases:
        with pytest.raises(ArgumentError, match=match) as info:
            collectives.allgather(buf, comm)
        text = str(info.value)
        assert all_ok(comm, len(set(comm.allgather(text))) == 1 and "(no data moved)" in text), text
    x = np.arange(3.0)
    collectives.allgather(x, comm)
    assert all_ok(comm, np.array_equal(x, np.arange(3.0)))
