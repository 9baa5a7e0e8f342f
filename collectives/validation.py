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

Checking is on by default; pass ``validate=False``, call
:func:`set_default`, or set ``MPIDL_VALIDATE=0`` before start-up to skip it,
after which a disagreement is undefined behaviour (an MPI error, a hang or a
wrong result), as with MPI itself.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .errors import ArgumentError
from .kernels import shm
from .kernels.fold import fold_of
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

    Returns:
        True if ``data`` was given and now holds the reduction.
    """
    seg = shm.shared(ctx)
    if seg is not None:
        seg.post(header(problem, signature))
        seg.barrier()
        verify(ctx, what, problem, signature, names, seg.headers(), fields)
        return False
    f = fold_of(ctx.rank, ctx.size)
    nbytes = 0 if data is None else data.nbytes
    out = scratch(_U8_EMPTY, _H + FUSE_LIMIT, slot=2)
    got = scratch(_U8_EMPTY, _H + FUSE_LIMIT, slot=3)
    ref: tuple[int, ...] = (0,) * (len(FIELDS) - 1) if problem is not None else tuple(signature)
    flag = int(problem is not None)
    combine = None
    if data is not None and nbytes:
        assert red is not None, "data to reduce needs its reduction"
        combine = red.combine
        mine = out[_H : _H + nbytes].view(data.dtype)
        theirs = got[_H : _H + nbytes].view(data.dtype)
        np.copyto(mine, data)
    comm, status, size = ctx.comm, _status(ctx), _H + nbytes

    def merge(peer: int) -> None:
        nonlocal flag, ref
        pflag, *fields = _HEADER.unpack_from(got)
        pref = tuple(fields)
        flag |= pflag | (status.Get_count(_BYTE) != size) | (pref != ref)
        if peer < ctx.rank:
            ref = pref
        if combine is not None and not flag:
            combine(mine, theirs, src_first=peer < ctx.rank)

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
    if flag:
        _raise(ctx, what, problem, signature, names(), fields)
    if nbytes:
        np.copyto(data, mine)
    return bool(nbytes)


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
    if headers != headers[:_H] * ctx.size or headers[:8] != _CLEAR:
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
