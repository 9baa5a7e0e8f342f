"""Communication graphs for decentralized training, their mixing matrices and spectral gaps.

Graphs are plain functions of the number of ranks that return plain data
(the style of BlueFog's ``topology_util``): each builder returns a
:class:`Topology`, which holds the n x n mixing matrix W and derives
everything else from it — the neighbors of a rank, the row a rank passes to
:func:`collectives.neighbor_allreduce`, |lambda_2| and the spectral gap.

Builders (all undirected; W symmetric and doubly stochastic):

* :func:`ring`: i ~ i +- 1 (mod n).
* :func:`torus`: ranks on an R x C grid, row-major (rank = r * C + c), with
  wrap-around: (r, c) ~ (r +- 1 mod R, c) and (r, c +- 1 mod C). Small sides:
  a side of length 2 gives one neighbor along it, not two (+1 and -1 are the
  same rank); a side of length 1 gives none (+-1 is the rank itself). So a
  2 x 2 torus is a 4-cycle (0-1-3-2) and a 1 x n torus is the n-ring.
* :func:`hypercube`: n a power of two, i ~ i XOR 2^k.
* :func:`exponential`: i ~ i +- 2^k (mod n) for every 2^k < n, the symmetric
  form of the exponential graph (BlueFog's default is its directed, one-way
  form, whose W is not symmetric).
* :func:`fully_connected`: every pair; W = 11^T / n, spectral gap 1.
* :func:`bipartite`: every even rank ~ every odd rank (the complete
  bipartite graph), for AD-PSGD's active/passive split on any n.
* :func:`from_edges`, :func:`from_adjacency`: a user's graph;
  :func:`from_matrix`: a user's mixing matrix, checked.

Weights (``weights=``), both symmetric and doubly stochastic on any graph:

* ``"uniform"``: w_ij = 1 / (d_max + 1) on every edge, w_ii = 1 - d_i / (d_max + 1),
  d_max the largest degree. On a regular graph every nonzero weight is
  1 / (d + 1) (1/3 on a ring).
* ``"metropolis"`` (Metropolis-Hastings): w_ij = 1 / (1 + max(d_i, d_j)) on
  every edge, w_ii = 1 - sum_j w_ij.

Spectral gap: W's eigenvalues are real, 1 = lambda_1 >= ... >= lambda_n >= -1;
|lambda_2| is the largest modulus among lambda_2..lambda_n, and the gap is
1 - |lambda_2|. With zero learning rate D-PSGD's disagreement ||X - mean||
shrinks by at least |lambda_2| per step, so the gap governs how fast
decentralized models agree (Boyd et al., "Fast linear iterations for
distributed averaging", 2004). n = 1 has gap 1 by convention.

Invalid input raises :class:`TopologyError` (a ValueError) naming the problem:
a disconnected graph, a rank out of range, a self-loop given as an edge, an
asymmetric adjacency or matrix, negative weights, rows not summing to 1, a
size the graph cannot have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from collectives import NeighborWeights

#: Tolerance of the symmetry and stochasticity checks.
ATOL = 1e-12

WEIGHTS = ("uniform", "metropolis")


class TopologyError(ValueError):
    """An invalid graph or mixing matrix."""


@dataclass(frozen=True, eq=False)
class Topology:
    """A communication graph on n ranks with its mixing matrix.

    Attributes:
        name: a description, e.g. "ring(8)".
        W: the n x n mixing matrix (float64, symmetric, doubly stochastic,
            nonnegative, connected; read-only).
    """

    name: str
    W: np.ndarray

    def __post_init__(self) -> None:
        W = np.array(self.W, dtype=np.float64)
        _check_mixing(W)
        W.setflags(write=False)
        object.__setattr__(self, "W", W)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.W.shape[0]

    def neighbors(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` exchanges with, ascending."""
        row = self.W[rank]
        return tuple(j for j in np.flatnonzero(row).tolist() if j != rank)

    def degree(self, rank: int) -> int:
        """Number of neighbors of ``rank``."""
        return len(self.neighbors(rank))

    def neighbor_weights(self, rank: int) -> NeighborWeights:
        """Row ``rank`` of W in the form :func:`collectives.neighbor_allreduce` takes."""
        return NeighborWeights(self.W[rank, rank], {j: self.W[rank, j] for j in self.neighbors(rank)})

    @cached_property
    def lambda2(self) -> float:
        """|lambda_2|: the second largest eigenvalue modulus of W (0 for one rank)."""
        eigs = np.linalg.eigvalsh(self.W)  # ascending; eigs[-1] == 1, simple as W is connected
        return float(np.max(np.abs(eigs[:-1]))) if self.size > 1 else 0.0

    @property
    def spectral_gap(self) -> float:
        """1 - |lambda_2|."""
        return 1.0 - self.lambda2

    def sides(self) -> tuple[int, ...] | None:
        """A 2-colouring of the graph (0 or 1 per rank, rank 0 on side 0) if it is
        bipartite — every edge joins the two sides — else None."""
        side = [-1] * self.size
        side[0] = 0
        frontier = [0]
        while frontier:  # breadth-first: the graph is connected
            i = frontier.pop()
            for j in self.neighbors(i):
                if side[j] < 0:
                    side[j] = 1 - side[i]
                    frontier.append(j)
                elif side[j] == side[i]:
                    return None
        return tuple(side)

    def __repr__(self) -> str:
        return f"Topology({self.name}, gap={self.spectral_gap:.4g})"


def ring(n: int, weights: str = "uniform") -> Topology:
    """i ~ i +- 1 (mod n). With uniform weights and n >= 3, |lambda_2| = 1/3 + 2/3 cos(2 pi / n)."""
    _check_size(n)
    return _build(f"ring({n})", n, ((i, (i + 1) % n) for i in range(n)), weights)


def torus(n: int, shape: tuple[int, int] | None = None, weights: str = "uniform") -> Topology:
    """Ranks on an R x C wrap-around grid (module docstring for small sides).

    ``shape`` defaults to the most square R x C with R <= C and R * C = n.
    """
    _check_size(n)
    if shape is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        shape = (rows, n // rows)
    rows, cols = (int(v) for v in shape)
    if rows < 1 or cols < 1 or rows * cols != n:
        raise TopologyError(f"torus shape {rows}x{cols} does not hold {n} ranks (R * C must equal n)")
    edges = []
    for r in range(rows):
        for c in range(cols):
            edges += [(r * cols + c, ((r + 1) % rows) * cols + c), (r * cols + c, r * cols + (c + 1) % cols)]
    return _build(f"torus({rows}x{cols})", n, edges, weights)


def hypercube(n: int, weights: str = "uniform") -> Topology:
    """i ~ i XOR 2^k; n must be a power of two. Uniform weights: |lambda_2| = (d-1)/(d+1), d = lg n."""
    _check_size(n)
    if n & (n - 1):
        raise TopologyError(f"a hypercube needs a power-of-two number of ranks, got {n}")
    return _build(
        f"hypercube({n})", n, ((i, i ^ (1 << k)) for i in range(n) for k in range(n.bit_length() - 1)), weights
    )


def exponential(n: int, weights: str = "uniform") -> Topology:
    """i ~ i +- 2^k (mod n) for every 2^k < n."""
    _check_size(n)
    hops = [1 << k for k in range(max(n - 1, 1).bit_length()) if 1 << k < n]
    return _build(f"exponential({n})", n, ((i, (i + h) % n) for i in range(n) for h in hops), weights)


def fully_connected(n: int, weights: str = "uniform") -> Topology:
    """Every pair of ranks; with uniform weights W = 11^T / n and the gap is 1."""
    _check_size(n)
    return _build(f"fully_connected({n})", n, ((i, j) for i in range(n) for j in range(i + 1, n)), weights)


def bipartite(n: int, weights: str = "uniform") -> Topology:
    """Every even rank ~ every odd rank: the complete bipartite graph K(ceil(n/2), floor(n/2))."""
    _check_size(n)
    return _build(f"bipartite({n})", n, ((i, j) for i in range(0, n, 2) for j in range(1, n, 2)), weights)


def from_edges(n: int, edges: Iterable[Sequence[int]], weights: str = "metropolis", name: str = "") -> Topology:
    """A user's undirected graph on n ranks from (i, j) pairs (each pair once or both ways)."""
    _check_size(n)
    pairs = []
    for edge in edges:
        try:
            i, j = (int(v) for v in edge)
        except (TypeError, ValueError):
            raise TopologyError(f"an edge must be a pair of ranks, got {edge!r}") from None
        if not (0 <= i < n and 0 <= j < n):
            raise TopologyError(f"edge ({i}, {j}) has a rank out of range 0..{n - 1}")
        if i == j:
            raise TopologyError(f"edge ({i}, {i}) is a self-loop; a rank's own share is its self weight, not an edge")
        pairs.append((i, j))
    return _build(name or f"graph({n}, {len(set(map(frozenset, pairs)))} edges)", n, pairs, weights)


def from_adjacency(adjacency: Sequence[Sequence[float]], weights: str = "metropolis", name: str = "") -> Topology:
    """A user's undirected graph from a symmetric 0/1 (or boolean) adjacency matrix with zero diagonal."""
    A = np.asarray(adjacency)
    if A.ndim != 2 or A.shape[0] != A.shape[1] or A.shape[0] < 1:
        raise TopologyError(f"an adjacency matrix must be square and non-empty, got shape {A.shape}")
    if not np.isin(A, (0, 1)).all():
        raise TopologyError("adjacency entries must be 0 or 1 (use from_matrix for weights)")
    if not np.array_equal(A, A.T):
        i, j = np.argwhere(A != A.T)[0]
        raise TopologyError(
            f"adjacency is not symmetric: A[{i},{j}] = {A[i, j]} but A[{j},{i}] = {A[j, i]}; "
            "decentralized averaging needs an undirected graph"
        )
    loops = np.flatnonzero(np.diag(A))
    if loops.size:
        raise TopologyError(f"adjacency has self-loops at rank(s) {loops.tolist()}; the diagonal must be zero")
    n = A.shape[0]
    return _build(
        name or f"graph({n}, {int(A.sum()) // 2} edges)", n, ((int(i), int(j)) for i, j in np.argwhere(A)), weights
    )


def from_matrix(W: Sequence[Sequence[float]], name: str = "") -> Topology:
    """A user's mixing matrix, checked: square, symmetric, nonnegative, rows summing to 1, connected."""
    M = np.asarray(W, dtype=np.float64)
    return Topology(name or f"matrix({M.shape[0] if M.ndim else 0})", M)


#: Builders by name, each taking (n, weights=...): what ``DPSGD(topology="ring")`` looks up.
TOPOLOGIES: dict[str, Callable[..., Topology]] = {
    "ring": ring,
    "torus": torus,
    "hypercube": hypercube,
    "exponential": exponential,
    "full": fully_connected,
    "bipartite": bipartite,
}


def build(name: str, n: int, weights: str = "uniform") -> Topology:
    """The topology called ``name`` (a key of :data:`TOPOLOGIES`) on n ranks."""
    builder = TOPOLOGIES.get(name)
    if builder is None:
        raise TopologyError(f"unknown topology {name!r}; valid topologies: {', '.join(TOPOLOGIES)}")
    return builder(n, weights=weights)


def mixing_matrix(n: int, edges: Iterable[tuple[int, int]], weights: str = "uniform") -> np.ndarray:
    """The n x n mixing matrix of an undirected graph (module docstring for the schemes)."""
    if weights not in WEIGHTS:
        raise TopologyError(f"unknown weights {weights!r}; valid weights: {', '.join(WEIGHTS)}")
    A = np.zeros((n, n), dtype=bool)
    for i, j in edges:
        A[i, j] = A[j, i] = True
    degree = A.sum(axis=1)
    if weights == "uniform":
        W = A / (degree.max() + 1.0)
    else:
        W = np.where(A, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
    W[np.diag_indices(n)] = 1.0 - W.sum(axis=1)
    return W


def _build(name: str, n: int, edges: Iterable[tuple[int, int]], weights: str) -> Topology:
    """The topology of the undirected graph ``edges``; pairs (i, i), which the wrap-around of
    small rings and tori produces, are dropped (a rank's own share is its self weight)."""
    return Topology(name, mixing_matrix(n, ((i, j) for i, j in edges if i != j), weights))


def _check_size(n: int) -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise TopologyError(f"the number of ranks must be a positive integer, got {n!r}")


def _check_mixing(W: np.ndarray) -> None:
    """Raise TopologyError unless W is a valid mixing matrix of a connected graph."""
    if W.ndim != 2 or W.shape[0] != W.shape[1] or W.shape[0] < 1:
        raise TopologyError(f"a mixing matrix must be square and non-empty, got shape {W.shape}")
    if not np.isfinite(W).all():
        raise TopologyError("the mixing matrix has non-finite entries")
    if not np.allclose(W, W.T, rtol=0, atol=ATOL):
        i, j = np.unravel_index(np.argmax(np.abs(W - W.T)), W.shape)
        raise TopologyError(
            f"the mixing matrix is not symmetric: W[{i},{j}] = {W[i, j]:.6g} but W[{j},{i}] = {W[j, i]:.6g}"
        )
    if (W < -ATOL).any():
        i, j = np.argwhere(W < -ATOL)[0]
        raise TopologyError(f"the mixing matrix has a negative weight W[{i},{j}] = {W[i, j]:.6g}")
    sums = W.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > ATOL * W.shape[0])
    if bad.size:
        raise TopologyError(
            f"the weights of row(s) {bad.tolist()} sum to {sums[bad].tolist()}, not 1 "
            "(a mixing matrix must be doubly stochastic)"
        )
    parts = _components(W != 0)
    if len(parts) > 1:
        raise TopologyError(
            f"the graph is disconnected: components {[sorted(p) for p in parts]}; "
            "models on different components never agree"
        )


def _components(A: np.ndarray) -> list[set[int]]:
    """Connected components of the graph with adjacency ``A`` (the diagonal is ignored)."""
    unseen = set(range(A.shape[0]))
    parts = []
    while unseen:
        frontier = [unseen.pop()]
        part = set(frontier)
        while frontier:
            nxt = [j for i in frontier for j in np.flatnonzero(A[i]).tolist() if j in unseen]
            unseen.difference_update(nxt)
            part.update(nxt)
            frontier = nxt
        parts.append(part)
    return parts
