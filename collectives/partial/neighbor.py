"""Neighbor averaging: each rank mixes its vector with its in-neighbors' vectors.

``neighbor_allreduce(x, weights)`` sets, on every rank i,

    x_i <- w_ii x_i + sum_{j in in(i)} w_ij x_j

over a graph given per rank by :class:`NeighborWeights` (the rank's self
weight, its in-neighbors with their weights, and its out-neighbors). With the
rows of a symmetric doubly stochastic mixing matrix W this is one gossip step
of D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017); BlueFog's ``neighbor_allreduce`` (Ying et al.
2021) has the same shape.

Phases:

1. post a nonblocking receive from every in-neighbor into its own reusable
   scratch buffer, and a nonblocking send of ``x`` to every out-neighbor: one
   message per edge, all in flight at once;
2. wait for all of them;
3. combine in a fixed order: ``x *= w_ii``, then for in-neighbors in
   ascending rank order ``x += w_ij x_j``. Waiting for everything before
   combining keeps the order fixed, so results are deterministic (the same
   inputs give the same bits on every run). With ``out=`` the same
   operations write into ``out`` and ``x`` is only read (D-PSGD mixes a model
   that the forward pass reads meanwhile).

Cost on rank i (d_out out-neighbors, d_in in-neighbors, n bytes):
alpha + d_out n beta (all messages in flight together; a rank's link
serialises its own bytes) + d_in n gamma. Payload sent: d_out n bytes.

Arithmetic: float32/float64 buffers are combined in their own precision;
float16 and bfloat16 buffers in a float32 accumulator, rounded once at the
end. Integer buffers need integer weights (the sum is then exact, wrapping
like numpy on overflow); a fractional weight on an integer buffer is an error.

Graph consistency is validated (``validate=``, default on; see
:mod:`collectives.validation`): if rank i expects a message from j, j must
send one to i and vice versa, no rank may list itself or a rank outside the
communicator, and every rank must pass the same length and dtype. Each rank
learns who sends to it from one all-to-all of flags; then every rank raises
the same :class:`ArgumentError` naming the broken edges, before any data
moved. Without validation an inconsistent graph hangs or mismatches messages.

Device buffers (CuPy arrays, CUDA tensors) are mixed on the device; messages
take the device transport (:mod:`collectives.transport.gpu`).

Not thread-safe on one communicator: two threads mixing over the same
communicator at once would receive each other's messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import validation
from ..errors import ArgumentError
from ..transport import gpu, p2p
from ..transport.buffers import DTYPE_CODES, FlatBuffer, array_module, as_flat, dtype_code
from ..transport.context import Context, context
from ..transport.ops import narrow, widen
from ..transport.p2p import irecv, isend, waitall
from ..transport.scratch import scratch

#: Scratch slots used here: a float32 accumulator and term (half dtypes), then
#: one receive buffer per in-neighbor.
_ACC, _TERM, _RECV = 16, 17, 18

_HALF = frozenset({"float16", "bfloat16"})
_INTEGER = frozenset({"int32", "int64"})


class NeighborWeights:
    """One rank's row of a mixing matrix: who it receives from, with what weight, and who it sends to.

    Attributes:
        self_weight: w_ii.
        sources: ((j, w_ij), ...) for every in-neighbor j, ascending by j.
        destinations: out-neighbors, ascending.
    """

    __slots__ = ("destinations", "self_weight", "sources")

    def __init__(
        self, self_weight: float, sources: Mapping[int, float], destinations: Sequence[int] | None = None
    ) -> None:
        """
        Args:
            self_weight: the weight of this rank's own vector.
            sources: in-neighbor rank -> weight of its vector.
            destinations: out-neighbor ranks; default the in-neighbors (an
                undirected graph).
        """
        self.self_weight = float(self_weight)
        self.sources = tuple(sorted((int(j), float(w)) for j, w in sources.items()))
        ranks = [j for j, _ in self.sources] if destinations is None else destinations
        self.destinations = tuple(sorted(int(j) for j in ranks))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeighborWeights) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __hash__(self) -> int:
        return hash((self.self_weight, self.sources, self.destinations))

    def __repr__(self) -> str:
        return (
            f"NeighborWeights(self_weight={self.self_weight!r}, sources={dict(self.sources)!r}, "
            f"destinations={list(self.destinations)!r})"
        )


def neighbor_allreduce(
    buf: Any,
    weights: NeighborWeights,
    comm: MPI.Comm | None = None,
    *,
    validate: bool | None = None,
    out: Any = None,
) -> Any:
    """Replace ``buf`` by its weighted average with the in-neighbors' buffers, in place
    (or, given ``out``, write the average there and leave ``buf`` as it was).

    Sets ``buf <- w_ii buf + sum_j w_ij buf_j`` (j over ``weights.sources``)
    after sending this rank's ``buf`` to every rank in
    ``weights.destinations``.

    Args:
        buf: a C-contiguous, writable numpy array or torch tensor of any
            shape and a dtype in :data:`~collectives.DTYPES`; the same length
            and dtype on every rank.
        weights: this rank's row of the mixing matrix (see the module
            docstring for the arithmetic per dtype).
        comm: the communicator (default ``MPI.COMM_WORLD``); every rank calls.
        validate: check the graph and arguments across ranks first. None uses
            the default (on unless ``MPIDL_VALIDATE=0``).
        out: a buffer of ``buf``'s kind, length and dtype that receives the
            average, bit for bit what ``buf`` would; ``buf`` is then only read
            (e.g. a model that a forward pass reads meanwhile).

    Returns:
        ``out`` if given, else ``buf`` itself.

    Raises:
        ArgumentError: invalid or inconsistent arguments; with validation on,
            raised on every rank before any data moved (``buf`` untouched).
    """
    ctx = context(MPI.COMM_WORLD if comm is None else comm)
    p2p.operation("neighbor_allreduce")
    flat, problem = _prepare(buf, weights, ctx.size, ctx.rank)
    target = flat
    if out is not None and problem is None:
        target, problem = _target(out, flat)
    if validation.enabled(validate):
        _check(ctx, weights, flat, problem)
    elif problem:
        raise problem
    if type(flat.data) is not np.ndarray:
        gpu.ensure(ctx.comm, flat)
    if flat.size:
        _mix(flat, weights, ctx.comm, target.data)
    return buf if out is None else out


def _target(out: Any, flat: FlatBuffer) -> tuple[FlatBuffer, ArgumentError | None]:
    """Resolve ``out`` and check it against the input; a problem is returned, not raised."""
    try:
        target = as_flat(out)
    except ArgumentError as exc:
        return flat, exc
    if target.size != flat.size or target.dtype != flat.dtype or type(target.data) is not type(flat.data):
        return flat, ArgumentError(
            f"out must match the buffer: {target.size} {target.dtype} elements of "
            f"{type(target.data).__name__} for {flat.size} {flat.dtype} of {type(flat.data).__name__}"
        )
    return target, None


def _prepare(buf: Any, weights: NeighborWeights, size: int, rank: int) -> tuple[FlatBuffer, ArgumentError | None]:
    """Resolve the buffer and check the row locally; a problem is returned, not raised."""
    try:
        if not isinstance(weights, NeighborWeights):
            raise ArgumentError(f"weights must be a collectives.NeighborWeights, got {type(weights).__name__}")
        flat = as_flat(buf)
        for what, ranks in (("in-neighbor", [j for j, _ in weights.sources]), ("out-neighbor", weights.destinations)):
            if len(set(ranks)) != len(ranks):
                raise ArgumentError(f"{what} listed twice in {weights}")
            outside = [j for j in ranks if not 0 <= j < size]
            if outside:
                raise ArgumentError(f"{what} rank(s) {outside} outside the communicator of {size} ranks")
            if rank in ranks:
                raise ArgumentError(f"rank {rank} lists itself as an {what}; its own share is self_weight")
        values = [weights.self_weight] + [w for _, w in weights.sources]
        if not all(np.isfinite(values)):
            raise ArgumentError(f"weights must be finite: {weights}")
        if flat.dtype in _INTEGER and any(w != int(w) for w in values):
            raise ArgumentError(f"fractional weights on an integer buffer ({flat.dtype}) would truncate: {weights}")
        return flat, None
    except ArgumentError as exc:
        return None, exc  # type: ignore[return-value]


def _check(ctx: Context, weights: NeighborWeights, flat: FlatBuffer | None, problem: ArgumentError | None) -> None:
    """Raise the same ArgumentError on every rank unless the graph is consistent and
    all ranks agree on length and dtype (collective over ``ctx.comm``)."""
    sends, senders = ctx.cache.get("neighbor-check", (None, None))
    if sends is None:
        sends = np.zeros(ctx.size, np.int8)
        senders = np.zeros(ctx.size, np.int8)
        ctx.cache["neighbor-check"] = (sends, senders)
    sends[:] = 0
    if problem is None:
        sends[list(weights.destinations)] = 1
    with p2p.waiting(ctx.comm):
        ctx.comm.Alltoall(sends, senders)  # senders[j] = 1 iff j sends to this rank
    if problem is None:
        expected = {j for j, _ in weights.sources}
        actual = set(np.flatnonzero(senders).tolist())
        missing, extra = sorted(expected - actual), sorted(actual - expected)
        if missing or extra:
            parts = [f"expects data from rank(s) {missing}, which do not send to it"] if missing else []
            parts += [f"is sent data by rank(s) {extra}, which it does not list as in-neighbors"] if extra else []
            problem = ArgumentError(f"inconsistent graph: rank {ctx.rank} " + " and ".join(parts))
    signature = (
        (0,) * 5 if problem or flat is None else (flat.size, dtype_code(flat), 0, validation.code("neighbor"), 0)
    )
    validation.check(ctx, "neighbor_allreduce", problem, signature, lambda: ({}, DTYPE_CODES))


def _mix(flat: FlatBuffer, weights: NeighborWeights, comm: MPI.Comm, y: Any) -> None:
    """Exchange with the neighbors and combine in a fixed order (module docstring) into
    ``y`` (``flat.data`` itself, or a buffer like it)."""
    x, n, dtype = flat.data, flat.size, flat.dtype
    received = [scratch(x, n, slot=_RECV + k) for k in range(len(weights.sources))]
    pending = [irecv(comm, r, j) for r, (j, _) in zip(received, weights.sources)]
    pending += [isend(comm, x, j) for j in weights.destinations]
    waitall(pending, comm, tuple(sorted({j for j, _ in weights.sources} | set(weights.destinations))))
    xp = array_module(x)
    half = dtype in _HALF
    cast = int if dtype in _INTEGER else float
    if half:
        acc, term = scratch(x, n, slot=_ACC, dtype=np.float32), scratch(x, n, slot=_TERM, dtype=np.float32)
        widen(x, acc, dtype)
        xp.multiply(acc, cast(weights.self_weight), out=acc)
    else:
        acc = y
        xp.multiply(x, cast(weights.self_weight), out=acc)
    for r, (_, w) in zip(received, weights.sources):
        if half:
            widen(r, term, dtype)
            r = term
        xp.multiply(r, cast(w), out=r)
        xp.add(acc, r, out=acc)
    if half:
        narrow(acc, y, dtype)
