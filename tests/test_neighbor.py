"""neighbor_allreduce: exact results against a reference built from every rank's input,
bytes per edge, and clean errors for inconsistent graphs."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import collectives
from collectives import ArgumentError, NeighborWeights, neighbor_allreduce
from collectives.transport.p2p import bytes_sent

pytestmark = pytest.mark.mpi

#: A graph: (rank, size) -> that rank's row. Weights are dyadic, so float results are exact.
Graph = Callable[[int, int], NeighborWeights]


def ring(r: int, n: int) -> NeighborWeights:
    """Undirected ring, self 1/2 and 1/4 per neighbor (1/2 for the single neighbor of n = 2)."""
    others = sorted({(r - 1) % n, (r + 1) % n} - {r})
    return NeighborWeights(0.5, {j: 0.5 / len(others) for j in others})


def directed_ring(r: int, n: int) -> NeighborWeights:
    """Receive from r-1, send to r+1 (not symmetric)."""
    if n == 1:
        return NeighborWeights(1.0, {})
    return NeighborWeights(0.75, {(r - 1) % n: 0.25}, destinations=[(r + 1) % n])


def star(r: int, n: int) -> NeighborWeights:
    """Rank 0 exchanges with everyone, the others only with rank 0 (irregular degrees)."""
    if r == 0:
        return NeighborWeights(1.0 - (n - 1) / 8, {j: 0.125 for j in range(1, n)})
    return NeighborWeights(0.875, {0: 0.125})


def integer_ring(r: int, n: int) -> NeighborWeights:
    """Integer weights for integer buffers: 2 x_i - x_{i-1} + 3 x_{i+1}."""
    left, right = (r - 1) % n, (r + 1) % n
    if n <= 2:
        return NeighborWeights(2, {j: 3 for j in {left, right} - {r}})
    return NeighborWeights(2, {left: -1, right: 3})


GRAPHS = {"ring": ring, "directed_ring": directed_ring, "star": star}


def inputs(rank: int, length: int) -> np.ndarray:
    """Small integers and quarters that differ per rank: exact in every dtype."""
    i = np.arange(length)
    return ((i * 5 + rank * 11) % 13 - 6) / 4


def make(values: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    return values.astype(dtype)


def as_float64(buf) -> np.ndarray:
    if type(buf) is np.ndarray:
        return buf.astype(np.float64)
    return buf.float().numpy().astype(np.float64)


def reference(all_inputs: list[np.ndarray], row: NeighborWeights, rank: int, dtype: str) -> np.ndarray:
    """w_ii x_i + sum_j w_ij x_j in the documented order and precision."""
    if dtype in ("int32", "int64"):
        acc = all_inputs[rank].astype(dtype) * int(row.self_weight)
        for j, w in row.sources:
            acc = acc + all_inputs[j].astype(dtype) * int(w)
        return acc.astype(np.float64)
    work = np.float32 if dtype in ("float16", "bfloat16", "float32") else np.float64
    acc = (all_inputs[rank].astype(work) * work(row.self_weight)).astype(work)
    for j, w in row.sources:
        acc = (acc + (all_inputs[j].astype(work) * work(w)).astype(work)).astype(work)
    return as_float64(make(acc.astype(np.float64), dtype))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("graph", ["ring", "directed_ring", "star"])
def test_matches_reference(graph: str, dtype: str, size: int) -> None:
    comm = comm_of_size(size)
    n, r = comm.Get_size(), comm.Get_rank()
    row = (integer_ring if dtype.startswith("int") and graph == "ring" else GRAPHS[graph])(r, n)
    if dtype.startswith("int") and graph != "ring":
        row = NeighborWeights(3, {j: 2 for j, _ in row.sources}, row.destinations)
    failures = []
    for length in (0, 1, 7, 33):
        mine = inputs(r, length)
        everyone = comm.allgather(mine)
        buf = make(mine, dtype)
        out = neighbor_allreduce(buf, row, comm)
        expected = reference(everyone, row, r, dtype)
        if out is not buf or not np.array_equal(as_float64(buf), expected):
            failures.append(f"length {length}: got {as_float64(buf)}, expected {expected}")
    assert all_ok(MPI.COMM_WORLD, not failures), failures


def test_any_shape_and_torch_in_place() -> None:
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    row = ring(r, n)
    matrix = np.full((3, 5), float(r))
    tensor = torch.nn.Parameter(torch.full((2, 3), float(r)))
    neighbor_allreduce(matrix, row, comm)
    neighbor_allreduce(tensor, row, comm)
    expected = row.self_weight * r + sum(w * j for j, w in row.sources)
    assert all_ok(comm, bool(np.all(matrix == expected)) and bool(torch.all(tensor.detach() == expected)))


@pytest.mark.parametrize("graph", ["ring", "directed_ring", "star"])
def test_one_message_per_edge(graph: str) -> None:
    comm = MPI.COMM_WORLD
    row = GRAPHS[graph](comm.Get_rank(), comm.Get_size())
    x = np.ones(10, np.float32)
    before = bytes_sent()
    neighbor_allreduce(x, row, comm)
    assert all_ok(comm, bytes_sent() - before == len(row.destinations) * x.nbytes)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("validate", [True, False])
def test_fixed_order_bitwise(dtype: str, validate: bool) -> None:
    """Inexact weights and values: the result is bitwise the documented order's
    (self term first, then in-neighbors by ascending rank)."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(r)
    weights = rng.uniform(0.1, 1.0, n)
    row = NeighborWeights(weights[r], {j: weights[j] for j in range(n) if j != r})
    mine = rng.standard_normal(50)
    everyone = comm.allgather(mine)
    x = mine.astype(dtype)
    neighbor_allreduce(x, row, comm, validate=validate)
    assert all_ok(comm, x.tobytes() == reference(everyone, row, r, dtype).astype(dtype).tobytes())


def expect_same_error(comm: MPI.Comm, call, *match: str) -> None:
    """Every rank raises ArgumentError with the same text, containing ``match``."""
    with pytest.raises(ArgumentError) as info:
        call()
    text = str(info.value)
    assert all_ok(comm, len(set(comm.allgather(text))) == 1 and all(m in text for m in match)), text


def last_rank_gets(comm: MPI.Comm, good, bad):
    return bad if comm.Get_rank() == comm.Get_size() - 1 else good


def test_missing_sender_raises_everywhere_buffer_untouched() -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    full = ring(r, n)
    # the last rank stops sending: its right-hand neighbor (rank 0) still expects its data
    row = last_rank_gets(
        comm, full, NeighborWeights(full.self_weight, dict(full.sources), [j for j in full.destinations if j != 0])
    )
    x = np.arange(4.0) + r
    expect_same_error(
        comm,
        lambda: neighbor_allreduce(x, row, comm),
        "inconsistent graph",
        f"rank 0 expects data from rank(s) [{n - 1}]",
        "no data moved",
    )
    assert all_ok(comm, np.array_equal(x, np.arange(4.0) + r))


def test_unexpected_sender_raises_everywhere() -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 3:
        pytest.skip("needs three ranks")
    row = directed_ring(r, n)
    if r == 0:  # also sends to rank 2, which does not expect it
        row = NeighborWeights(row.self_weight, dict(row.sources), [1, 2])
    x = np.ones(3)
    expect_same_error(
        comm, lambda: neighbor_allreduce(x, row, comm), "rank 2 is sent data by rank(s) [0], which it does not list"
    )


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda r, n: NeighborWeights(0.5, {r: 0.5}), "lists itself"),
        (lambda r, n: NeighborWeights(0.5, {n: 0.5}), "outside the communicator"),
        (lambda r, n: NeighborWeights(0.5, {}, destinations=[n + 3]), "outside the communicator"),
        (lambda r, n: NeighborWeights(float("nan"), {}), "finite"),
        (lambda r, n: {"self": 1.0}, "NeighborWeights"),
    ],
)
def test_bad_row_on_one_rank(bad, match: str) -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    row = last_rank_gets(comm, NeighborWeights(1.0, {}), bad(r, n))
    x = np.ones(3)
    expect_same_error(comm, lambda: neighbor_allreduce(x, row, comm), match, f"rank(s) [{n - 1}]")
    assert all_ok(comm, bool(np.all(x == 1)))


def test_length_mismatch_and_fractional_weights_on_integers() -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    x = np.ones(last_rank_gets(comm, 5, 6))
    expect_same_error(comm, lambda: neighbor_allreduce(x, ring(r, n), comm), "length differs")
    ints = np.ones(4, np.int64)
    expect_same_error(comm, lambda: neighbor_allreduce(ints, ring(r, n), comm), "would truncate")
    assert all_ok(comm, bool(np.all(ints == 1)))


def test_exported() -> None:
    assert collectives.neighbor_allreduce is neighbor_allreduce
    assert NeighborWeights(1, {2: 0.5, 1: 0.5}) == NeighborWeights(1.0, {1: 0.5, 2: 0.5}, [2, 1])
