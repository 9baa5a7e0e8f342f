"""Where a rank is: ``mpidl.rank()``, ``size()``, ``local_rank()``, ``local_size()`` after
``mpidl.init()``, on the node layout the collectives use, emulated nodes included."""

from __future__ import annotations

import pytest
from mpi4py import MPI
from mpitest import all_ok

import mpidl
from collectives import ArgumentError
from mpidl import ranks

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def keep_the_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test does to this rank's place, the next test finds it as it was."""
    monkeypatch.setattr(ranks, "_place", ranks._place)


def place() -> tuple[int, int, int, int]:
    return mpidl.rank(), mpidl.size(), mpidl.local_rank(), mpidl.local_size()


def test_one_machine_is_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPIDL_RANKS_PER_NODE", raising=False)
    world = mpidl.init(abort_on_exception=False)
    r, n = world.Get_rank(), world.Get_size()
    assert world is MPI.COMM_WORLD
    assert all_ok(world, place() == (r, n, r, n)), place()


@pytest.mark.parametrize("spec", ["2", "1", "3,1", "1,3"])
def test_emulated_nodes_number_their_ranks_from_zero(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """``MPIDL_RANKS_PER_NODE``: consecutive ranks per node, each node's from 0."""
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    sizes = [int(s) for s in spec.split(",")]
    if len(sizes) > 1 and sum(sizes) != n:
        pytest.skip(f"node sizes {spec} add up to {sum(sizes)} ranks, not {n}")
    if len(sizes) == 1:
        sizes = [min(sizes[0], n - start) for start in range(0, n, sizes[0])]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    node = max(i for i, start in enumerate(starts) if start <= r)
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", spec)
    mpidl.init(abort_on_exception=False)
    expected = (r, n, r - starts[node], sizes[node])
    assert all_ok(world, place() == expected), (place(), expected)


def test_a_malformed_layout_is_refused_by_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "0")
    with pytest.raises(ArgumentError, match="invalid ranks-per-node layout"):
        mpidl.init(abort_on_exception=False)


def test_before_init_the_place_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "_place", None)
    for where in (mpidl.rank, mpidl.size, mpidl.local_rank, mpidl.local_size):
        with pytest.raises(RuntimeError, match=r"call mpidl.init\(\) first"):
            where()
