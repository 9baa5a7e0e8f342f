"""P-Reduce with the group-generator service over MPI: group kernels, atomicity
and consensus on 1..8 ranks, drafts served in close(), trace, bad input."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, mpiexec, on_rank0_quietly
from preduce_check import check, configs

import collectives
from collectives import ArgumentError, CollectiveError, GroupComm, PReduce

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("segment", [None, 24])
@pytest.mark.parametrize("algorithm", list(collectives.GROUP_KERNELS))
def test_group_comm_runs_kernels_on_concurrent_subsets(
    algorithm: str, segment: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even and odd ranks reduce at the same time on one communicator, each group alone;
    also with blocks cut into many segments (pipelined with nonblocking transfers)."""
    from collectives.transport import exchange

    if segment is not None:
        monkeypatch.setattr(exchange, "SEGMENT", segment)
    world = MPI.COMM_WORLD
    n, r = world.Get_size(), world.Get_rank()
    private = world.Dup()
    members = tuple(range(r % 2, n, 2))
    x = np.arange(101, dtype=np.float64) * (r + 1) + r / 3
    expected = sum(np.arange(101) * (m + 1) + m / 3 for m in members)
    collectives.GROUP_KERNELS[algorithm](x, GroupComm(private, members), collectives.reduction("sum", "float64"))
    everyone = world.allgather(x.tobytes())
    private.Free()
    assert all_ok(world, np.allclose(x, expected, rtol=1e-14, atol=0))
    assert all_ok(world, all(everyone[m] == x.tobytes() for m in members))  # bitwise identical


@pytest.mark.parametrize("algorithm", list(collectives.GROUP_KERNELS))
def test_every_group_kernel_averages_bitwise_identically(algorithm: str) -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    start = [np.linspace(-1, 1, 7) * (m + 1) + m / 7 for m in range(n)]
    x = start[r].copy()
    with PReduce(x, comm, group_size=min(3, n), policy="static", seed=5, collective=algorithm) as pr:
        pr.average()
    group, everyone = pr.last_group, comm.allgather(x.tobytes())
    expected = sum(start[m] for m in group) / len(group)
    assert all_ok(comm, np.allclose(x, expected, rtol=1e-14, atol=1e-15))
    assert all_ok(comm, all(everyone[m] == x.tobytes() for m in group))


def test_group_comm_rejects_outsiders_and_wildcards() -> None:
    world = MPI.COMM_WORLD
    with pytest.raises(ArgumentError, match="not a member"):
        GroupComm(world, [m for m in range(world.Get_size()) if m != world.Get_rank()])
    with pytest.raises(ArgumentError, match="not a rank"):
        GroupComm(world, [world.Get_rank()]).Recv(np.empty(1), MPI.ANY_SOURCE, 0)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_atomicity_and_consensus(size: int) -> None:
    """Learning rate 0, random delays: the sum over workers is kept, workers agree."""
    comm = comm_of_size(size)
    failures = []
    for policy, k in configs(comm.Get_size()):
        failures += check(comm, policy, k)
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.parametrize("size", [5, 6, 7, 8])
def test_atomicity_and_consensus_large_communicators(size: int) -> None:
    """5..8 ranks do not fit the test launch: run the check under its own mpiexec."""
    proc = on_rank0_quietly(mpiexec, size, ["tests/preduce_check.py"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("policy", ["random", "smart", "aware"])
def test_drafts_are_served_in_close(policy: str) -> None:
    """The last rank never averages; the others do, so it is drafted (random) or
    grouped once it has closed (smart), and serves those groups in close()."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(3, float(r * r))
    total = comm.allreduce(float(x.sum()))
    with PReduce(x, comm, group_size=min(2, n), policy=policy, service_rank=n - 1) as pr:
        if r != n - 1:
            for _ in range(20):
                pr.average()
    assert all_ok(comm, abs(comm.allreduce(float(x.sum())) - total) <= 1e-9 * (1 + abs(total)))
    assert all_ok(comm, n == 1 or r != n - 1 or pr.stats.groups > 0)
    assert all_ok(comm, pr.stats.calls == (0 if r == n - 1 else 20))


@pytest.mark.parametrize("policy", ["random", "smart", "aware", "static"])
def test_settle_pauses_with_nothing_in_flight(policy: str) -> None:
    """Workers average different numbers of times, settle, then average on: after settle()
    the buffers are stable (the sum is kept and nothing changes them), and the service
    serves requests again."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(4, float(r + 1) ** 2)
    total = comm.allreduce(float(x.sum()))
    with PReduce(x, comm, group_size=min(2, n), policy=policy) as pr:
        for _ in range(3 if policy == "static" else 2 + 3 * r):
            pr.average()
        pr.settle()
        settled = x.copy()
        comm.Barrier()
        time.sleep(0.05)
        unchanged = settled.tobytes() == x.tobytes()
        kept = abs(comm.allreduce(float(x.sum())) - total) <= 1e-9 * total
        for _ in range(3):
            pr.average()
    assert all_ok(comm, unchanged and kept and abs(comm.allreduce(float(x.sum())) - total) <= 1e-9 * total)


@pytest.mark.timeout(60)
def test_aware_groups_cross_nodes_regularly_and_keep_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of two ranks: every worker's groups cross nodes now and then (every second one of
    a leader's at most), and the sum is kept exactly as with the other policies."""
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "2")
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(3, float(r * r))
    total = comm.allreduce(float(x.sum()))
    crossed = 0
    with PReduce(x, comm, group_size=min(2, n), policy="aware") as pr:
        for _ in range(12):
            pr.average()
            assert pr.last_group is not None and r in pr.last_group
            crossed += len({m // 2 for m in pr.last_group}) > 1
    assert all_ok(comm, abs(comm.allreduce(float(x.sum())) - total) <= 1e-9 * (1 + total))
    assert all_ok(comm, crossed > 0 if n > 2 else crossed == 0)


def test_smart_never_drafts_a_computing_worker() -> None:
    """A slow rank is not waited for: every group a worker runs while averaging serves its request."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(2, float(r))
    with PReduce(x, comm, group_size=min(2, n), policy="smart") as pr:
        for _ in range(5 if r == 0 else 15):
            time.sleep(0.01 if r == 0 else 0.0)
            pr.average()
        drafted_while_averaging = pr.stats.drafted
    assert all_ok(comm, drafted_while_averaging == 0)


@pytest.mark.parametrize("policy", ["random", "static"])
def test_torch_tensor_is_averaged_in_place(policy: str) -> None:
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    weight = torch.nn.Parameter(torch.full((2, 3), float(r)))
    with PReduce(weight, comm, group_size=n, policy=policy) as pr:
        assert pr.average() is weight
    assert all_ok(comm, bool(torch.all(weight.detach() == (n - 1) / 2)))


@pytest.mark.parametrize("spec", ["argument", "env"])
def test_trace_lines(spec: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    path = comm.bcast(str(tmp_path_factory.mktemp("trace") / "gg.log") if r == 0 else None)
    if spec == "env":
        monkeypatch.setenv("MPIDL_GG_TRACE", path)
    x = np.zeros(4)
    with PReduce(x, comm, group_size=min(2, n), trace=path if spec == "argument" else None) as pr:
        for _ in range(3):
            pr.average()
    text = Path(path).read_text() if r == 0 else ""
    ok = r != 0 or all(word in text for word in ("request w", "start g", "locks [", "done w", "close w"))
    assert all_ok(comm, ok), text[-2000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["random", "static"])
@pytest.mark.parametrize("spec", ["argument", "env"])
def test_a_trace_file_that_cannot_be_opened_raises_on_every_rank(
    spec: str, policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the service rank opens the trace; its failure is every rank's ArgumentError, naming the file."""
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path / "no-such-folder" / "gg.log"))  # rank 0's: the one in the message
    if spec == "env":
        monkeypatch.setenv("MPIDL_GG_TRACE", path)
    source = " (from MPIDL_GG_TRACE)" if spec == "env" else ""
    message = f"rank 0 cannot open the group generator's trace file '{path}'{source}: No such file or directory"
    with pytest.raises(ArgumentError, match=re.escape(message)):
        PReduce(np.zeros(3), comm, policy=policy, trace=path if spec == "argument" else None)
    x = np.full(3, float(comm.Get_rank()))
    with PReduce(x, comm, group_size=comm.Get_size(), policy=policy, trace=False) as pr:  # nothing left half set up
        pr.average()
    assert all_ok(comm, np.array_equal(x, np.full(3, (comm.Get_size() - 1) / 2)))


def test_close_alone_is_clean_and_idempotent() -> None:
    comm = MPI.COMM_WORLD
    pr = PReduce(np.zeros(2), comm, group_size=1)
    pr.close()
    pr.close()
    with pytest.raises(CollectiveError, match="after close"):
        pr.average()


def test_empty_buffer_still_takes_part() -> None:
    comm = MPI.COMM_WORLD
    with PReduce(np.zeros(0, np.float32), comm, group_size=min(2, comm.Get_size())) as pr:
        for _ in range(5):
            pr.average()
    assert all_ok(comm, pr.stats.calls == 5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=0), "group_size"),
        (dict(group_size=10_000), "group_size"),
        (dict(policy="fastest"), "unknown policy"),
        (dict(collective="tree"), "unknown collective"),
        (dict(period=0), "period"),
        (dict(seed=-1), "seed"),
        (dict(service_rank=10_000), "service_rank"),
        (dict(exchange=lambda members, group: None, on_failure="continue"), "needs exchange=None"),
    ],
)
def test_bad_arguments_raise_on_every_rank(kwargs: dict, match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        PReduce(np.zeros(3), MPI.COMM_WORLD, **kwargs)


def test_integer_buffer_and_disagreement_raise_on_every_rank() -> None:
    comm = MPI.COMM_WORLD
    with pytest.raises(ArgumentError, match="avg"):
        PReduce(np.zeros(3, np.int64), comm)
    if comm.Get_size() > 1:
        with pytest.raises(ArgumentError, match="length differs"):
            PReduce(np.zeros(3 + comm.Get_rank()), comm)
        with pytest.raises(ArgumentError, match="options differs"):
            PReduce(np.zeros(3), comm, group_size=1 + comm.Get_rank() % 2)
