"""Butterfly all-reduce (recursive doubling).

Phases (p' = 2^floor(lg p) participants after :mod:`~collectives.kernels.fold`):
for mask = 1, 2, 4, ..., p'/2 each participant exchanges its whole vector with
participant ``newrank XOR mask`` and combines, lower rank's operand first, so
both partners compute bitwise the same value. Extra ranks are folded in first
and out last.

Cost: lg p alpha + n lg p beta + n lg p gamma (p a power of two); the fold adds
2 alpha + 2 n beta + n gamma. Fewest messages of all the algorithms: wins for
small vectors, loses for large ones (it sends the whole vector lg p times).
With argument checking on, small vectors travel together with the check
(:mod:`collectives.validation`), in one message per step.
Reference: Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005, section 4.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport.exchange import sendrecv_combine
from ..transport.ops import Reduction
from .fold import fold


def allreduce(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place across ``comm`` by recursive doubling."""
    f = fold(comm)
    f.fold_in(x, comm, red)
    for peer in f.peers:
        sendrecv_combine(comm, x, peer, x, peer, red, peer < f.rank, x.shape[0])
    f.fold_out(x, comm)
