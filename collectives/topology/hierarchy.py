"""Sub-communicators for the topology-aware algorithms, built once and cached.

* Node level (:func:`node_comms`): one communicator per node (ranks ordered
  as in the parent) and one among the node leaders (each node's lowest rank).
* Grid level (:func:`grid_comms`): ranks on an X x Y grid, a row
  communicator (X ranks) and a column communicator (Y ranks, one per row
  position).

Both are cached in the parent's :class:`~collectives.transport.context.Context`, keyed
by the layout or grid, and freed with it. Building them is collective, so
every rank must ask for the same layout or grid (the all-reduce entry point
validates that before building).
"""

from __future__ import annotations

import math

from mpi4py import MPI

from ..errors import ArgumentError
from ..transport.context import Context
from .layout import Layout

Grid = tuple[int, int]


def node_comms(ctx: Context, lay: Layout) -> tuple[MPI.Comm, MPI.Comm]:
    """(this rank's node communicator, the leaders' communicator or COMM_NULL)."""
    key = ("nodes", lay.node_of)
    found = ctx.cache.get(key)
    if found is None:
        node = ctx.comm.Split(lay.node_of[ctx.rank], ctx.rank)
        leader = node.Get_rank() == 0
        leaders = ctx.comm.Split(0 if leader else MPI.UNDEFINED, ctx.rank)
        found = ctx.cache[key] = _Comms(node, leaders)
    return found.pair


def default_grid(lay: Layout) -> Grid:
    """(ranks per node, nodes) when every node has as many ranks; otherwise the
    most square factorisation X x Y of the rank count with X <= Y."""
    counts = set(lay.ranks_per_node)
    if len(counts) == 1:
        return (counts.pop(), lay.nodes)
    n = len(lay.node_of)
    x = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return (x, n // x)


def check_grid(grid: object, size: int) -> Grid:
    """Return ``grid`` as (X, Y) or raise ArgumentError unless X * Y == size."""
    try:
        x, y = (int(v) for v in grid)  # type: ignore[attr-defined]  # any user object; TypeError handled
    except (TypeError, ValueError):
        raise ArgumentError(f"grid must be a pair (X, Y) of positive integers, got {grid!r}") from None
    if x < 1 or y < 1 or x * y != size:
        raise ArgumentError(f"invalid grid {x}x{y} for {size} ranks: X * Y must equal the number of ranks")
    return (x, y)


def grid_comms(ctx: Context, grid: Grid, lay: Layout | None = None) -> tuple[MPI.Comm, MPI.Comm]:
    """(row communicator of X ranks, column communicator of Y ranks).

    With ``lay`` given and ``grid`` equal to its (ranks per node, nodes), rows
    are the nodes (so the row phases stay inside a node); otherwise row ``y``
    holds ranks ``y*X .. y*X + X - 1``.
    """
    x, _ = grid
    node_rows = lay if lay is not None and set(lay.ranks_per_node) == {x} and default_grid(lay) == grid else None
    if node_rows is not None:
        row_id = node_rows.node_of[ctx.rank]
        position = node_rows.members(row_id).index(ctx.rank)
    else:
        row_id, position = divmod(ctx.rank, x)
    key = ("grid", grid, node_rows.node_of if node_rows is not None else None)
    found = ctx.cache.get(key)
    if found is None:
        row = ctx.comm.Split(row_id, ctx.rank)
        col = ctx.comm.Split(position, ctx.rank)
        found = ctx.cache[key] = _Comms(row, col)
    return found.pair


class _Comms:
    """Two cached communicators, freed with the context."""

    def __init__(self, first: MPI.Comm, second: MPI.Comm) -> None:
        self.pair = (first, second)

    def free(self) -> None:
        for comm in self.pair:
            if comm != MPI.COMM_NULL:
                comm.Free()
