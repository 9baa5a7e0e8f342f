"""Shared-memory all-reduce: the ranks of a node reduce in one MPI-3 shared segment.

Inside a node, message passing copies every byte twice (into the library's
shared cells and out again) and then reduces it. Here the node's ranks map one
shared segment (``MPI_Win_allocate_shared`` on the node communicator) and
read each other's data directly. The vector is cut into pieces of at most
:data:`SEGMENT` bytes; two buffers alternate, each with an input slot per
rank and one result slot, so memory stays bounded and a piece's slots stay in
cache. Phases for piece k (q ranks on the node):

1. copy-in: every rank copies piece k into its input slot;
2. barrier;
3. reduce, one of two ways:

   * replicated (q = 2, or vectors up to :data:`REPLICATE` bytes): every rank
     combines all q input slots, in rank order, straight into its vector.
     One barrier per piece and no copy-out; each rank reads q slots. On two
     ranks a rank reads only its peer's slot and combines it with its own
     vector, which the copy-in left in cache (measured 1.2-1.9x faster from
     1 to 64 MiB than reading both slots).
   * sliced (otherwise): rank i combines slice i (of q, by
     :func:`~collectives.transport.chunks.chunk_bounds`) of all q input slots, in rank
     order, into slice i of the result slot; after the next piece's barrier
     (or a last one) every rank copies the whole result slot into its
     vector. s + 1 barriers for s pieces; each rank reads about one piece.

Either way every element is computed by the same operations in the same
order, so all ranks end bitwise identical. The argument check rides along:
every rank writes its signature header into the segment before the first
barrier and reads all headers after it (:meth:`Segment.post`,
:meth:`Segment.headers`), so it costs no extra synchronisation
(:class:`Carried`: such a call with what it looks up resolved once). A call
whose check fails gives back the buffer it took (:meth:`Segment.verify`),
leaving the segment as the plain check (post, barrier, verify) leaves it on
a rank whose call failed before it reached the segment.

Across nodes (:func:`hierarchical`): the node's sum is reduced this way onto
the node leader only, the leaders run a ring all-reduce
(:mod:`collectives.kernels.ring`), or up to :data:`LEADERS_DOUBLING` bytes
recursive doubling (:mod:`collectives.kernels.butterfly`: lg m exchanges
instead of 2(m-1)), and each leader broadcasts through the segment (one
barrier per piece). With the argument check on, small vectors take the
check's path instead, which does the same with the check riding along
(:mod:`collectives.validation`).

Cost on one node, s = ceil(n / SEGMENT) pieces, b = s barriers replicated or
s + 1 sliced: b alpha_shm + n beta_shm, alpha_shm being one barrier with the
per-piece work around it, beta_shm the per-byte cost of the copy-in, the
reduction and (sliced) the copy-out. Across m nodes: reduce b alpha_shm +
n beta_shm, plus 2(m-1) alpha_inter + 2n(m-1)/m beta_inter + n(m-1)/m gamma
among the leaders (recursive doubling: lg m (alpha_inter + n beta_inter +
n gamma)), plus broadcast s alpha_shm + n beta_shm. No byte crosses
MPI inside a node.

Synchronisation: each rank owns a counter on its own cache line; a barrier
publishes the rank's next count and waits until every peer's counter has
reached it. ``MPI_Win_sync`` (the memory barrier of the MPI-3 unified model)
orders the data writes before the counter and the reads after it. A buffer is
written again only two pieces later, after a barrier every rank reaches only
once it has finished reading it. A waiting rank spins briefly (not at all on
a machine with fewer cores than ranks, where the peer it waits for may need the
core it would spin on), then yields the core, or, where its thread's waits poll
(:func:`~collectives.transport.p2p.poll_waits`), sleeps with back-off: a
yielding rank keeps its core busy whenever no other rank is runnable, which
on a node of mostly sleeping workers is most of the time. It is watched by
the stall inspector
(:mod:`collectives.transport.watchdog`). The ranks post their process ids at
creation; every :data:`ALIVE_EVERY` seconds of waiting a rank makes sure the
peer it waits for still exists, and raises
:class:`~collectives.errors.CollectiveError` naming it if it has ended (a
launcher may leave the others running), instead of waiting forever.

Reference: MPI-3.1 section 11.2.3 (shared-memory windows) and 11.7
(the unified memory model); Li, Hoefler & Snir, "NUMA-aware shared-memory
collective communication for MPI", HPDC 2013 (replicated and sliced
reductions); Jain et al., "Optimizing MPI Collectives with Shared Memory",
2018 (MPICH's intra-node release/gather collectives follow the same pattern).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveError
from ..topology.hierarchy import node_comms
from ..topology.layout import Layout, cores_per_rank, detected
from ..transport import p2p
from ..transport.chunks import chunk_bounds
from ..transport.context import Context
from ..transport.ops import Reduction
from . import butterfly, ring

#: Bytes of the vector one buffer holds per rank (the size of a piece).
SEGMENT = 1 << 20
#: Vectors up to this many bytes are reduced replicated on nodes of more than two ranks.
REPLICATE = 64 << 10
#: Vectors up to this many bytes are reduced among node leaders by recursive
#: doubling (lg m exchanges between m nodes), larger ones by the ring: the size up
#: to which the argument check carries them the same way (validation's FUSE_LIMIT),
#: so that the calibration times what a checked call runs.
LEADERS_DOUBLING = 64 << 10
#: Bytes of a rank's argument header (validation's signature).
HEADER = 48

_LINE = 64  # one cache line per counter: no false sharing while peers poll
#: Polls before a waiting rank starts yielding the core (none on an oversubscribed machine).
SPINS = 200

#: Seconds between checks, while a rank waits for a peer, that the peer's process exists.
ALIVE_EVERY = 1.0

#: A check run after the first barrier (every rank's header is posted); it
#: raises to abandon the call with the caller's buffer untouched.
Check = Callable[["Segment"], None]


class Segment:
    """The shared window of one node's ranks, allocated once and reused.

    Layout (all of it allocated by the node's rank 0, mapped by every rank):
    q counters, one cache line each; two rows of q headers of :data:`HEADER`
    bytes, used alternately (a rank may post its next header while a slower
    peer still reads the last one); then two buffers, each q input slots and
    one result slot of ``capacity`` bytes.

    ``spins``: how often a rank waiting in :meth:`barrier` polls before it yields
    (:func:`spins`). Collective over ``comm`` (the node communicator) to create and
    to free. Only one thread may use a segment at a time, as with any communicator.
    """

    def __init__(self, comm: MPI.Comm, capacity: int | None = None, spins: int = SPINS) -> None:
        self.comm = comm
        self._spins = spins
        self.size = q = comm.Get_size()
        self.rank = me = comm.Get_rank()
        self.capacity = capacity = SEGMENT if capacity is None else capacity
        control = q * _LINE + -(-2 * q * HEADER // _LINE) * _LINE
        self._win = MPI.Win.Allocate_shared(control + 2 * (q + 1) * capacity if me == 0 else 0, 1, comm=comm)  # type: ignore[arg-type]  # a node communicator
        self._raw = np.frombuffer(self._win.Shared_query(0)[0], np.uint8)  # type: ignore[call-overload]  # an MPI buffer
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._counters = memoryview(self._raw[: q * _LINE]).cast("q")
        self._mine = me * _LINE // 8
        self._peers = tuple(i * _LINE // 8 for i in range(q) if i != me)
        headers = memoryview(self._raw[q * _LINE : q * _LINE + 2 * q * HEADER])
        # Per row: every rank's headers, and this rank's own (sliced once: a slice costs per call).
        self._rows = tuple(headers[r * q * HEADER : (r + 1) * q * HEADER] for r in (0, 1))
        self._posts = tuple(row[me * HEADER : (me + 1) * HEADER] for row in self._rows)
        self._row = 0
        self._data = control
        self._count = 0
        self._counters[self._mine] = 0
        self._counters[self._mine + 1] = os.getpid()  # on the counter's line, after it
        self._win.Sync()
        comm.Barrier()
        self._win.Sync()
        # Peers' processes, by counter index, where this rank can see them (one PID namespace).
        self._pids = {i: pid for i in self._peers if _alive(pid := self._counters[i + 1])}
        self._lost: CollectiveError | None = None  # set once a peer has ended
        self._turn = 0
        self._views: dict[tuple[int, int, str], _Views] = {}

    def barrier(self) -> None:
        """Wait until every rank of the node has reached this barrier; what a rank
        wrote to the segment before it is visible to all after it.

        Raises:
            CollectiveError: a peer's process ended before it reached the barrier
                (checked every :data:`ALIVE_EVERY` seconds of waiting), now or before.
        """
        if self._lost is not None:
            raise self._lost
        self._win.Sync()
        self._count += 1
        count, counters = self._count, self._counters
        counters[self._mine] = count
        for i in self._peers:
            if counters[i] < count:
                self._wait(i, count)
        self._win.Sync()

    def _wait(self, i: int, count: int) -> None:
        """Wait until counter ``i`` reaches ``count``: spin, then yield the core (on a
        thread whose waits poll, :func:`~collectives.transport.p2p.poll_waits`: sleep
        with back-off); every :data:`ALIVE_EVERY` seconds make sure the peer's process
        still exists."""
        counters = self._counters
        for _ in range(self._spins):
            if counters[i] >= count:
                return
        blocked = p2p.watch(self.comm, (i * 8 // _LINE,))
        pid, due = self._pids.get(i), time.monotonic() + ALIVE_EVERY
        pause = p2p.Backoff().sleep if p2p.polls() else os.sched_yield
        try:
            while counters[i] < count:
                pause()
                if pid is not None and time.monotonic() > due:
                    if not _alive(pid) and counters[i] < count:
                        self._dead(i * 8 // _LINE, pid)
                    due = time.monotonic() + ALIVE_EVERY
        finally:
            blocked.since = 0.0

    def _dead(self, rank: int, pid: int) -> None:
        """Raise the error of a peer (``rank`` of the node) whose process has ended; the
        segment is lost (it raises again on every use)."""
        world = p2p.world_ranks(self.comm)[rank]
        self._lost = CollectiveError(
            f"mpidl: rank {world} of MPI_COMM_WORLD (process {pid}, on this node) has ended in the middle of "
            f"a shared-memory collective; rank {MPI.COMM_WORLD.Get_rank()} cannot finish it"
        )
        raise self._lost

    def post(self, header: bytes) -> None:
        """Write this rank's argument header of :data:`HEADER` bytes (every rank
        posts one per check; peers read it after the next barrier)."""
        self._row ^= 1
        self._posts[self._row][:] = header

    def headers(self) -> bytes:
        """Every rank's last posted header, in rank order."""
        return self._rows[self._row].tobytes()

    def views(self, count: int, dtype: np.dtype) -> _Views:
        """The current buffer's slots as ``count`` elements of ``dtype``, and flip to
        the other buffer for the next piece."""
        key = (self._turn, count, dtype.char)  # the char, not the dtype: int64 is "l" or "q", whose buffers differ
        self._turn ^= 1
        found = self._views.get(key)
        if found is None:
            if len(self._views) > 256:
                self._views.clear()
            found = self._views[key] = _Views(self, key[0], count, dtype)
        return found

    def verify(self, check: Check) -> None:
        """Run a call's ``check`` after its first barrier. If it raises, the call is
        abandoned: take back the flip of its first piece's :meth:`views`, so the
        segment is left as on a rank whose call failed before it took a buffer
        (:func:`collectives.validation.check`: post, barrier, verify) — every
        rank ends with the same turn, header row and barrier count."""
        try:
            check(self)
        except BaseException:
            self._turn ^= 1
            raise

    def free(self) -> None:
        """Release the window (collective over the node communicator; after a peer
        ended, :meth:`_wait`, it is left to the process's end: freeing would wait
        for the peer)."""
        self._views.clear()
        self._counters.release()
        for view in self._posts + self._rows:
            view.release()
        self._raw = None
        self._win.Unlock_all()
        if self._lost is None:
            self._win.Free()


class _Views:
    """One buffer's slots seen as arrays: this rank's input slot (as a memoryview), every rank's
    input slot, this rank's slice of every input slot, its slice of the result
    slot, and the whole result slot."""

    __slots__ = ("inputs", "mine", "out", "result", "slices")

    def __init__(self, seg: Segment, turn: int, count: int, dtype: np.dtype) -> None:
        nbytes = count * dtype.itemsize
        base = seg._data + turn * (seg.size + 1) * seg.capacity
        slots = [
            seg._raw[base + i * seg.capacity : base + i * seg.capacity + nbytes].view(dtype)
            for i in range(seg.size + 1)
        ]
        bounds = chunk_bounds(count, seg.size)
        lo, hi = bounds[seg.rank], bounds[seg.rank + 1]
        self.mine: Any = memoryview(slots[seg.rank])  # copied into per call: cheaper than numpy's slice assignment
        self.inputs = tuple(slots[:-1])
        self.slices = tuple(s[lo:hi] for s in self.inputs)
        self.out = slots[-1][lo:hi]
        self.result = slots[-1]


def allreduce(x: Any, seg: Segment, red: Reduction, check: Check | None = None, root_only: bool = False) -> None:
    """Reduce the host array ``x`` in place over the ranks of ``seg``'s node.

    Args:
        check: called once after the first barrier (every rank's header
            posted); if it raises, ``x`` is untouched.
        root_only: only the node's rank 0 receives the result; the other
            ranks' ``x`` is left as it was.
    """
    p2p.count_sent(x.nbytes)
    receives = seg.rank == 0 or not root_only
    if seg.size == 2 or x.nbytes <= REPLICATE:
        if x.nbytes <= seg.capacity:  # one piece: the small-message path, no slicing
            _replicated(x, seg, red, check, receives)
            return
        step = seg.capacity // x.itemsize
        for off in range(0, x.shape[0], step):
            _replicated(x[off : off + step], seg, red, check, receives)
            check = None
    else:
        _sliced(x, seg, red, check, receives)


def _replicated(part: np.ndarray, seg: Segment, red: Reduction, check: Check | None, receives: bool) -> None:
    """One piece, replicated: copy in, barrier, every receiving rank folds all input slots
    into ``part``; on two ranks, ``part`` itself (still in cache) stands for the own slot."""
    v = seg.views(part.shape[0], part.dtype)
    v.mine[:] = part
    seg.barrier()
    if check is not None:
        seg.verify(check)
    if not receives:
        return
    if seg.size == 2:
        red.combine(part, v.inputs[1 - seg.rank], seg.rank == 1)
    else:
        red.fold(part, v.inputs)


class Carried:
    """A checked all-reduce of host vectors of one length and dtype over all of
    ``seg``'s ranks, resolved once: calling it on ``x`` does what ``seg.post(header)``
    and ``allreduce(x, seg, red, check)`` do. A vector of one piece on the replicated
    path (every vector up to :data:`REPLICATE` bytes, and up to a piece on two ranks)
    takes the views of both buffers from here and compares the posted headers with
    ``header`` repeated (every rank's, when all agree) before it calls ``check``: a small
    all-reduce's few microseconds are mostly such Python work."""

    __slots__ = ("_dtype", "_peer", "_turns", "agreed", "check", "header", "red", "seg")

    def __init__(self, seg: Segment, count: int, dtype: np.dtype, red: Reduction, header: bytes, check: Check) -> None:
        self.seg, self.red, self.header, self.check = seg, red, header, check
        self.agreed = header * seg.size  # every rank's header, when all agree
        nbytes = count * dtype.itemsize
        one = 0 < nbytes <= seg.capacity and (seg.size == 2 or nbytes <= REPLICATE)
        self._turns = (_Views(seg, 0, count, dtype), _Views(seg, 1, count, dtype)) if one else None
        self._dtype = dtype  # the views' buffer format: int64 may come as "l" or "q", which differ
        self._peer = 1 - seg.rank if seg.size == 2 else None  # whose slot is folded into x (as _replicated)

    def __call__(self, x: np.ndarray) -> None:
        """Reduce ``x`` (of the length and dtype given) in place; if the check fails,
        raise with ``x`` untouched."""
        seg, turns = self.seg, self._turns
        seg.post(self.header)
        if turns is None or x.dtype is not self._dtype:
            allreduce(x, seg, self.red, self.check)
            return
        p2p.count_sent(x.nbytes)
        v = turns[seg._turn]
        seg._turn ^= 1
        v.mine[:] = x
        seg.barrier()
        if seg.headers() != self.agreed:
            seg.verify(self.check)
        peer = self._peer
        if peer is None:
            self.red.fold(x, v.inputs)
        else:
            self.red.combine(x, v.inputs[peer], peer == 0)


def _sliced(x: np.ndarray, seg: Segment, red: Reduction, check: Check | None, receives: bool) -> None:
    """All pieces, sliced: each rank folds its slice into the result slot; the result
    of piece k is copied out after piece k + 1's barrier (or a last one)."""
    step = seg.capacity // x.itemsize
    n = x.shape[0]
    pending = None
    for off in range(0, n, step):
        part = x[off : off + step] if n > step else x
        v = seg.views(part.shape[0], part.dtype)
        v.mine[:] = part
        seg.barrier()
        if check is not None:
            seg.verify(check)
            check = None
        if pending is not None:
            pending[0][:] = pending[1]  # copy-out: (vector part, result slot)
        red.fold(v.out, v.slices)
        pending = (part, v.result) if receives else None
    seg.barrier()
    if pending is not None:
        pending[0][:] = pending[1]


def broadcast(x: Any, seg: Segment) -> None:
    """Copy the node's rank 0's host array ``x`` into every rank's ``x``."""
    step = seg.capacity // x.itemsize
    n = x.shape[0]
    root = seg.rank == 0
    if root:
        p2p.count_sent(x.nbytes)
    for off in range(0, n, step):
        part = x[off : off + step] if n > step else x
        v = seg.views(part.shape[0], part.dtype)
        if root:
            v.result[:] = part
        seg.barrier()
        if not root:
            part[:] = v.result


def hierarchical(x: Any, seg: Segment | None, leaders: MPI.Comm, red: Reduction) -> None:
    """Reduce the host array ``x`` in place over several nodes: shared-memory
    reduce onto each node's leader, all-reduce among the leaders (``leaders``;
    COMM_NULL on other ranks; recursive doubling up to :data:`LEADERS_DOUBLING`
    bytes, else the ring), shared-memory broadcast.
    ``seg`` is None on a node of one rank."""
    if seg is not None:
        allreduce(x, seg, red, root_only=True)
    if leaders != MPI.COMM_NULL:
        (butterfly if x.nbytes <= LEADERS_DOUBLING else ring).allreduce(x, leaders, red)
    if seg is not None:
        broadcast(x, seg)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the process exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def shared(ctx: Context) -> Segment | None:
    """The segment of all of ``ctx``'s ranks if there are several and they share
    one node's memory, else None (collective on first use: it detects and allocates)."""
    found = ctx.cache.get("shm", False)
    if found is False:
        one_node = ctx.size > 1 and detected(ctx).nodes == 1
        found = ctx.cache["shm"] = Segment(ctx.comm, spins=spins(ctx)) if one_node else None
    return found


def spins(ctx: Context) -> int:
    """How long a rank of ``ctx``'s communicator polls in a barrier before it yields:
    :data:`SPINS` times, or not at all where its machine has fewer cores than ranks
    (:func:`~collectives.topology.layout.cores_per_rank`), since there the peer it
    waits for may need the very core it would spin on."""
    return SPINS if cores_per_rank(ctx) >= 1 else 0


def capable(ctx: Context, lay: Layout) -> bool:
    """Whether every node of ``lay`` (which may be emulated) lies in one real
    shared-memory node (collective on first use: it detects)."""
    real = detected(ctx).node_of
    return all(len({real[r] for r in lay.members(k)}) == 1 for k in range(lay.nodes))


def node_segment(ctx: Context, lay: Layout) -> Segment | None:
    """The segment of this rank's node in ``lay``, None on a node of one rank
    (collective on first use; the layout must be :func:`capable`)."""
    if lay.nodes == 1:
        return shared(ctx)
    key = ("shm", lay.node_of)
    found = ctx.cache.get(key, False)
    if found is False:
        node, _ = node_comms(ctx, lay)
        found = ctx.cache[key] = Segment(node, spins=spins(ctx)) if node.Get_size() > 1 else None
    return found
