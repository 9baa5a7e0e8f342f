"""Recursive halving-doubling all-reduce (Rabenseifner's algorithm).

Phases (p' = 2^floor(lg p) participants after :mod:`~collectives.kernels.fold`;
the vector is split into p' blocks by :func:`chunk_bounds`):

1. reduce-scatter by recursive halving: for mask = p'/2, ..., 1 each
   participant exchanges half of its current block range with participant
   ``newrank XOR mask`` — the lower one keeps the lower half — and combines
   the half it keeps. Participant i ends holding block i fully reduced.
2. all-gather by recursive doubling: for mask = 1, ..., p'/2 partners swap
   their ranges, doubling them, until every participant holds all blocks.

Cost (p a power of two): 2 lg p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma;
otherwise, with the fold, (2 floor(lg p) + 2) alpha + (2(p-1)/p + 2) n beta +
n (1 + (p-1)/p) gamma. Each block is reduced on one rank and then copied, so
all ranks end bitwise identical.
Reference: Rabenseifner, "Optimization of Collective Reduction Operations",
ICCS 2004; Thakur, Rabenseifner & Gropp, IJHPCA 2005.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport.chunks import chunk_bounds
from ..transport.exchange import sendrecv_combine
from ..transport.ops import Reduction
from ..transport.p2p import sendrecv
from .fold import fold


def allreduce(x: Any, comm: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place across ``comm`` by recursive halving then doubling."""
    f = fold(comm)
    f.fold_in(x, comm, red)
    me = f.newrank
    if me is not None and f.peers:  # a participant of the power-of-two exchanges
        bounds = chunk_bounds(x.shape[0], f.pof2)
        lo, hi = 0, f.pof2  # the block range this rank is responsible for
        mask = f.pof2 >> 1
        while mask:
            peer = f.peers[mask.bit_length() - 1]
            mid = (lo + hi) // 2
            (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if (me & mask) == 0 else ((mid, hi), (lo, mid))
            send, keep = x[bounds[slo] : bounds[shi]], x[bounds[klo] : bounds[khi]]
            sendrecv_combine(comm, send, peer, keep, peer, red, peer < f.rank, max(send.shape[0], keep.shape[0]))
            lo, hi = klo, khi
            mask >>= 1
        mask = 1
        while mask < f.pof2:
            peer = f.peers[mask.bit_length() - 1]
            width = hi - lo
            plo = lo + width if (me & mask) == 0 else lo - width
            sendrecv(comm, x[bounds[lo] : bounds[hi]], peer, x[bounds[plo] : bounds[plo + width]], peer)
            lo, hi = min(lo, plo), max(hi, plo + width)
            mask <<= 1
    f.fold_out(x, comm)
