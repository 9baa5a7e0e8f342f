"""AD-PSGD's compressed gossip (algorithms.pair_gossip): the sum kept at learning rate 0,
the copies of every edge bitwise alike on both ends, an exact codec averaging as AD-PSGD
does, the bytes per exchange, and bad specs refused on every rank."""

from __future__ import annotations

import time

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


def run(comm: MPI.Comm, spec: str | None, lr: float, steps: int = STEPS, **options: object) -> algorithms.ADPSGD:
    """AD-PSGD on ``comm`` from per-rank random float64 models (``broadcast_init=False``),
    a 5 x 8 layer, ``steps`` steps with random gradients and random per-rank delays; settled."""
    rng = np.random.default_rng([7, comm.Get_rank()])
    x = rng.standard_normal(DIM).reshape(5, 8)
    algo = algorithms.ADPSGD(x, SGD(x, lr=lr), comm, compression=spec, broadcast_init=False, **options)
    for _ in range(steps):
        time.sleep(rng.uniform(0, 2e-4))
        algo.step(rng.standard_normal((5, 8)))
    algo.settle()
    return algo


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_compressed_adpsgd_keeps_the_sum_at_lr_0(size: int) -> None:
    """Learning rate 0: every codec's exchanges keep the sum of the workers' models. Each
    exchange adds e to one model and subtracts the same e from the other, so the sum moves
    only by the rounding of those two additions: at most 2^-53 |x| each, so at most
    2^-52 max|x| per element per exchange (the tolerance, over all exchanges)."""
    comm = comm_of_size(size)
    failures = []
    for spec in SPECS:
        x0 = np.random.default_rng([7, comm.Get_rank()]).standard_normal(DIM)
        before = comm.allreduce(x0)
        algo = run(comm, spec, lr=0.0)
        x = algo.flat.params
        exchanges = comm.allreduce(algo.averagings if algo.active else 0)
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


@pytest.mark.parametrize("size", [2, 3, 4])
def test_compressed_adpsgd_edge_copies_agree_bitwise(size: int) -> None:
    """After training steps (learning rate 0.05, random gradients and delays), both ends of
    every edge hold the same two public copies, bit for bit (each end's own copy is the
    other's copy of it), and each worker sent one payload per exchange."""
    comm = comm_of_size(size)
    failures = []
    for spec in SPECS:
        algo = run(comm, spec, lr=0.05)
        assert algo.compressor is not None
        nbytes = algo.compressor.payload_nbytes(DIM, "float64")
        if algo.bytes_sent != algo.averagings * nbytes or algo.averagings < (comm.Get_size() > 1):
            failures.append(f"{spec}: {algo.bytes_sent} bytes in {algo.averagings} exchanges of {nbytes}")
        if set(algo.edges) != set(algo.peers):
            failures.append(f"{spec}: edges {sorted(algo.edges)}, neighbors {algo.peers}")
        mine = {p: (e.mine.tobytes(), e.theirs.tobytes()) for p, e in algo.edges.items()}
        for peer in algo.peers:  # active to passive: the passive compares
            if algo.active:
                comm.send(mine[peer], dest=peer, tag=6)
            else:
                theirs_copy, my_copy = comm.recv(source=peer, tag=6)
                if (my_copy, theirs_copy) != mine[peer]:
                    failures.append(f"{spec}: the copies of the edge with rank {peer} differ")
        algo.close()
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.parametrize("spec", ["fp16", "topk:1", "none"])
def test_an_exact_codec_averages_as_adpsgd(spec: str) -> None:
    """A pair of workers, learning rate 0, models of small integers (which fp16 and top-k's
    scaled halves carry exactly, and whose halves are exact): the compressed gossip with
    gamma 1 from copies at 0 ends bitwise where AD-PSGD does, at the pair's average; "none"
    is AD-PSGD itself, sending whole models."""
    comm = comm_of_size(2)
    n, r = comm.Get_size(), comm.Get_rank()
    models, ok = [], True
    for compression in (None, spec):
        x = np.arange(DIM, dtype=np.float32) * (3 * r + 1) - 7 * r
        with algorithms.ADPSGD(x, SGD(x, lr=0.0), comm, compression=compression, broadcast_init=False) as algo:
            for _ in range(3):
                algo.step(np.zeros(DIM, np.float32))
            algo.settle()
        models.append(x.tobytes())
        c = algo.compressor
        ok &= (c is None) == (compression in (None, "none")) and algo.gamma == (None if c is None else 1.0)
        ok &= algo.bytes_sent == algo.averagings * (x.nbytes if c is None else c.payload_nbytes(DIM, "float32"))
        ok &= algo.averagings == (3 if n == 2 else 0)
    average = np.arange(DIM, dtype=np.float32) * (1 + 3 * (n - 1) / 2) - 3.5 * (n - 1)
    ok &= models[0] == models[1] and (n == 1 or models[0] == average.tobytes())
    assert all_ok(MPI.COMM_WORLD, ok), spec


@pytest.mark.parametrize("size", [1, 3, 4])
def test_the_copies_are_saved_and_restored(size: int) -> None:
    """state_dict() holds every edge's two copies; a fresh worker (copies at 0) that loads
    the state holds them bit for bit."""
    comm = comm_of_size(size)
    algo = run(comm, "topk:0.25", lr=0.05, steps=8)
    state = algo.state_dict()
    before = {p: (e.mine.tobytes(), e.theirs.tobytes()) for p, e in algo.edges.items()}
    algo.close()
    y = np.zeros((5, 8))
    with algorithms.ADPSGD(y, SGD(y, lr=0.05), comm, compression="topk:0.25", broadcast_init=False) as copy:
        copy.load_state_dict(state)
        after = {p: (e.mine.tobytes(), e.theirs.tobytes()) for p, e in copy.edges.items()}
    ok = (
        before == after
        and state["copy_peers"] == sorted(algo.peers)
        and state["copies"].shape[0] == 2 * len(algo.peers)
    )
    ok &= comm.Get_size() == 1 or any(m != bytes(len(m)) for pair in after.values() for m in pair)
    assert all_ok(MPI.COMM_WORLD, ok)


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
def test_bad_compression_is_refused_on_every_rank(options: dict, match: str) -> None:
    comm = comm_of_size(3)
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match=match) as info:
        algorithms.ADPSGD(x, SGD(x, lr=0.1), comm, **options)
    assert len(set(comm.allgather(str(info.value)))) == 1
