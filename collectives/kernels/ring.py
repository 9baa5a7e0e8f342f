"""Ring all-reduce: reduce-scatter then all-gather around a ring.

Phases (p ranks, vector split into p chunks by :func:`chunk_bounds`; rank r
sends to r+1 and receives from r-1):

1. reduce-scatter, p-1 steps: at step s rank r sends chunk (r-s-1) mod p and
   receives chunk (r-s-2) mod p, combining it into its own copy. After the
   last step rank r holds chunk r reduced over all ranks.
2. all-gather, p-1 steps: at step s rank r sends chunk (r-s) mod p and
   receives chunk (r-s-1) mod p into place.

Cost: 2(p-1) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma, which meets the
bandwidth lower bound (Patarasuk & Yuan 2009). Every chunk is reduced on one
rank and then copied, so all ranks end bitwise identical.

The two phases are public: the 2D-torus and hierarchical algorithms and LSGD
compose them, and :func:`collectives.allgather` runs the all-gather with blocks of
each rank's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from ..transport.chunks import chunk_bounds
from ..transport.exchange import sendrecv_combine
from ..transport.ops import Reduction
from ..transport.p2p import sendrecv


def reduce_scatter(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` across ``comm`` so that rank r's chunk r holds the result.

    Only chunk r of ``x`` is meaningful afterwards; the other chunks hold
    partial sums. Chunks are those of ``chunk_bounds(len(x), comm.size)``.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return
    bounds = chunk_bounds(x.shape[0], p)
    right, left = (r + 1) % p, (r - 1) % p
    longest = -(-x.shape[0] // p)
    for s in range(p - 1):
        out_c, in_c = (r - s - 1) % p, (r - s - 2) % p
        sendrecv_combine(
            comm,
            x[bounds[out_c] : bounds[out_c + 1]],
            right,
            x[bounds[in_c] : bounds[in_c + 1]],
            left,
            red,
            True,
            longest,
        )


def allgather(x: Any, comm: MPI.Comm, bounds: Sequence[int] | None = None) -> None:
    """Fill every chunk of ``x`` from its owner: rank r contributes chunk r, the elements
    ``bounds[r]`` to ``bounds[r + 1]`` (default: :func:`chunk_bounds`; any p + 1
    ascending offsets from 0 to ``len(x)``, the same on every rank)."""
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return
    if bounds is None:
        bounds = chunk_bounds(x.shape[0], p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        out_c, in_c = (r - s) % p, (r - s - 1) % p
        sendrecv(comm, x[bounds[out_c] : bounds[out_c + 1]], right, x[bounds[in_c] : bounds[in_c + 1]], left)


def allreduce(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place across ``comm`` with the ring algorithm."""
    reduce_scatter(x, comm, red)
    allgather(x, comm)
