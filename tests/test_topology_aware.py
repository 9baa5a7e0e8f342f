"""Node layout, hierarchical ring and 2D-torus on emulated and real multi-node layouts."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest
from allreduce_matrix import check
from mpi4py import MPI
from mpitest import all_ok, gather_failures, mpiexec, on_rank0_quietly

import collectives
from collectives import ArgumentError
from collectives.kernels import shm
from collectives.topology.layout import Layout, layout
from collectives.transport.context import context

pytestmark = pytest.mark.mpi

TOPOLOGY_AWARE = ["hierarchical_ring", "torus2d", "shm", "auto"]


def layouts(n: int) -> list[str]:
    """Emulated layouts for n ranks: nodes of 2 (2x2 on 4), one node (4x1), one rank per node (1x4), uneven."""
    return sorted({"2", str(n), "1"} | ({f"{n - 1},1"} if n > 1 else set()))


def grids(n: int) -> list[tuple[int, int]]:
    return [(x, n // x) for x in range(1, n + 1) if n % x == 0]


def test_layout_override_and_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    assert layout(comm, "1").ranks_per_node == (1,) * n
    assert layout(comm, n).nodes == 1
    if n == 4:
        assert layout(comm, "3,1").node_of == (0, 0, 0, 1)
        assert layout(comm, 3).ranks_per_node == (3, 1)
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "1")
    assert layout(comm).nodes == n
    monkeypatch.delenv("MPIDL_RANKS_PER_NODE")
    assert layout(comm).ranks_per_node == (n,)  # one machine, no override: one node
    resolved = layout(comm, "1")
    assert layout(comm, resolved) is resolved  # a resolved layout passes through
    with pytest.raises(ArgumentError, match=f"has {n + 1} ranks, the communicator {n}"):
        layout(comm, Layout(tuple(range(n + 1))))


@pytest.mark.parametrize("spec", ["0", "x", "5,5,5", "-1,2"])
def test_bad_layout_is_an_error(spec: str) -> None:
    with pytest.raises(ArgumentError, match="invalid ranks-per-node layout"):
        layout(MPI.COMM_WORLD, spec)


@pytest.mark.parametrize("algorithm", TOPOLOGY_AWARE)
def test_emulated_layouts(algorithm: str) -> None:
    comm = MPI.COMM_WORLD
    failures: list[str] = []
    for spec in layouts(comm.Get_size()):
        failures += check(comm, [algorithm], ["float32", "int64"], ["sum", "max"], [0, 1, 3, 5, 33], layout=spec)
    failures = gather_failures(comm, failures)
    assert all_ok(comm, not failures), "\n".join(failures[:20])


def test_torus_explicit_grids() -> None:
    comm = MPI.COMM_WORLD
    failures: list[str] = []
    for grid in grids(comm.Get_size()):
        failures += check(comm, ["torus2d"], ["float64", "int32"], ["sum", "min"], [0, 1, 2, 7, 41], grid=grid)
    failures = gather_failures(comm, failures)
    assert all_ok(comm, not failures), "\n".join(failures[:20])


def test_invalid_grid_is_reported_on_every_rank() -> None:
    comm = MPI.COMM_WORLD
    x = np.ones(4)
    with pytest.raises(ArgumentError, match=r"X \* Y must equal the number of ranks") as info:
        collectives.allreduce(x, collective="torus2d", grid=(comm.Get_size() + 1, 1))
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1 and bool(np.all(x == 1)))
    with pytest.raises(ArgumentError, match="grid must be a pair"):
        collectives.allreduce(x, collective="torus2d", grid="2x2")


def test_sub_communicators_are_built_once() -> None:
    comm = MPI.COMM_WORLD
    x = np.ones(8)
    collectives.allreduce(x, collective="torus2d", layout="1")
    cached = dict(context(comm).cache)
    collectives.allreduce(x, collective="torus2d", layout="1")
    collectives.allreduce(x, collective="hierarchical_ring", layout="1")
    collectives.allreduce(x, collective="hierarchical_ring", layout="1")
    after = context(comm).cache
    assert all(after[k] is v for k, v in cached.items())
    assert len([k for k in after if k not in cached]) <= 2  # the hierarchical plan and its node communicators


_CORES = """
from mpi4py import MPI
from collectives.kernels import shm
from collectives.topology.layout import cores_per_rank
from collectives.transport.context import context
ctx = context(MPI.COMM_WORLD)
seg = shm.shared(ctx)
rows = ctx.comm.gather((cores_per_rank(ctx), shm.spins(ctx), None if seg is None else seg._spins))
if ctx.rank == 0:
    print(rows)
"""


@pytest.mark.job
def test_cores_per_rank_counts_the_cores_of_the_machine() -> None:
    """Ranks bound to a core each have a core each (the union of their affinity masks,
    not one rank's own); ranks bound to one core share it, and their barriers yield at
    once instead of spinning on the core the peer needs; nodes that share a machine
    (two hosts of MPICH's launcher here, network namespaces of the emulated cluster)
    share its cores."""
    cores = sorted(os.sched_getaffinity(0))
    cases = [(None, "user:0,0", [(0.5, 0, 0)] * 2), ("a:1,b:1", "user:0,0", [(0.5, 0, None)] * 2)]
    if len(cores) > 1:
        cases.append((None, f"user:{cores[0]},{cores[1]}", [(1.0, shm.SPINS, shm.SPINS)] * 2))
    for hosts, binding, expected in cases:
        proc = on_rank0_quietly(mpiexec, 2, ["-c", _CORES], hosts=hosts, options=["-bind-to", binding], timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ast.literal_eval(proc.stdout.strip()) == expected, (hosts, binding, proc.stdout)


@pytest.mark.job
def test_real_multi_node_layout() -> None:
    """MPICH's launcher with two hosts makes COMM_TYPE_SHARED report two nodes on one machine."""
    proc = on_rank0_quietly(
        mpiexec,
        4,
        ["tests/allreduce_matrix.py", "--collectives", ",".join(TOPOLOGY_AWARE)],
        hosts="a:2,b:2",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
