"""Aggregating encoded vectors that cannot be summed as they travel: all-gather, or reduce-scatter and re-encode.

A payload that is not a plain vector of floats (quantised levels with
per-bucket scales, packed bits, index-value pairs) cannot be added up by an
all-reduce on the way. Two ways to aggregate such payloads, for n ranks, a
vector of d elements, and a payload of P bytes:

``allgather`` (:func:`gather`):

1. every rank encodes its vector into its slot of a table of n payloads;
2. ring all-gather of the table (:func:`collectives.kernels.ring.allgather`);
3. every rank decodes the n payloads and sums them in rank order (then divides
   for ``avg``): the same bytes and the same order on every rank, so the
   results are bitwise identical.

   Cost: (n-1) alpha + (n-1) P beta + n d gamma_decode. Each rank sends
   (n-1) P bytes: against the 2 (n-1)/n m bytes of a ring all-reduce of the
   uncompressed m bytes, n P / (2 m), which grows with n. Works for any
   encoding, sparse ones included; the result is the exact sum of every
   rank's decoded vector.

``reduce_scatter`` (:func:`scatter`), a compressed all-reduce in the manner of
1-bit Adam's (Tang et al. 2021):

1. the vector is cut into n chunks on bucket boundaries (the codec's scales
   are per bucket, or per layer: then each chunk's piece of a layer has its
   own scale, :meth:`~.base.Compressor.piece`); every rank encodes each chunk
   on its own;
2. pairwise exchange, n-1 steps: at step s rank r sends its encoding of chunk
   r+s to rank r+s and receives rank r-s's encoding of chunk r;
3. rank r decodes the n encodings of chunk r, sums them in rank order (divides
   for ``avg``) and encodes the sum again;
4. pairwise exchange, n-1 steps: rank r sends its encoded chunk of the sum to
   rank r+s and receives chunk r-s's;
5. every rank decodes the n chunks: the same bytes, so bitwise identical.

   Cost: 2 (n-1) alpha + 2 (n-1)/n P beta + d gamma_decode + (d/n) (n gamma_decode
   + gamma_encode). Each rank sends 2 (n-1)/n P bytes (chunks of equal
   size): P / m of the uncompressed ring all-reduce's bytes, whatever n. The
   sum is encoded twice, so a biased codec's second error is returned in the
   residual of the rank that made it (times n for ``avg``), or, given a
   server memory, kept there and added to the chunk's sum before the next
   step's second encoding (see :mod:`.base`); with one rank the vector is
   encoded once.

``hierarchical`` (:func:`hierarchical`), the reduce-scatter across nodes only,
for k nodes of q ranks each (the layout of :func:`collectives.topology.layout.layout`:
detected, or ``MPIDL_RANKS_PER_NODE``):

1. exact all-reduce (sum) of the vector inside each node (``shm`` where the
   node's ranks share memory, else ``ring``); for ``avg`` the node sum is
   divided by n;
2. the vector is cut into q slices on bucket boundaries; local rank i runs
   ``reduce_scatter`` (above, ``sum``) of slice i of its node's sum with local
   rank i of every other node, k ranks (the second encoding's server memory
   and error as there);
3. each rank zeroes the other slices and the node all-reduces again (exact:
   every element is one slice's value plus zeros), so every rank of every
   node holds every slice, bitwise identical.

   Cost across the links: each rank sends 2 (k-1)/k P/q bytes to other nodes
   (the node 2 (k-1)/k P), against 2 (n-1)/n P less what stays inside the
   node for ``reduce_scatter``, whose pairs do not know the nodes; inside a
   node, two uncompressed all-reduces. The node's sum is encoded once, by the
   rank of its slice, so this rank's residual holds that encoding's error on
   its slice (times n for ``avg``) and zero elsewhere: summed over the ranks,
   what the aggregate lost, as for the others. With one node, one rank per
   node or nodes of different sizes it is ``reduce_scatter``.

Both take the codec's methods (:class:`Codec`); so does ``hierarchical``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np
from mpi4py import MPI

from ..api import allreduce
from ..kernels.ring import allgather
from ..topology.hierarchy import grid_comms
from ..topology.layout import detected, layout
from ..transport.buffers import array_module
from ..transport.chunks import chunk_bounds
from ..transport.context import Context, context
from ..transport.p2p import sendrecv
from ..transport.scratch import scratch
from .memory import ACCUMULATOR, PAYLOAD, RECEIVED, TABLE


class Call(NamedTuple):
    """One aggregation's arguments, resolved: the caller's communicator, its
    context (whose private duplicate the messages use), the op, the all-reduce
    algorithm (for the linear compressors) and the server memory of
    :func:`scatter` (work precision, the vector's length, or None)."""

    comm: MPI.Comm
    ctx: Context
    op: str
    algorithm: str
    server: Any = None


class Codec(Protocol):
    """What the aggregations need of a compressor (:class:`~.base.Compressor`)."""

    bucket: int

    def piece(self, start: int, stop: int) -> Codec: ...
    def _nbytes(self, length: int, dtype: np.dtype) -> int: ...
    def _encode(self, x: Any, out: Any) -> None: ...
    def _decode(self, payload: Any, out: Any) -> None: ...
    def _decode_add(self, payload: Any, out: Any) -> None: ...
    def _residual(self, x: Any, payload: Any, out: Any) -> None: ...


def gather(codec: Codec, x: Any, residual: Any, call: Call) -> None:
    """Replace ``x`` by the sum (avg: mean) of every rank's decoded encoding of its
    ``x``, by all-gather (module docstring); ``residual`` (or None) gets x - C(x)."""
    n, r = call.ctx.size, call.ctx.rank
    size = codec._nbytes(x.shape[0], x.dtype)
    table = scratch(x, n * size, TABLE, np.uint8)
    mine = table[r * size : (r + 1) * size]
    codec._encode(x, mine)
    if residual is not None:
        codec._residual(x, mine, residual)
    allgather(table, call.ctx.comm)
    _decode_sum(codec, [table[i * size : (i + 1) * size] for i in range(n)], x)
    _finish(x, call.op, n)


def scatter(codec: Codec, x: Any, residual: Any, call: Call) -> None:
    """Replace ``x`` by the sum (avg: mean) of the ranks' encoded ``x``, by
    reduce-scatter, re-encoding and all-gather (module docstring); ``residual``
    (or None) gets x - C(x) plus this rank's share of the second encoding's error,
    which goes to ``call.server`` instead when there is one."""
    xp = array_module(x)
    n, r = call.ctx.size, call.ctx.rank
    elems, offsets = chunks(codec, x.shape[0], n, x.dtype)
    sent = scratch(x, offsets[n], PAYLOAD, np.uint8)
    parts = [(x[elems[j] : elems[j + 1]], sent[offsets[j] : offsets[j + 1]]) for j in range(n)]
    codecs = [codec.piece(elems[j], elems[j + 1]) for j in range(n)]
    for c, (chunk, payload) in zip(codecs, parts):
        c._encode(chunk, payload)
    if residual is not None:
        for j, (chunk, payload) in enumerate(parts):
            codecs[j]._residual(chunk, payload, residual[elems[j] : elems[j + 1]])
    if n == 1:
        codecs[0]._decode(sent, x)
        return
    comm, mine = call.ctx.comm, parts[r][1]
    size = mine.shape[0]
    received = scratch(x, n * size, RECEIVED, np.uint8)
    for s in range(1, n):
        dest, source = (r + s) % n, (r - s) % n
        sendrecv(comm, parts[dest][1], dest, received[source * size : (source + 1) * size], source)
    acc = scratch(x, elems[r + 1] - elems[r], ACCUMULATOR)
    _decode_sum(codecs[r], [mine if i == r else received[i * size : (i + 1) * size] for i in range(n)], acc)
    _finish(acc, call.op, n)
    kept = None if call.server is None else call.server[elems[r] : elems[r + 1]]
    if kept is not None:
        xp.add(acc, kept, out=acc)
    codecs[r]._encode(acc, mine)
    for s in range(1, n):
        dest, source = (r + s) % n, (r - s) % n
        sendrecv(comm, mine, dest, parts[source][1], source)
    for c, (chunk, payload) in zip(codecs, parts):
        c._decode(payload, chunk)
    if kept is not None:  # the second encoding's error, kept for the next step
        xp.subtract(acc, parts[r][0], out=kept)
    elif residual is not None:  # the second encoding's error, as the ranks' sum sees it
        xp.subtract(acc, parts[r][0], out=acc)
        if call.op == "avg":
            xp.multiply(acc, n, out=acc)
        own = residual[elems[r] : elems[r + 1]]
        xp.add(own, acc, out=own)


def hierarchical(codec: Codec, x: Any, residual: Any, call: Call) -> None:
    """Replace ``x`` by the sum (avg: mean) of the nodes' encoded sums, by exact
    all-reduces inside the nodes and :func:`scatter` across them (module docstring);
    ``residual`` (or None) gets this rank's share of what the aggregate lost."""
    lay = layout(call.comm)
    q = lay.ranks_per_node[0]
    if lay.nodes == 1 or q == 1 or len(set(lay.ranks_per_node)) > 1:
        scatter(codec, x, residual, call)
        return
    xp, n = array_module(x), call.ctx.size
    row, col = grid_comms(call.ctx, (q, lay.nodes), lay)
    inside = "shm" if detected(context(row)).nodes == 1 else "ring"
    allreduce(x, row, "sum", inside, validate=False)
    if call.op == "avg":
        xp.divide(x, n, out=x)
    elems, _ = chunks(codec, x.shape[0], q, x.dtype)
    i = row.Get_rank()
    lo, hi = elems[i], elems[i + 1]
    server = None if call.server is None else call.server[lo:hi]
    part = None if residual is None else residual[lo:hi]
    scatter(codec.piece(lo, hi), x[lo:hi], part, Call(col, context(col), "sum", call.algorithm, server))
    if residual is not None:
        residual[:lo] = 0
        residual[hi:] = 0
        if call.op == "avg":
            xp.multiply(part, n, out=part)
    x[:lo] = 0
    x[hi:] = 0
    allreduce(x, row, "sum", inside, validate=False)


def chunks(codec: Codec, length: int, n: int, dtype: np.dtype) -> tuple[list[int], list[int]]:
    """The element bounds of the n chunks of a vector of ``length`` (on multiples of
    the codec's bucket, balanced by :func:`~collectives.transport.chunks.chunk_bounds`)
    and the byte offsets of their encodings (each by the codec of its piece), one
    after another."""
    b = codec.bucket
    elems = [min(i * b, length) for i in chunk_bounds(-(-length // b), n)]
    offsets = [0]
    for j in range(n):
        offsets.append(offsets[-1] + codec.piece(elems[j], elems[j + 1])._nbytes(elems[j + 1] - elems[j], dtype))
    return elems, offsets


def _decode_sum(codec: Codec, payloads: list[Any], out: Any) -> None:
    """Set ``out`` to the sum of the decoded ``payloads``, in their order."""
    codec._decode(payloads[0], out)
    for p in payloads[1:]:
        codec._decode_add(p, out)


def _finish(x: Any, op: str, n: int) -> None:
    """Divide a sum of ``n`` contributions for ``avg``."""
    if op == "avg" and n > 1:
        array_module(x).divide(x, n, out=x)
