"""Asynchronous training algorithms (AD-PSGD, GR-SGD, Prague): atomicity under random
delays on 1..8 ranks, settle(), the byte counts, GR-SGD's lead bound, half precision,
and configuration errors raised on every rank."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
from async_check import CONFIGS, check
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, mpiexec, on_rank0_quietly

import algorithms
import collectives
from algorithms import SGD, topology
from collectives import ArgumentError

pytestmark = pytest.mark.mpi

DIM = 12


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_sum_is_preserved_and_workers_agree(size: int) -> None:
    """Learning rate 0, random per-rank speeds: every configuration keeps the sum of the
    workers' parameters (after a settle() halfway and after close()) and reaches consensus."""
    comm = comm_of_size(size)
    failures = []
    for name, options in CONFIGS:
        failures += check(comm, name, options, steps=200)[0]
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.parametrize("size", [5, 6, 7, 8])
def test_sum_is_preserved_and_workers_agree_large_communicators(size: int) -> None:
    """5..8 ranks, under their own mpiexec: a thousand exchanges or more per configuration."""
    proc = on_rank0_quietly(mpiexec, size, ["tests/async_check.py", "--steps", "200"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    counts = list(json.loads(proc.stdout.strip().splitlines()[-1].split(" ", 1)[1]).values())
    assert min(counts[:3]) >= 1000, proc.stdout  # AD-PSGD and GR-SGD: thousands of pairwise exchanges


@pytest.mark.timeout(60)
def test_aware_adpsgd_averages_inside_its_node_and_across_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of two ranks, the complete bipartite graph: an active worker alternates between
    its node mate and a neighbor on the other node (cross_every=2); the sum is kept."""
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "2")
    comm = comm_of_size(4)
    if comm.Get_size() != 4:
        pytest.skip("needs 4 ranks: two nodes of two")
    x = np.full(DIM, float(comm.rank))
    total = comm.allreduce(float(x.sum()))
    peers = []
    with algorithms.create(
        "adpsgd", x, SGD(x, lr=0.0), comm, topology="bipartite", partner="aware", broadcast_init=False
    ) as algo:
        for _ in range(6):
            algo.step(np.zeros(DIM))
            peers.append(algo.last_peer)
        algo.settle()
        kept = abs(comm.allreduce(float(x.sum())) - total) <= 1e-9 * total
    mate, away = comm.rank + 1, 3 - comm.rank  # active ranks 0 and 2: passive 1 and 3
    expected = [mate, away] * 3
    assert all_ok(comm, kept and (not algo.active or peers == expected)), peers


def test_which_algorithms_take_uneven_steps() -> None:
    comm = MPI.COMM_WORLD
    flags = {}
    for name, options in [
        ("adpsgd", {}),
        ("grsgd", {}),
        ("prague", {}),
        ("prague", {"policy": "static"}),
        ("dpsgd", {}),
        ("allreduce", {"collective": "ring"}),
    ]:
        x = np.zeros(DIM)
        with algorithms.create(name, x, SGD(x, lr=0.1), comm, **options) as algo:
            flags[f"{name} {options}"] = algo.uneven_steps
    assert flags == {
        "adpsgd {}": True,
        "grsgd {}": False,
        "prague {}": True,
        "prague {'policy': 'static'}": False,
        "dpsgd {}": False,
        "allreduce {'collective': 'ring'}": False,
    }


@pytest.mark.parametrize("size", [2, 3, 4])
def test_adpsgd_sides_bytes_and_pairwise_identity(size: int) -> None:
    """Even ranks are active; each averaging costs each side one model; an active worker's
    model equals its partner's right after an averaging with lr 0 (bitwise)."""
    comm = comm_of_size(size)
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.random.default_rng(r).standard_normal(DIM)
    algo = algorithms.ADPSGD(x, SGD(x, lr=0.0), comm, broadcast_init=False)
    for _ in range(30):
        algo.step(np.zeros(DIM))
    algo.settle()
    expected_topology = "ring" if n % 2 == 0 else "bipartite"
    ok = (
        algo.active == (r % 2 == 0)
        and algo.topology.name.startswith(expected_topology)
        and all(p % 2 != r % 2 for p in algo.peers)
        and algo.bytes_sent == algo.averagings * x.nbytes
    )
    active_total = comm.allreduce(algo.averagings if algo.active else 0)
    passive_total = comm.allreduce(0 if algo.active else algo.averagings)
    ok &= active_total == passive_total == 30 * ((n + 1) // 2 if n > 1 else 0)
    # One more averaging from a settled state: the pair ends bitwise identical.
    algo.step(np.zeros(DIM))
    algo.settle()
    if algo.active:
        for peer in algo.peers:
            comm.send(x.tobytes() if peer == algo.last_peer else None, dest=peer, tag=5)
    else:
        got = [m for m in (comm.recv(source=s, tag=5) for s in algo.peers) if m is not None]
        ok &= not got or x.tobytes() in got  # equal to the last active worker it averaged with
    algo.close()
    assert all_ok(MPI.COMM_WORLD, ok), (r, algo.active, algo.peers, algo.bytes_sent, algo.averagings)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 4])
def test_adpsgd_settle_waits_for_every_active_neighbor(size: int) -> None:
    """Rounds of steps and settle() with no collective between them, rank 2 slow: after each
    settle() a passive worker has served every averaging its active neighbors started before
    theirs (they tell it how many), although a fast active neighbor's next end markers come
    early (counted from any neighbor, two of rank 0's stood in for rank 2's)."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    x = np.zeros(DIM)
    algo = algorithms.ADPSGD(x, SGD(x, lr=0.0), comm, broadcast_init=False)
    started = dict.fromkeys(algo.peers, 0)
    ok = True
    for _ in range(3):
        for _ in range(8):
            time.sleep(0.003 if r == 2 else 0.0)
            algo.step(np.zeros(DIM))
            if algo.last_peer is not None:
                started[algo.last_peer] += 1
        algo.settle()
        if algo.active:
            for peer in algo.peers:
                comm.send(started[peer], dest=peer, tag=7)
        else:
            served = sum(comm.recv(source=peer, tag=7) for peer in algo.peers)
            ok &= algo.averagings >= served  # more: a fast neighbor's next averagings, served meanwhile
    algo.close()
    assert all_ok(MPI.COMM_WORLD, ok), (r, algo.averagings)


def test_adpsgd_caller_never_reads_a_partial_averaging() -> None:
    """The caller reads its model (as a forward pass does) while a service thread averages
    it: with lr 0 every value read lies between the workers' initial values (a partial
    result, such as the pair's sum before the division, would not)."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(1 << 16, float(r + 1))
    algo = algorithms.ADPSGD(x, SGD(x, lr=0.0), comm, broadcast_init=False)
    low, high = 1.0, float(n)
    for _ in range(150):
        algo.step(np.zeros_like(x))
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:
            low, high = min(low, float(x.min())), max(high, float(x.max()))
    algo.close()
    assert all_ok(comm, low >= 1.0 and high <= n), (r, low, high)


@pytest.mark.timeout(60)
def test_adpsgd_serves_only_after_the_initial_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's initial broadcast comes a second late while the active workers step (lr 0;
    a small model, which rank 0 sends without waiting for rank 1): no averaging reads a
    passive worker's own parameters before rank 0's overwrite them, so every worker ends
    with rank 0's, the sum exactly n times theirs."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    broadcast = collectives.broadcast

    def late(*args: Any, **kwargs: Any) -> Any:
        if r == 1:
            time.sleep(1.0)
        return broadcast(*args, **kwargs)

    monkeypatch.setattr(collectives, "broadcast", late)
    x = np.full(1000, float(r + 1))
    with algorithms.ADPSGD(x, SGD(x, lr=0.0), comm) as algo:
        for _ in range(5):
            algo.step(np.zeros_like(x))
        algo.settle()
        total = comm.allreduce(float(x.sum()))
    assert all_ok(comm, total == n * x.size and bool(np.all(x == 1.0))), total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_adpsgd_with_an_empty_model(size: int) -> None:
    """A model without parameters has nothing to average: steps and settle() return on
    every rank (the empty request was read as an end marker, and the active worker waited
    for an answer forever), with nothing sent."""
    comm = comm_of_size(size)
    x = np.zeros(0)
    with algorithms.ADPSGD(x, SGD(x, lr=0.1), comm) as algo:
        for _ in range(3):
            algo.step(np.zeros(0))
        algo.settle()
        ok = algo.iterations == 3 and algo.bytes_sent == 0 and algo.averagings == 0
    assert all_ok(MPI.COMM_WORLD, ok)


def test_adpsgd_refuses_a_graph_that_is_not_bipartite() -> None:
    comm = comm_of_size(3)
    if comm.Get_size() != 3:
        pytest.skip("needs three ranks")
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match="bipartite") as info:
        algorithms.ADPSGD(x, SGD(x, lr=0.1), comm, topology="ring")
    assert len(set(comm.allgather(str(info.value)))) == 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_grsgd_synchronous_limit_is_a_dpsgd_ring_step(size: int) -> None:
    """max_lead=0 and lr 0: every step is x <- W x with D-PSGD's uniform ring weights."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    x = np.random.default_rng(r).standard_normal(DIM)
    y = x.copy()
    gossip = algorithms.GRSGD(x, SGD(x, lr=0.0), comm, max_lead=0, broadcast_init=False)
    dpsgd = algorithms.DPSGD(y, SGD(y, lr=0.0), comm, topology="ring", broadcast_init=False)
    for _ in range(5):
        gossip.step(np.zeros(DIM))
        dpsgd.step(np.zeros(DIM))
    ok = np.allclose(x, y, rtol=0, atol=1e-12) and all(v == 5 for v in gossip.exchanges.values())
    ok &= gossip.bytes_sent == 5 * len(gossip.peers) * x.nbytes
    gossip.close()
    assert all_ok(MPI.COMM_WORLD, ok), (x, y)


@pytest.mark.parametrize("lead", [1, 3])
def test_grsgd_lead_is_bounded_by_a_slow_neighbor(lead: int) -> None:
    """Rank 0 is slow: no worker ever gets more than max_lead steps ahead of the exchanges
    it completed with a neighbor, and the slow rank's neighbors do use that slack."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    x = np.zeros(DIM)
    algo = algorithms.GRSGD(x, SGD(x, lr=0.0), comm, max_lead=lead)
    worst = 0
    for k in range(1, 31):
        time.sleep(0.01 if r == 0 else 0.0)
        algo.step(np.zeros(DIM))
        worst = max(worst, max(k - done for done in algo.exchanges.values()))
    algo.close()
    neighbor_of_slow = 0 in algo.peers
    assert all_ok(comm, worst <= lead and (not neighbor_of_slow or worst == lead)), (r, worst, lead)


def test_prague_averages_every_local_steps_and_settles() -> None:
    comm = MPI.COMM_WORLD
    x = np.full(DIM, float(comm.Get_rank()))
    total = comm.allreduce(float(x.sum()))
    algo = algorithms.Prague(x, SGD(x, lr=0.0), comm, local_steps=3, policy="random", broadcast_init=False)
    for _ in range(12):
        algo.step(np.zeros(DIM))
    algo.settle()
    settled = comm.allreduce(float(x.sum()))
    for _ in range(3):
        algo.step(np.zeros(DIM))
    algo.close()
    ok = algo.stats.calls == 5 and abs(settled - total) < 1e-9 and abs(comm.allreduce(float(x.sum())) - total) < 1e-9
    assert all_ok(comm, ok), (algo.stats, settled, total)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["adpsgd", "grsgd", "prague"])
def test_half_precision_torch_models(name: str, dtype: str) -> None:
    """Half-precision models train (averaging in float32, rounded once) to the optimum.

    The workers settle every 10 steps: without it a worker stalled for long (a
    process's first torch call can take seconds on a loaded machine) would
    leave the others averaging with its stale model all run long, which
    asynchronous algorithms allow."""
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    a = np.sin(np.arange(DIM)) * 2
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(torch.zeros(DIM, dtype=getattr(torch, dtype)))
    target = torch.tensor(a, dtype=model.x.dtype)
    with algorithms.create(name, model, torch.optim.SGD(model.parameters(), lr=0.25), comm) as algo:
        for t in range(60):
            algo.zero_grad()
            (0.5 * (model.x - target).pow(2).sum()).backward()
            algo.step()
            if t % 10 == 9:
                algo.settle()
    X = np.array(comm.allgather(model.x.detach().float().numpy()))
    tolerance = {"bfloat16": 0.08, "float16": 0.01}[dtype]  # as for the synchronous ones: a few ulps near 2
    assert all_ok(comm, np.allclose(X, a, rtol=0, atol=tolerance)), X


@pytest.mark.parametrize(
    "name,options,match",
    [
        ("grsgd", {"max_lead": -1}, "max_lead must be an integer >= 0"),
        ("prague", {"local_steps": 0}, "local_steps must be an integer >= 1"),
        ("prague", {"policy": "fastest"}, "unknown policy 'fastest'"),
        ("adpsgd", {"topology": topology.ring(9)}, "has 9 ranks"),
        ("adpsgd", {"on_failure": "retry"}, "unknown on_failure 'retry'; valid: abort, continue"),
        ("grsgd", {"on_failure": "retry"}, "unknown on_failure 'retry'; valid: abort, continue"),
    ],
)
def test_bad_options_raise_on_every_rank(name: str, options: dict, match: str) -> None:
    comm = MPI.COMM_WORLD
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match=match) as info:
        algorithms.create(name, x, SGD(x, lr=0.1), comm, **options)
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1)


def test_steps_after_close_are_refused() -> None:
    comm = MPI.COMM_WORLD
    for name in ("adpsgd", "grsgd", "prague"):
        x = np.zeros(DIM)
        algo = algorithms.create(name, x, SGD(x, lr=0.1), comm)
        algo.step(np.ones(DIM))
        algo.close()
        algo.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            algo.step(np.ones(DIM))
        with pytest.raises(RuntimeError, match="closed"):
            algo.settle()
