"""Topologies: structure, mixing matrices, spectral gaps against closed forms, invalid graphs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from algorithms import topology
from algorithms.topology import TopologyError


def assert_valid_mixing(topo: topology.Topology) -> None:
    W = topo.W
    assert np.allclose(W, W.T, atol=1e-15)
    assert np.allclose(W.sum(axis=0), 1, atol=1e-14) and np.allclose(W.sum(axis=1), 1, atol=1e-14)
    assert (W >= 0).all()


@pytest.mark.parametrize("n", [3, 4, 5, 6, 8, 13])
def test_ring_gap_closed_form(n: int) -> None:
    topo = topology.ring(n)
    assert_valid_mixing(topo)
    assert all(topo.neighbors(i) == tuple(sorted({(i - 1) % n, (i + 1) % n})) for i in range(n))
    assert np.allclose(topo.W[topo.W > 0], 1 / 3)
    assert topo.lambda2 == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / n), abs=1e-12)


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_rings(n: int) -> None:
    topo = topology.ring(n)
    assert topo.degree(0) == n - 1
    assert topo.spectral_gap == pytest.approx(1.0)  # one rank, or two averaging each other


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_hypercube_gap_closed_form(n: int) -> None:
    d = n.bit_length() - 1
    topo = topology.hypercube(n)
    assert_valid_mixing(topo)
    assert all(set(topo.neighbors(i)) == {i ^ (1 << k) for k in range(d)} for i in range(n))
    assert topo.lambda2 == pytest.approx((d - 1) / (d + 1), abs=1e-12)
    assert topo.spectral_gap == pytest.approx(2 / (d + 1), abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_fully_connected_gap_is_one(n: int) -> None:
    topo = topology.fully_connected(n)
    assert np.allclose(topo.W, 1 / n)
    assert topo.spectral_gap == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("rows,cols", [(3, 3), (3, 4), (4, 5)])
def test_torus_spectrum_closed_form(rows: int, cols: int) -> None:
    """Sides >= 3: degree 4, weights 1/5, eigenvalues (1 + 2cos(2 pi a/R) + 2cos(2 pi b/C)) / 5."""
    topo = topology.torus(rows * cols, shape=(rows, cols))
    assert_valid_mixing(topo)
    assert topo.neighbors(0) == tuple(sorted({1, cols - 1, cols, (rows - 1) * cols}))
    eigs = sorted(
        (1 + 2 * math.cos(2 * math.pi * a / rows) + 2 * math.cos(2 * math.pi * b / cols)) / 5
        for a in range(rows)
        for b in range(cols)
    )
    assert np.allclose(np.linalg.eigvalsh(topo.W), eigs, atol=1e-12)
    assert topo.lambda2 == pytest.approx(max(abs(e) for e in eigs[:-1]), abs=1e-12)


def test_torus_small_sides_convention() -> None:
    """A side of 2 gives one neighbor along it, a side of 1 none."""
    two_by_three = topology.torus(6, shape=(2, 3))
    assert two_by_three.neighbors(0) == (1, 2, 3)  # one vertical neighbor (3), two horizontal (1, 2)
    two_by_two = topology.torus(4, shape=(2, 2))
    assert [two_by_two.neighbors(i) for i in range(4)] == [(1, 2), (0, 3), (0, 3), (1, 2)]  # the cycle 0-1-3-2
    assert two_by_two.lambda2 == pytest.approx(topology.ring(4).lambda2)
    assert np.allclose(topology.torus(5, shape=(1, 5)).W, topology.ring(5).W)
    assert topology.torus(12).name == "torus(3x4)"  # default: most square, R <= C


def test_exponential_graph() -> None:
    topo = topology.exponential(8)
    assert topo.neighbors(0) == (1, 2, 4, 6, 7)  # hops +-1, +-2, 4
    assert all(topo.degree(i) == 5 for i in range(8))
    assert_valid_mixing(topo)
    assert topology.exponential(6).neighbors(0) == (1, 2, 4, 5)  # 0 + 4 = 0 - 2
    assert np.allclose(topology.exponential(4).W, 1 / 4)  # hops 1, 2 on 4 ranks: complete


def test_metropolis_weights_on_irregular_graph() -> None:
    """A star: the hub has degree 3, the leaves 1; Metropolis gives w = 1/(1 + 3) on each spoke."""
    star = topology.from_edges(4, [(0, 1), (0, 2), (0, 3)], weights="metropolis")
    assert_valid_mixing(star)
    assert np.allclose(star.W[0], [1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert np.allclose(star.W[1], [1 / 4, 3 / 4, 0, 0])
    uniform = topology.from_edges(4, [(0, 1), (0, 2), (0, 3)], weights="uniform")
    assert_valid_mixing(uniform)  # max-degree weights: 1/(3+1) per edge as well
    assert np.allclose(uniform.W, star.W)
    path = topology.from_edges(4, [(0, 1), (1, 2), (2, 3)])
    assert_valid_mixing(path)
    assert path.W[0, 1] == pytest.approx(1 / 3) and path.W[1, 2] == pytest.approx(1 / 3)
    assert path.W[0, 0] == pytest.approx(2 / 3) and path.W[1, 1] == pytest.approx(1 / 3)


def test_adjacency_and_matrix_inputs_agree() -> None:
    A = np.zeros((5, 5), int)
    for i in range(5):
        A[i, (i + 1) % 5] = A[(i + 1) % 5, i] = 1
    assert np.allclose(topology.from_adjacency(A, weights="uniform").W, topology.ring(5).W)
    assert topology.from_matrix(topology.ring(5).W).lambda2 == pytest.approx(topology.ring(5).lambda2)


def test_neighbor_weights_row() -> None:
    row = topology.ring(5).neighbor_weights(0)
    assert row.self_weight == pytest.approx(1 / 3)
    assert [j for j, _ in row.sources] == [1, 4] and row.destinations == (1, 4)
    assert sum(w for _, w in row.sources) + row.self_weight == pytest.approx(1)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: topology.from_edges(4, [(0, 1), (2, 3)]), "disconnected"),
        (lambda: topology.from_edges(3, [(0, 1), (1, 3)]), "out of range"),
        (lambda: topology.from_edges(3, [(0, 1), (1, 1), (1, 2)]), "self-loop"),
        (lambda: topology.from_edges(3, [(0, 1, 2)]), "pair"),
        (lambda: topology.from_adjacency([[0, 1, 0], [0, 0, 1], [1, 1, 0]]), "not symmetric"),
        (lambda: topology.from_adjacency([[1, 1], [1, 0]]), "self-loops"),
        (lambda: topology.from_adjacency([[0, 2], [2, 0]]), "0 or 1"),
        (lambda: topology.from_matrix([[0.5, 0.5], [0.25, 0.75]]), "not symmetric"),
        (lambda: topology.from_matrix([[0.5, 0.4], [0.4, 0.5]]), "not 1"),
        (lambda: topology.from_matrix([[1.5, -0.5], [-0.5, 1.5]]), "negative"),
        (lambda: topology.from_matrix([[1.0, 0.0], [0.0, 1.0]]), "disconnected"),
        (lambda: topology.from_matrix([[1.0, 0.0, 0.0]]), "square"),
        (lambda: topology.hypercube(6), "power-of-two"),
        (lambda: topology.torus(6, shape=(4, 2)), "does not hold"),
        (lambda: topology.ring(0), "positive integer"),
        (lambda: topology.ring(4, weights="max"), "unknown weights"),
        (lambda: topology.build("star", 4), "unknown topology"),
    ],
)
def test_invalid_graphs_raise(build, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        build()
    assert issubclass(TopologyError, ValueError)


def test_matrix_is_read_only() -> None:
    topo = topology.ring(4)
    with pytest.raises(ValueError):
        topo.W[0, 0] = 1.0
