"""All-reduce of vectors that live in shared memory: no copy in, no copy out, two barriers.

The shared-memory all-reduce (:mod:`.shm`) takes vectors wherever the caller
keeps them, so each rank first copies its vector into a shared segment, piece
by piece, and the result is combined back into it; the average divides in a
last pass. When the vectors themselves live in shared memory — one mapping
shared by the node's ranks holding one vector per rank (:class:`SharedVectors`),
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

import errno
import mmap
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..transport import p2p
from ..transport.chunks import chunk_bounds
from ..transport.ops import Reduction
from .shm import Segment

_ALIGN = 64  # each rank's vector starts on its own cache line
#: The file system of the shared vectors' (unnamed) file: a memory file system.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
#: Bytes combined at a time: each block is folded, finished and copied out while it is in cache.
BLOCK = 256 << 10


class SharedVectors:
    """One vector of ``count`` elements of numpy ``dtype`` per rank of ``comm`` (a node
    communicator), all in one shared mapping (:func:`node_memory`); collective over ``comm``
    to create and to free.

    Attributes:
        mine: this rank's vector (a numpy array in shared memory, zero-filled).
        vectors: every rank's vector, by rank.
    """

    def __init__(self, comm: MPI.Comm, count: int, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        stride = -(-max(count, 1) * self.dtype.itemsize // _ALIGN) * _ALIGN
        raw = np.frombuffer(node_memory(comm, stride), np.uint8)
        self.vectors = [raw[r * stride :][: count * self.dtype.itemsize].view(self.dtype) for r in range(self.size)]
        self.mine = self.vectors[self.rank]
        self._sync = Segment(comm, capacity=_ALIGN)  # its barrier only
        self._sync.barrier()

    def allreduce(
        self,
        start: int,
        stop: int,
        red: Reduction,
        pieces: Sequence[tuple[int, Any]] = (),
        finish: Callable[[int, int, np.ndarray], None] | None = None,
    ) -> None:
        """Reduce ``[start, stop)`` of every rank's vector into every rank's, in place
        (module docstring); collective over the node.

        ``pieces``: (offset, array) pairs, disjoint, within ``[start, stop)``, whose
        arrays (1-D, of the vectors' dtype) hold this rank's contribution to
        ``[offset, offset + len)`` instead of its vector (e.g. gradients a backward pass
        left in private memory). Only the parts the other ranks reduce are copied into
        the vector, before the first barrier; this rank reads its own part from the
        arrays. Its vector holds the result all the same.

        ``finish(a, b, result)``: called for each block ``[a, b)`` of this rank's part,
        ``result`` its values (a view of rank 0's vector, to be read, not written), right
        after they were copied into every vector and while they are in cache, between
        the two barriers: e.g. to apply an update to that part of state every rank keeps
        in shared memory (:class:`algorithms.fused_sgd.SharedSGD`)."""
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
                    if finish is not None:
                        finish(c, d, out)
        elif hi > lo:
            for a, b, own in _segments(lo, hi, pieces):
                if own is not None:
                    mine[a:b] = own
                if finish is not None:
                    finish(a, b, mine[a:b])
        p2p.count_sent((published + (self.size - 1) * (hi - lo)) * self.dtype.itemsize)
        self._sync.barrier()

    def free(self) -> None:
        """Release the barrier (collective); the memory goes with the last array that views it."""
        self.vectors.clear()
        self.mine = self.mine[:0].copy()
        self._sync.free()


def node_memory(comm: MPI.Comm, stride: int) -> mmap.mmap:
    """``stride`` bytes per rank of ``comm`` (one node's ranks), rank r's at ``r * stride``,
    zero-filled, in one mapping that every rank maps; collective. Each rank allocates
    its own stride (first touch: on its NUMA node). The mapping lasts as long as an
    array views it: an array kept past :meth:`SharedVectors.free` stays valid.

    The memory is a file in :data:`SHM_DIR` that never has a name (:func:`_unnamed`):
    rank 0 creates it, and the others open it through rank 0's descriptor
    (``/proc/PID/fd/FD``, Linux). So nothing is left behind whichever rank dies
    when, and no other process can open it by name.

    Raises:
        OSError: on every rank, when a rank could not create, open, map or allocate it
            (e.g. a full ``/dev/shm``), with that rank's error.
    """
    rank, nbytes = comm.Get_rank(), stride * comm.Get_size()
    fd, where, problem, memory = -1, None, None, None
    if rank == 0:
        try:
            fd = _unnamed(SHM_DIR)
            os.ftruncate(fd, nbytes)
            where = f"/proc/{os.getpid()}/fd/{fd}"
        except OSError as exc:
            problem = str(exc)
    where, problem = comm.bcast((where, problem), root=0)
    if problem is None:
        try:
            mine = fd if rank == 0 else os.open(where, os.O_RDWR)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(mine, rank * stride, stride)
                memory = mmap.mmap(mine, nbytes)
            finally:
                if mine != fd:
                    os.close(mine)
        except OSError as exc:
            problem = f"rank {rank}: {exc}"
    problems = [p for p in comm.allgather(problem) if p]
    if fd >= 0:  # every rank has opened the file through it
        os.close(fd)
    if problems or memory is None:
        raise OSError(f"cannot allocate {nbytes} bytes of shared memory in {SHM_DIR}: {problems[0]}")
    return memory


def _unnamed(directory: str) -> int:
    """A new file in ``directory``'s file system, open for reading and writing, that has no
    name: ``O_TMPFILE``; where the file system lacks it, a named file unlinked at once."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, path = tempfile.mkstemp(prefix="mpidl-", dir=directory)
    os.unlink(path)
    return fd


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
