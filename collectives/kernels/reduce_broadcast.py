"""Reduce + broadcast all-reduce over binomial trees.

Phases (root 0):

1. binomial reduce: for mask = 1, 2, 4, ... a rank with bit ``mask`` set sends
   its partial result to rank - mask and stops; otherwise it receives from
   rank + mask (if that exists) and combines.
2. binomial broadcast of the root's result, the same tree in reverse
   (:func:`broadcast` alone, from any root, is ``collectives.broadcast``).

Cost: 2 ceil(lg p) alpha + 2 n ceil(lg p) beta + n ceil(lg p) gamma. Works for
any p with no fold. Simple and latency-friendly; the root's links carry the
whole vector lg p times, so it loses for large vectors. The result is computed
once at the root and copied, so all ranks end bitwise identical.
Reference: Thakur, Rabenseifner & Gropp, IJHPCA 2005, section 2.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport.ops import Reduction
from ..transport.p2p import recv, send
from ..transport.scratch import scratch


def reduce(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` onto rank 0 of ``comm``; other ranks' ``x`` is left as is."""
    p, r = comm.Get_size(), comm.Get_rank()
    tmp = None
    mask = 1
    while mask < p:
        if r & mask:
            send(comm, x, r - mask)
            return
        if r + mask < p:
            if tmp is None:
                tmp = scratch(x, x.shape[0])
            recv(comm, tmp, r + mask)
            red.combine(x, tmp)
        mask <<= 1


def broadcast(x: Any, comm: MPI.Comm, root: int = 0) -> None:
    """Copy rank ``root``'s ``x`` into every rank's ``x`` (the tree of root 0, its ranks
    counted from ``root``)."""
    p = comm.Get_size()
    v = (comm.Get_rank() - root) % p  # the rank counted from the root
    mask = 1
    while mask < p:
        if v & mask:
            recv(comm, x, (v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if v + mask < p:
            send(comm, x, (v + mask + root) % p)
        mask >>= 1


def allreduce(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place across ``comm``: reduce to rank 0, then broadcast."""
    reduce(x, comm, red)
    broadcast(x, comm)
