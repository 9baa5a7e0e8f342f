"""Cross-rank agreement check run before (or together with) a collective.

Every rank has a small integer signature: a local-problem flag, then length,
dtype, op, algorithm and options, packed into a 48-byte header
(:func:`header`).

On a communicator whose ranks all share one node's memory, every rank writes
its header into the communicator's shared segment (:mod:`collectives.kernels.shm`),
passes one shared-memory barrier and compares all headers (:func:`verify`):
no message at all. The shared-memory all-reduce posts its header the same
way and uses its own first barrier, so there the check costs nothing extra.
Where the check fails the two are interchangeable: each posts one header and
passes one barrier, and an all-reduce abandoned after it gives back the buffer
it took (:meth:`~collectives.kernels.shm.Segment.verify`), so ranks that took
different paths (one has a bad buffer, another does not) meet at the same
barrier and leave the segment alike. Where it passes, every rank took the same
path: :mod:`collectives.api` chooses it from state all ranks share.

Elsewhere the check is a recursive-doubling exchange
of a 48-byte header on the private communicator, folded for non-powers of two
like the butterfly (:mod:`collectives.kernels.fold`): each rank carries a flag and a
reference signature (the lowest rank's of the ranks it has heard from); on
every exchange the flags OR together with "the two references differ" and
"the message had an unexpected size", and both partners keep the lower
rank's reference. After lg p steps every rank holds the same flag, set iff
some rank had a local problem or two signatures differ — and no message can
be larger than any receive posted, so a disagreement never truncates, hangs
or half-runs: a set flag makes every rank gather the signatures once more
and raise the same :class:`ArgumentError`, naming the ranks and values, with
the caller's buffer untouched.

For the butterfly on small vectors (up to :data:`FUSE_LIMIT` bytes) on those
communicators the data rides in the same messages, after the header, and is
combined in scratch space; it is copied to the caller's buffer only if the
final flag is clear. So the check costs no extra message there; elsewhere it
costs lg p small exchanges before the algorithm runs. On a thread whose waits
poll (:func:`collectives.transport.p2p.poll_waits`) the exchanges poll too, as
the shared-memory barrier does.

Across nodes of which some hold several ranks (as detected, :func:`nodes`)
the check goes in three stages: each node's ranks post their headers in the
node's segment and compare them after one barrier; the node leaders run the
recursive doubling above among themselves, a node whose headers differed
entering it with its flag set; each leader posts the verdict in its segment
and its ranks read it after a second barrier. Only lg m messages cross
between m nodes (lg p before), and it is the shared-memory algorithm's
("shm") small vectors that ride along: summed onto each leader by
:func:`collectives.kernels.shm.allreduce` (``root_only``; its first barrier
is the node stage's), reduced in the leaders' messages, and handed to the
node in the segment's result slot, which the leader fills with a clear
verdict before the second barrier: all in scratch space, copied to the
caller's buffer once the verdict is clear. The two stages in the segment
are interchangeable with the bare check's, as on one node, so ranks on the
bare and on the fused path meet at the same barriers and raise alike.

Across nodes a short vector of the MPI library's all-reduce ("mpi") can carry
the check in the library's own call, where the call is the one expected
(:class:`Expected`). Every check that all ranks passed is remembered, with the
check that came next; a check that followed another :data:`SURE` times in a row
is expected after it. That history is the same on every rank, so every rank
expects the same call. Then each rank, before anything else, runs that
call's ``MPI_Allreduce`` of the vector and one tag after it, on a copy:
every rank whose own call is the expected one puts in its vector and the tag
"same", and any other (another call, a bad buffer) zeros and the tag
"other", chosen per op so that the reduced tag is "same" only where every
rank's was (:data:`_TAGS`). So the library's call has the same count,
datatype and op on every rank whatever the ranks called. Where the tag says
same, every rank's signature was the expected one and the copy, with the
NaNs made alike, goes to the caller's buffer; otherwise no buffer changed
and the full check above follows and raises, or passes for a call that was
merely not the expected one. A call that repeats costs one library call, two
copies of the vector and a few lookups; a call that was not expected, one
short library call more than before. Calls that follow one another in a
fixed cycle (a training step's all-reduces) are all expected once the cycle
has run twice.

Checking is on by default; pass ``validate=False``, call
:func:`set_default`, or set ``MPIDL_VALIDATE=0`` before start-up to skip it,
after which a disagreement is undefined behaviour (an MPI error, a hang or a
wrong result), as with MPI itself.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Hashable, Sequence
from functools import lru_cache
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .errors import ArgumentError
from .kernels import native, shm
from .kernels.fold import fold_of
from .topology.hierarchy import node_comms
from .topology.layout import detected
from .transport import p2p
from .transport.context import Context
from .transport.ops import Reduction
from .transport.scratch import scratch

#: Names of the signature fields, in order.
FIELDS = ("error", "length", "dtype", "op", "algorithm", "options")

#: Largest vector (bytes) carried together with the check.
FUSE_LIMIT = 64 << 10

_HEADER = struct.Struct("<6q")  # flag, then the signature
_H = _HEADER.size
_CLEAR = bytes(8)  # a zero flag
_TAG = 0x6D71
_BYTE = MPI.BYTE
_U8 = np.dtype(np.uint8)

_FALSE = {"0", "false", "no", "off"}


_default = os.environ.get("MPIDL_VALIDATE", "1").strip().lower() not in _FALSE


def enabled(validate: bool | None) -> bool:
    """Resolve a ``validate=`` argument; None means the default (see :func:`set_default`)."""
    return _default if validate is None else bool(validate)


def set_default(validate: bool) -> None:
    """Set the default for ``validate=None``.

    The initial default is on unless ``MPIDL_VALIDATE`` is 0/false/no/off when
    :mod:`collectives` is imported (reading the environment on every call
    would cost microseconds).
    """
    global _default
    _default = bool(validate)


@lru_cache(maxsize=1024)
def code(name: str) -> int:
    """A stable integer code for a name (op, algorithm, option string)."""
    return zlib.crc32(name.encode())


def check(
    ctx: Context,
    what: str,
    problem: ArgumentError | None,
    signature: Sequence[int],
    names: Callable[[], Sequence[dict[int, str]]] = tuple,
    data: Any = None,
    red: Reduction | None = None,
    fields: Sequence[str] = FIELDS[1:],
    native: bool = False,
) -> bool:
    """Raise the same ArgumentError on every rank unless all agree and none has a problem.

    Collective over ``ctx.comm``.

    Args:
        ctx: the communicator's context.
        what: the operation, for the message; must be the same on every rank.
        problem: this rank's local argument error, if any.
        signature: ints for FIELDS[1:] (ignored where ``problem`` is set).
        names: called only to word an error: per field after "error", a map
            from code to a readable name.
        data: optionally, a host 1-D array of at most FUSE_LIMIT bytes to
            all-reduce with ``red`` by recursive doubling in the same messages
            (every rank must pass one, of the same size).
        fields: what the error message calls the signature's fields (default
            FIELDS[1:]).
        native: ``data`` goes through the MPI library's all-reduce on
            ``ctx.comm`` (the "mpi" plan): it is reduced here only where the
            check rides in that all-reduce (:class:`Expected`).

    Returns:
        True if ``data`` was given and now holds the reduction.
    """
    seg = shm.shared(ctx)
    if seg is not None:
        seg.post(header(problem, signature))
        seg.barrier()
        verify(ctx, what, problem, signature, names, seg.headers(), fields)
        return False
    key = None if problem is not None else (what, tuple(signature), native)
    expect = expected(ctx)
    if expect.next is not None:
        if expect.ride(data if expect.rides.get(key) is expect.next else None):
            expect.hit(key)
            return True
        expect.misses += 1  # someone's call was another: the full check says whose
    rider, data = (data, None) if native else (None, data)  # the library's data, or the check's
    nbytes = 0 if data is None else data.nbytes
    if nbytes:
        assert red is not None, "data to reduce needs its reduction"
    flag = int(problem is not None)
    ref: tuple[int, ...] = (0,) * (len(FIELDS) - 1) if problem is not None else tuple(signature)
    mine = _outgoing(data) if nbytes else None
    split = nodes(ctx)
    status = _status(ctx)
    if split is None:
        flag = _agree(ctx.comm, status, flag, ref, mine, red)
    else:
        flag, mine = _hierarchical(split, status, header(problem, signature), flag, ref, mine, red)
    if flag:
        expect.failed()
        _raise(ctx, what, problem, signature, names(), fields)
    if mine is not None:
        np.copyto(data, mine)  # the result: every rank's of a flat check, else the leader's or its node's
    expect.passed(key, rider, red)
    return bool(nbytes)


#: Times in a row one check must have followed another before it is expected after it.
SURE = 2

#: The tag of a rank whose call is the expected one, and of one whose call is not, per op:
#: reduced over the ranks, the tag is the first only where every rank's call is the expected.
_TAGS = {"sum": (0, 1), "avg": (0, 1), "prod": (1, 0), "min": (0, -1), "max": (0, 1)}
_KEYS = 1024  # checks remembered per communicator


class _Ride:
    """An all-reduce of the library's that the check can ride in: the reduction, the vector
    and tag in the rider's buffer (all of it, and the vector's part), and the tags."""

    __slots__ = ("floats", "head", "message", "other", "red", "same")

    def __init__(self, buffer: np.ndarray, n: int, red: Reduction) -> None:
        self.message, self.head, self.red = buffer[: n + 1], buffer[:n], red
        self.same, self.other = _TAGS[red.op]
        self.floats = buffer.dtype.kind == "f"  # whose NaNs are made alike


class Expected:
    """Which agreed check followed which on a communicator whose ranks span nodes, and
    so the check expected next where it rides in the MPI library's all-reduce (module
    docstring). Every rank holds the same: it changes only with checks that all ranks
    passed, or failed, together."""

    __slots__ = ("after", "buffers", "comm", "hits", "last", "misses", "next", "others", "rides", "sure")

    def __init__(self, comm: MPI.Comm) -> None:
        self.after: dict[Hashable, tuple[Hashable, int]] = {}  # a check -> the next one, times in a row
        self.sure: dict[Hashable, Hashable] = {}  # a check -> the ride that followed it SURE times in a row
        self.rides: dict[Hashable, _Ride] = {}  # the checks of the library's all-reduces
        self.buffers: dict[np.dtype, np.ndarray] = {}  # per dtype, room for the longest ride
        self.last: Hashable | None = None
        self.next: _Ride | None = None  # expected next
        self.hits = self.misses = 0
        self.comm, self.others = comm, native.peers(comm)

    def ride(self, data: np.ndarray | None) -> bool:
        """The expected all-reduce (:attr:`next`) with a tag after the vector: ``data``
        where this rank's call is the expected one, else zeros and the other tag. True:
        every rank's call was the expected one, and ``data`` holds the reduction; False:
        some rank's was not, and no caller's buffer changed."""
        ride = self.next
        assert ride is not None
        message, head = ride.message, ride.head
        if data is None:
            head.fill(0)
            message[-1] = ride.other
        else:
            head[...] = data
            message[-1] = ride.same
        native.library(message, self.comm, ride.red, self.others)
        if data is None or message[-1] != ride.same:
            return False
        if ride.floats:
            native.same_nans(head)
        data[...] = head
        return True

    def hit(self, key: Hashable) -> None:
        """Every rank's call was the expected one, ``key``."""
        self.hits += 1
        self.last = key
        self.next = self.rides.get(self.sure.get(key))

    def passed(self, key: Hashable, data: np.ndarray | None = None, red: Reduction | None = None) -> None:
        """Every rank passed the full check ``key`` (``data``: the vector of an all-reduce
        of the library's, whose shape a ride repeats)."""
        last = self.last
        follows = self.after.get(last)
        if follows is None or follows[0] != key or follows[1] < SURE or (data is not None and key not in self.rides):
            self._learn(last, follows, key, data, red)
        self.last = key
        self.next = self.rides.get(self.sure.get(key))

    def _learn(
        self,
        last: Hashable | None,
        follows: tuple[Hashable, int] | None,
        key: Hashable,
        data: np.ndarray | None,
        red: Reduction | None,
    ) -> None:
        """Note that ``key`` followed ``last`` (``follows``: what did before), and the ride of ``data``."""
        if len(self.after) >= _KEYS:
            self.after.clear()
            self.sure.clear()
            self.rides.clear()
            follows = None
        if data is not None and key not in self.rides:
            assert red is not None
            room = self.buffers.get(data.dtype)
            if room is None:
                room = self.buffers[data.dtype] = np.empty(FUSE_LIMIT // data.itemsize + 1, data.dtype)
            self.rides[key] = _Ride(room, data.shape[0], red)
        if last is None:
            return
        times = 1 + (follows[1] if follows is not None and follows[0] == key else 0)
        self.after[last] = (key, times)
        if times >= SURE and key in self.rides:
            self.sure[last] = key
        else:
            self.sure.pop(last, None)

    def failed(self) -> None:
        """Every rank raised at a check: nothing is expected until checks pass again."""
        self.last = self.next = None


def expected(ctx: Context) -> Expected:
    """The :class:`Expected` of ``ctx``'s communicator (local)."""
    found = ctx.cache.get("validation-expected")
    if found is None:
        found = ctx.cache["validation-expected"] = Expected(ctx.comm)
    return found


class Nodes:
    """How the check of a communicator that spans nodes, some of several ranks, goes:
    this rank's node's segment (None on a node of one rank), the leaders'
    communicator (COMM_NULL on a rank that leads no node) and the layout."""

    __slots__ = ("leaders", "node_of", "segment")

    def __init__(self, segment: shm.Segment | None, leaders: MPI.Comm, node_of: tuple[int, ...]) -> None:
        self.segment, self.leaders, self.node_of = segment, leaders, node_of


def nodes(ctx: Context) -> Nodes | None:
    """The :class:`Nodes` the check of ``ctx``'s communicator goes through where its ranks
    span several nodes (as detected: no override applies) and some node has several
    ranks, else None: the check is one recursive doubling over all ranks (collective on
    first use: it detects, splits and allocates)."""
    found = ctx.cache.get("validation-nodes", False)
    if found is False:
        lay = detected(ctx)
        found = None
        if 1 < lay.nodes < ctx.size:
            _, leaders = node_comms(ctx, lay)
            found = Nodes(shm.node_segment(ctx, lay), leaders, lay.node_of)
        ctx.cache["validation-nodes"] = found
    return found


def _outgoing(data: np.ndarray) -> np.ndarray:
    """``data`` copied into the outgoing message's scratch, after the header: that view."""
    out = scratch(_U8_EMPTY, _H + FUSE_LIMIT, slot=2)
    mine = out[_H : _H + data.nbytes].view(data.dtype)
    np.copyto(mine, data)
    return mine


def _hierarchical(
    split: Nodes,
    status: MPI.Status,
    mine_header: bytes,
    flag: int,
    ref: tuple[int, ...],
    mine: np.ndarray | None,
    red: Reduction | None,
) -> tuple[int, np.ndarray | None]:
    """The check across nodes, with ``mine`` (in the outgoing scratch) reduced along:
    inside each node through its segment (every header compared; ``mine`` summed onto
    the leader), the leaders' recursive doubling (:func:`_agree`), then the leader's
    flag posted to its node, with the result in the segment's result slot where the
    flag is clear. Every rank returns the same flag, and where it is clear and
    ``mine`` was given, the result (the leader's ``mine``, the others' result slot)."""
    seg, leads = split.segment, split.leaders != MPI.COMM_NULL
    if seg is not None:
        seg.post(mine_header)
        if mine is None:
            seg.barrier()
            flag |= _differ(seg.headers(), seg.size)
        else:
            assert red is not None
            try:
                shm.allreduce(mine, seg, red, _node_check, root_only=True)
            except _NodeDisagrees:
                flag = 1
    if leads:
        flag = _agree(split.leaders, status, flag, ref, None if flag else mine, red)
    if seg is None:
        return flag, mine
    seg.post(_HEADER.pack(flag, *ref))
    if leads and mine is not None and not flag:  # published with the verdict, in the same barrier
        seg.views(mine.shape[0], mine.dtype).result[:] = mine
        p2p.count_sent(mine.nbytes)
    seg.barrier()
    flag = int(seg.headers()[:8] != _CLEAR)  # the leader's (node rank 0) verdict
    if mine is None or flag or leads:
        return flag, mine
    return flag, seg.views(mine.shape[0], mine.dtype).result  # the buffer the leader wrote (its turn too)


class _NodeDisagrees(Exception):
    """The headers in a node's segment differ (the check's node stage, inside the
    shared-memory reduction: raised there to give the buffer back)."""


def _node_check(seg: shm.Segment) -> None:
    if _differ(seg.headers(), seg.size):
        raise _NodeDisagrees


def _differ(headers: bytes, size: int) -> int:
    """1 if the ``size`` ranks' headers differ or flag a problem, else 0."""
    return int(headers != headers[:_H] * size or headers[:8] != _CLEAR)


def _agree(
    comm: MPI.Comm,
    status: MPI.Status,
    flag: int,
    ref: tuple[int, ...],
    mine: np.ndarray | None,
    red: Reduction | None,
) -> int:
    """The recursive-doubling check over ``comm`` (module docstring), from this rank's
    ``flag`` and reference signature ``ref``; ``mine`` (data in the outgoing scratch,
    after the header, or None) is reduced with ``red`` in the same messages. Returns
    the flag every rank ends with; where it is clear, ``mine`` holds the result."""
    rank, f = comm.Get_rank(), fold_of(comm.Get_rank(), comm.Get_size())
    out = scratch(_U8_EMPTY, _H + FUSE_LIMIT, slot=2)
    got = scratch(_U8_EMPTY, _H + FUSE_LIMIT, slot=3)
    nbytes = 0 if mine is None else mine.nbytes
    combine = theirs = None
    if mine is not None and nbytes:
        assert red is not None, "data to reduce needs its reduction"
        combine = red.combine
        theirs = got[_H : _H + nbytes].view(mine.dtype)
    size = _H + nbytes

    def merge(peer: int) -> None:
        nonlocal flag, ref
        pflag, *fields = _HEADER.unpack_from(got)
        pref = tuple(fields)
        flag |= pflag | (status.Get_count(_BYTE) != size) | (pref != ref)
        if peer < rank:
            ref = pref
        if combine is not None and not flag:
            combine(mine, theirs, src_first=peer < rank)

    _HEADER.pack_into(out, 0, flag, *ref)
    blocked = p2p.watch(comm, f.peers + ((f.partner,) if f.partner is not None else ()))
    try:
        if f.partner is not None and f.newrank is None:  # folded out: hand over, wait for the result
            _exchange(comm, out[:size], f.partner, None, status)
            _exchange(comm, None, f.partner, out, status)
            flag, *fields = _HEADER.unpack_from(out)
            ref = tuple(fields)
            flag |= status.Get_count(_BYTE) != size
        else:
            if f.partner is not None:
                _exchange(comm, None, f.partner, got, status)
                merge(f.partner)
                _HEADER.pack_into(out, 0, flag, *ref)
            for peer in f.peers:
                _exchange(comm, out[:size], peer, got, status)
                merge(peer)
                _HEADER.pack_into(out, 0, flag, *ref)
            if f.partner is not None:
                _exchange(comm, out[:size], f.partner, None, status)
    finally:
        blocked.since = 0.0
    return flag


_U8_EMPTY = np.empty(0, np.uint8)


def _exchange(comm: MPI.Comm, send: np.ndarray | None, peer: int, recv: np.ndarray | None, status: MPI.Status) -> None:
    """Send ``send`` to and/or receive into ``recv`` from ``peer`` (``status``: the
    receive's), blocking, or polled where this thread's waits poll
    (:func:`~collectives.transport.p2p.poll_waits`)."""
    if not p2p.polls():
        if send is not None and recv is not None:
            comm.Sendrecv([send, _BYTE], peer, _TAG, [recv, _BYTE], peer, _TAG, status)
        elif send is not None:
            comm.Send([send, _BYTE], peer, _TAG)
        else:
            comm.Recv([recv, _BYTE], peer, _TAG, status)
        return
    receiving = comm.Irecv([recv, _BYTE], peer, _TAG) if recv is not None else None
    if send is not None:
        p2p.complete(comm.Isend([send, _BYTE], peer, _TAG))
    if receiving is not None:
        p2p.complete(receiving, status)


def header(problem: ArgumentError | None, signature: Sequence[int]) -> bytes:
    """This rank's header: the problem flag, then the signature (zeros with a problem)."""
    return _HEADER.pack(1, *(0,) * (len(FIELDS) - 1)) if problem is not None else _HEADER.pack(0, *signature)


def verify(
    ctx: Context,
    what: str,
    problem: ArgumentError | None,
    signature: Sequence[int],
    names: Callable[[], Sequence[dict[int, str]]],
    headers: bytes,
    fields: Sequence[str] = FIELDS[1:],
) -> None:
    """Raise the same ArgumentError on every rank unless ``headers`` (every rank's
    :func:`header`, in rank order) are all alike and flag no problem."""
    if _differ(headers, ctx.size):
        _raise(ctx, what, problem, signature, names(), fields)


def _status(ctx: Context) -> MPI.Status:
    status = ctx.cache.get("validation-status")
    if status is None:
        status = ctx.cache["validation-status"] = MPI.Status()
    return status


def _raise(
    ctx: Context,
    what: str,
    problem: ArgumentError | None,
    signature: Sequence[int],
    names: Sequence[dict[int, str]],
    fields: Sequence[str],
) -> None:
    """Gather everyone's signature and problem, then raise the error every rank raises alike."""
    rows = ctx.comm.allgather((str(problem), None) if problem is not None else (None, tuple(signature)))
    bad = [r for r, (message, _) in enumerate(rows) if message is not None]
    if bad:
        by_message: dict[str, list[int]] = {}
        for r in bad:
            by_message.setdefault(rows[r][0], []).append(r)
        detail = "; ".join(f"rank(s) {ranks}: {message}" for message, ranks in by_message.items())
        raise ArgumentError(f"{what}: invalid arguments on {detail} (no data moved)", bad)
    table = np.array([sig for _, sig in rows], dtype=np.int64)
    diffs = []
    for f in range(table.shape[1]):
        column = table[:, f]
        if (column != column[0]).any():
            lookup = names[f] if f < len(names) else {}
            values = ", ".join(f"rank {r}: {lookup.get(int(v), int(v))}" for r, v in enumerate(column))
            diffs.append(f"{fields[f]} differs across ranks ({values})")
    raise ArgumentError(f"{what}: ranks disagree: {'; '.join(diffs)} (no data moved)", _minority(table))


def _minority(rows: np.ndarray) -> list[int]:
    """Ranks whose signature differs from the most common one."""
    keys = [row.tobytes() for row in rows]
    common = max(keys, key=keys.count)  # first of the most common: same on every rank
    return [r for r, k in enumerate(keys) if k != common]
