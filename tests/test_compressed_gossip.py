"""AD-PSGD's and Prague's compressed gossip (algorithms.pair_gossip): the sum kept at
learning rate 0, the copies of every edge bitwise alike on both ends, an exact codec
averaging as the uncompressed algorithm does, the bytes per exchange, the copies in
checkpoints, and bad specs refused on every rank."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, spread

import algorithms
from algorithms import SGD
from collectives import ArgumentError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DIM = 40
#: One codec of each kind: sparse with scales, shared random indices, stochastic levels,
#: one bit, low rank (of a 5 x 8 layer), a cast.
SPECS = ("topk:0.1", "randk:0.25", "qsgd:15", "sign", "powersgd:1", "fp16")
STEPS = 30
#: The algorithms with compressed gossip: AD-PSGD, Prague in pairs, Prague in groups of 3.
CASES = ("adpsgd", "prague", "prague-3")


def make(case: str, x: np.ndarray, lr: float, comm: MPI.Comm, **options: object) -> algorithms.Algorithm:
    """The algorithm of ``case`` (:data:`CASES`) on ``x``, SGD at ``lr``, with ``options``."""
    if case == "adpsgd":
        return algorithms.ADPSGD(x, SGD(x, lr=lr), comm, **options)
    group = {"group_size": min(3, comm.Get_size())} if case == "prague-3" else {}
    return algorithms.Prague(x, SGD(x, lr=lr), comm, **group, **options)


def run(
    comm: MPI.Comm, spec: str | None, lr: float, steps: int = STEPS, case: str = "adpsgd", **options: object
) -> Any:
    """The algorithm of ``case`` on ``comm`` from per-rank random float64 models
    (``broadcast_init=False``), a 5 x 8 layer, ``steps`` steps with random gradients and
    random per-rank delays; settled."""
    rng = np.random.default_rng([7, comm.Get_rank()])
    x = rng.standard_normal(DIM).reshape(5, 8)
    algo = make(case, x, lr, comm, compression=spec, **{"broadcast_init": False, **options})
    for _ in range(steps):
        time.sleep(rng.uniform(0, 2e-4))
        algo.step(rng.standard_normal((5, 8)))
    algo.settle()
    return algo


def payloads(algo: Any) -> int:
    """The payloads this worker sent: one per AD-PSGD exchange, one to each other member
    of each Prague group."""
    if isinstance(algo, algorithms.ADPSGD):
        return algo.averagings
    return algo.stats.groups * (algo.preduce.group_size - 1)


def edge_copies(algo: Any) -> dict[int, tuple[bytes, bytes]]:
    """Per partner (world rank), this end's two copies of the edge, as bytes."""
    world = algo.comm.allgather(MPI.COMM_WORLD.Get_rank())
    return {world[p]: (e.mine.tobytes(), e.theirs.tobytes()) for p, e in algo.edges.items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_compressed_gossip_keeps_the_sum_at_lr_0(size: int, case: str) -> None:
    """Learning rate 0: every codec's exchanges keep the sum of the workers' models. Each
    exchange of an edge (AD-PSGD's pair; each pair inside a Prague group) adds e to one
    model and subtracts the same e from the other, so the sum moves only by the rounding
    of those two additions: at most 2^-53 |x| each, so at most 2^-52 max|x| per element
    per exchange (the tolerance, over all exchanges; each sends two payloads)."""
    comm = comm_of_size(size)
    failures = []
    for spec in SPECS:
        x0 = np.random.default_rng([7, comm.Get_rank()]).standard_normal(DIM)
        before = comm.allreduce(x0)
        algo = run(comm, spec, lr=0.0, case=case)
        x = algo.flat.params
        exchanges = comm.allreduce(payloads(algo)) // 2
        largest = comm.allreduce(float(max(np.abs(x).max(), np.abs(x0).max())), op=MPI.MAX)
        drift = float(np.abs(comm.allreduce(x.copy()) - before).max())
        if drift > exchanges * 2.0**-52 * largest:
            failures.append(f"{spec}: the sum moved by {drift:.3g} over {exchanges} exchanges")
        if comm.Get_size() > 1 and not exchanges >= STEPS:
            failures.append(f"{spec}: {exchanges} exchanges")
        before_spread, after_spread = spread(comm, x0), spread(comm, x)
        if comm.Get_size() > 1 and not after_spread < before_spread:
            failures.append(f"{spec}: the workers did not move closer: {before_spread:.3g} -> {after_spread:.3g}")
        algo.close()
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_compressed_gossip_edge_copies_agree_bitwise(size: int, case: str) -> None:
    """After training steps (learning rate 0.05, random gradients and delays), both ends of
    every edge hold the same two public copies, bit for bit (each end's own copy is the
    other's copy of it), and each worker sent one payload per exchange of an edge.
    AD-PSGD has an edge per neighbor; Prague one per partner it met."""
    comm = comm_of_size(size)
    me = MPI.COMM_WORLD.Get_rank()
    failures = []
    for spec in SPECS:
        algo = run(comm, spec, lr=0.05, case=case)
        assert algo.compressor is not None
        nbytes = algo.compressor.payload_nbytes(DIM, "float64")
        sent = payloads(algo)
        if algo.bytes_sent != sent * nbytes or sent < (comm.Get_size() > 1):
            failures.append(f"{spec}: {algo.bytes_sent} bytes in {sent} payloads of {nbytes}")
        expected = set(algo.peers) if case == "adpsgd" else set(range(comm.Get_size())) - {comm.Get_rank()}
        if not set(algo.edges) <= expected or (case == "adpsgd" and set(algo.edges) != expected):
            failures.append(f"{spec}: edges {sorted(algo.edges)}, partners {sorted(expected)}")
        copies = dict(comm.allgather((me, edge_copies(algo))))
        for peer, (mine, theirs) in copies[me].items():
            if copies[peer].get(me) != (theirs, mine):
                failures.append(f"{spec}: the copies of the edge with world rank {peer} differ")
        algo.close()
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.parametrize("case", ["adpsgd", "prague"])
@pytest.mark.parametrize("spec", ["fp16", "topk:1", "none"])
def test_an_exact_codec_averages_as_the_uncompressed_algorithm(spec: str, case: str) -> None:
    """A pair of workers, learning rate 0, models of small integers (which fp16 and top-k's
    scaled halves carry exactly, and whose halves are exact): the compressed gossip with
    gamma 1 from copies at 0 ends bitwise where AD-PSGD (Prague) does, at the pair's
    average; "none" is the algorithm itself, sending whole models."""
    comm = comm_of_size(2)
    n, r = comm.Get_size(), comm.Get_rank()
    models, ok = [], True
    for compression in (None, spec):
        x = np.arange(DIM, dtype=np.float32) * (3 * r + 1) - 7 * r
        with make(case, x, 0.0, comm, compression=compression, broadcast_init=False) as algo:
            for _ in range(3):
                algo.step(np.zeros(DIM, np.float32))
            algo.settle()
        models.append(x.tobytes())
        c = algo.compressor
        ok &= (c is None) == (compression in (None, "none")) and algo.gamma == (None if c is None else 1.0)
        ok &= algo.bytes_sent == payloads(algo) * (x.nbytes if c is None else c.payload_nbytes(DIM, "float32"))
        ok &= payloads(algo) == (3 if n == 2 else 0)
    average = np.arange(DIM, dtype=np.float32) * (1 + 3 * (n - 1) / 2) - 3.5 * (n - 1)
    ok &= models[0] == models[1] and (n == 1 or models[0] == average.tobytes())
    assert all_ok(MPI.COMM_WORLD, ok), spec


def test_an_exact_codec_averages_a_group_as_prague() -> None:
    """Groups of 3 (all 3 workers), learning rate 0, float64 models of small integers
    (exact in fp16): with gamma 1 from copies at 0, one exchange moves each member by 1/3
    of the difference to each other member's model, which is Prague's mean up to the
    rounding of those thirds (a few ulps); the sum of the three is kept."""
    comm = comm_of_size(3)
    r = comm.Get_rank()
    models = []
    for compression in (None, "fp16"):
        x = np.arange(DIM, dtype=np.float64) * (3 * r + 1) - 7 * r
        with make("prague-3", x, 0.0, comm, compression=compression, broadcast_init=False) as algo:
            algo.step(np.zeros(DIM))
            algo.settle()
        models.append(x)
    mean = comm.allreduce(np.arange(DIM, dtype=np.float64) * (3 * r + 1) - 7 * r) / comm.Get_size()
    ok = np.allclose(models[1], models[0], rtol=1e-14, atol=1e-13) and np.allclose(models[0], mean, rtol=1e-14)
    assert all_ok(MPI.COMM_WORLD, ok)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [1, 3, 4])
def test_the_copies_are_saved_and_restored(size: int, case: str) -> None:
    """state_dict() holds every edge's two copies (Prague: also where a new edge's copies
    start); a fresh worker (copies at 0, no edge met) that loads the state holds them bit
    for bit."""
    comm = comm_of_size(size)
    algo = run(comm, "topk:0.25", lr=0.05, steps=8, case=case, broadcast_init=True)
    state = algo.state_dict()
    before, peers = edge_copies(algo), sorted(algo.edges)
    origin = algo._origin.tobytes() if case != "adpsgd" else b""
    algo.close()
    y = np.zeros((5, 8))
    with make(case, y, 0.05, comm, compression="topk:0.25", broadcast_init=False) as copy:
        copy.load_state_dict(state)
        after = edge_copies(copy)
        ok = case == "adpsgd" or (copy._origin.tobytes() == origin and any(origin))
    ok &= before == after and state["copy_peers"] == peers and state["copies"].shape[0] == 2 * len(peers)
    ok &= comm.Get_size() == 1 or any(m != bytes(len(m)) for pair in after.values() for m in pair)
    assert all_ok(MPI.COMM_WORLD, ok)


def test_prague_refuses_copies_of_partners_outside_its_communicator() -> None:
    """A state whose edges name ranks this communicator has not (saved on more workers)
    is refused with a ValueError naming them, and no edge is made."""
    comm = comm_of_size(2)
    algo = run(comm, "topk:0.25", lr=0.05, steps=4, case="prague", broadcast_init=True)
    state = {**algo.state_dict(), "copy_peers": [5]}
    algo.close()
    with make("prague", np.zeros((5, 8)), 0.05, comm, compression="topk:0.25") as fresh:
        with pytest.raises(ValueError, match=r"edges with ranks \[5\], not partners among"):
            fresh.load_state_dict(state)
        assert all_ok(MPI.COMM_WORLD, not fresh.edges)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compression": "topk:2"}, r"topk:2: the ratio must be in \(0, 1\]"),
        ({"compression": "zip"}, "unknown compressor 'zip'"),
        ({"compression": "sign@allgather"}, "nothing is aggregated: leave the aggregation out"),
        ({"compression": 3}, "compression must be a spec NAME"),
        ({"compression": "topk:0.1", "gamma": 1.5}, r"gamma, CHOCO-SGD's consensus step size, must be in \(0, 1\]"),
        ({"gamma": 0.5}, "gamma is CHOCO-SGD's consensus step size: it needs a compression"),
    ],
)
@pytest.mark.parametrize("case", ["adpsgd", "prague"])
def test_bad_compression_is_refused_on_every_rank(options: dict, match: str, case: str) -> None:
    comm = comm_of_size(3)
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match=match) as info:
        make(case, x, 0.1, comm, **options)
    assert len(set(comm.allgather(str(info.value)))) == 1


def test_prague_refuses_compression_with_on_failure_continue() -> None:
    """The recovery after a death takes back a group's average, not the edges' copies."""
    comm = comm_of_size(3)
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match="use on_failure='abort' with a compression") as info:
        algorithms.Prague(x, SGD(x, lr=0.1), comm, compression="qsgd:15", on_failure="continue")
    assert len(set(comm.allgather(str(info.value)))) == 1
