"""All-reduce of vectors that live in shared memory: no copy in, no copy out, two barriers.

The shared-memory all-reduce (:mod:`.shm`) takes vectors wherever the caller
keeps them, so each rank first copies its vector into a shared segment, piece
by piece, and the result is combined back into it; the average divides in a
last pass. When the vectors themselves live in shared memory — one window on
the node communicator holding one vector per rank (:class:`SharedVectors`),
e.g. a model's gradient buffer allocated there once, which backward writes
into — a rank can read its peers' vectors where they are. For a slice
``[start, stop)`` of every rank's vector, with q ranks and rank i's part
``[lo_i, hi_i)`` of the slice (:func:`~collectives.transport.chunks.chunk_bounds`):

1. barrier: every rank's slice is final;
2. rank i folds part i of all q vectors, in rank order, into rank 0's vector
   (``op(op(v_0, v_1), v_2)...``), finishes it (``avg``: divides by q) and
   copies it into the other q - 1 vectors, :data:`BLOCK` bytes at a time so
   that the three passes find the block in cache; no other rank touches
   part i in this phase;
3. barrier: every vector holds the whole result.

A rank's contribution may also lie outside its vector, in private arrays
(``pieces``: e.g. the fresh gradient tensors a backward pass leaves when the
gradients were set to None): before the first barrier the rank copies into
its vector only what the other ranks reduce, (q - 1)/q of it, and folds its
own part straight from the arrays.

Every element is computed by the same operations in the same order as in
:mod:`.shm` (rank order, then the division), so the result is bitwise what
``shm`` gives, and the same on every rank.

Cost for n bytes per rank: 2 alpha_shm + n beta_shm, each rank reading q
parts of n/q bytes and writing q of them (n in all each way; with pieces,
(q - 1) n / q more copied in), against a copy-in, a combine reading two
vectors and a division pass over the whole vector in :mod:`.shm`, with one
barrier per :data:`~.shm.SEGMENT` bytes. Measured for 16.6 MiB of float32 on
two ranks of the development machine: 1.1 ms, 2.8 ms with the whole
contribution in pieces, against 3.4 ms for ``shm``.
Payload counted (:func:`~collectives.transport.p2p.count_sent`): what a
rank writes into shared memory for its peers, the (q - 1) n / q bytes of
results in their vectors and, with pieces, the (q - 1) n / q bytes of its
contribution it copies in for them.

All ranks of the communicator must share one node's memory; only one thread
may use a :class:`SharedVectors` at a time. Reference: Li, Hoefler & Snir,
"NUMA-aware shared-memory collective communication for MPI", HPDC 2013 (the
sliced reduction, here in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..transport import p2p
from ..transport.chunks import chunk_bounds
from ..transport.ops import Reduction
from .shm import Segment

_ALIGN = 64  # each rank's vector starts on its own cache line
#: Bytes combined at a time: each block is folded, finished and copied out while it is in cache.
BLOCK = 256 << 10


class SharedVectors:
    """One vector of ``count`` elements of numpy ``dtype`` per rank of ``comm`` (a node
    communicator), all in one shared window; collective over ``comm`` to create and to free.

    Attributes:
        mine: this rank's vector (a numpy array in shared memory, zero-filled).
        vectors: every rank's vector, by rank.
    """

    def __init__(self, comm: MPI.Comm, count: int, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        nbytes = -(-max(count, 1) * self.dtype.itemsize // _ALIGN) * _ALIGN
        self._win = MPI.Win.Allocate_shared(nbytes, 1, comm=comm)  # type: ignore[arg-type]  # a node communicator
        self.vectors = [
            np.frombuffer(self._win.Shared_query(r)[0], self.dtype, count)  # type: ignore[call-overload]  # an MPI buffer
            for r in range(self.size)
        ]
        self.mine = self.vectors[self.rank]
        self.mine.fill(0)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._sync = Segment(comm, capacity=_ALIGN)  # its barrier only
        self._win.Sync()
        self._sync.barrier()

    def allreduce(self, start: int, stop: int, red: Reduction, pieces: Sequence[tuple[int, Any]] = ()) -> None:
        """Reduce ``[start, stop)`` of every rank's vector into every rank's, in place
        (module docstring); collective over the node.

        ``pieces``: (offset, array) pairs, disjoint, within ``[start, stop)``, whose
        arrays (1-D, of the vectors' dtype) hold this rank's contribution to
        ``[offset, offset + len)`` instead of its vector (e.g. gradients a backward pass
        left in private memory). Only the parts the other ranks reduce are copied into
        the vector, before the first barrier; this rank reads its own part from the
        arrays. Its vector holds the result all the same."""
        bounds = chunk_bounds(stop - start, self.size)
        lo, hi = start + bounds[self.rank], start + bounds[self.rank + 1]
        mine, published = self.mine, 0
        for offset, values in pieces:
            end = offset + values.shape[0]
            if offset < lo:
                mine[offset : min(end, lo)] = values[: min(end, lo) - offset]
                published += min(end, lo) - offset
            if end > hi:
                mine[max(offset, hi) : end] = values[max(offset, hi) - offset :]
                published += end - max(offset, hi)
        self._win.Sync()
        self._sync.barrier()
        if hi > lo and self.size > 1:
            block = max(1, BLOCK // self.dtype.itemsize)
            for a, b, own in _segments(lo, hi, pieces):
                for c in range(a, b, block):
                    d = min(c + block, b)
                    parts = [v[c:d] for v in self.vectors]
                    out = parts[0]
                    if own is not None:
                        parts[self.rank] = own[c - a : d - a]
                    red.fold(out, tuple(parts))
                    red.finalize(out, self.size)
                    for v in self.vectors[1:]:
                        v[c:d] = out
        elif hi > lo:
            for a, b, own in _segments(lo, hi, pieces):
                if own is not None:
                    mine[a:b] = own
        p2p.count_sent((published + (self.size - 1) * (hi - lo)) * self.dtype.itemsize)
        self._win.Sync()
        self._sync.barrier()

    def free(self) -> None:
        """Release the window (collective); the vectors must no longer be used."""
        self.vectors.clear()
        self.mine = self.mine[:0].copy()
        self._sync.free()
        self._win.Unlock_all()
        self._win.Free()


def _segments(lo: int, hi: int, pieces: Sequence[tuple[int, Any]]) -> list[tuple[int, int, Any]]:
    """``[lo, hi)`` cut at the pieces' ends: (a, b, the piece's array over [a, b), or None
    where this rank's vector holds its contribution), in order."""
    out: list[tuple[int, int, Any]] = []
    at = lo
    for offset, values in sorted(pieces, key=lambda piece: piece[0]):
        a, b = max(offset, lo), min(offset + values.shape[0], hi)
        if a >= b:
            continue
        if a > at:
            out.append((at, a, None))
        out.append((a, b, values[a - offset : b - offset]))
        at = b
    if at < hi:
        out.append((at, hi, None))
    return out
