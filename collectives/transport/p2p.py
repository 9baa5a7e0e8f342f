"""Point-to-point transfers of 1-D arrays, the only way the algorithms move data.

Arrays travel as raw bytes (``MPI.BYTE``): every reduction is done by
:mod:`collectives.transport.ops`, so MPI never needs to know the element type, and
float16/bfloat16 need no MPI datatype. Host (numpy) arrays go to MPI directly;
other arrays go through the transport registered for their type in
:data:`DEVICE_TRANSPORTS` (device memory: direct GPU-aware MPI or staging).

Blocking (:func:`send`, :func:`recv`, :func:`sendrecv`) and nonblocking
(:func:`isend`, :func:`irecv`, then :func:`waitall`) forms are offered; a
nonblocking call returns a handle whose ``Wait()`` completes it and whose
``Test()`` says whether it has completed (an ``MPI.Request`` for host arrays;
a transport may return its own handle, e.g. one that copies a staged receive
to the device when it completes). The buffer of a pending transfer must not be
touched until it has completed.

Threads that wait for a peer while the process computes (the service
threads of :class:`collectives.transport.background.Background`) poll instead of
blocking: a blocking MPI call busy-waits and would take a core from the
computation. Such a thread calls :func:`poll_waits` once, and from then on
every wait of this module, blocking calls included, tests its transfers with
:class:`Backoff` sleeps in between (host arrays; a device transport waits its
own way); so do the shared-memory barrier (:mod:`collectives.kernels.shm`) and
the argument check (:mod:`collectives.validation`, through :func:`complete`)
on that thread. A worker's main thread polls too where many workers share few
cores and each leaves its core idle most of a step (``mpidl train
--step-time``): a rank waiting for a peer must not take the core of one that
computes. Measured on two emulated nodes with 1 Gbit/s links
(``docs/performance.rst``): an all-reduce of 16.6 MiB kept the machine's
cores 100 % busy while blocking, 14 % while polling, in the same time.
Such a thread also needs the GIL promptly when a message comes, while the
main thread may be computing in Python: the interpreter hands the GIL over
only every ``sys.getswitchinterval()`` seconds (5 ms by default), which
would add up to that to every reply; :func:`prompt_threads` lowers the
interval, and every service thread calls it when it starts
(:func:`collectives.transport.threads.start` does).

Every blocking call marks the thread as waiting on its peers for the stall
inspector (:mod:`collectives.transport.watchdog`); so does :func:`waiting` around
a wait of another kind (an MPI collective, the end of a thread). Every payload byte sent
through this module is counted per thread (:func:`bytes_sent`), so training
algorithms can report their traffic exactly, and per destination for the
whole process (:func:`bytes_by_peer`, keyed by ``MPI_COMM_WORLD`` rank, for
any communicator, sub-communicator or P-Reduce group), so that the bytes that
cross nodes can be told from those that stay inside one. The shared-memory
all-reduce (:mod:`collectives.kernels.shm`) counts the bytes each rank copies
into the shared segment for its peers (:func:`count_sent`; destination
:data:`SHARED_MEMORY`); the MPI library's own all-reduce
(:mod:`collectives.kernels.native`) counts an estimate (destination
:data:`MPI_LIBRARY`). The
argument check's messages (:mod:`collectives.validation`), and the small
butterfly all-reduces that ride in them, bypass this module and are not
counted; the training algorithms run their steps unchecked, so their counts
are exact.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from . import watchdog

#: Tag of every message the algorithms send on their private communicators.
TAG = 0x6D70  # "mp"

_BYTE = MPI.BYTE


class Pending(Protocol):
    """A started nonblocking transfer."""

    def Wait(self) -> Any: ...
    def Test(self) -> bool: ...


class Transport(Protocol):
    """How arrays of one kind (e.g. CuPy) reach MPI."""

    def sendrecv(self, comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None: ...
    def send(self, comm: MPI.Comm, buf: Any, dest: int) -> None: ...
    def recv(self, comm: MPI.Comm, buf: Any, source: int) -> None: ...
    def isend(self, comm: MPI.Comm, buf: Any, dest: int) -> Pending: ...
    def irecv(self, comm: MPI.Comm, buf: Any, source: int) -> Pending: ...


#: Transports for array types other than numpy.ndarray, keyed by type.
DEVICE_TRANSPORTS: dict[type, Transport] = {}


#: The destination under which :func:`bytes_by_peer` counts bytes copied through shared memory.
SHARED_MEMORY = -1
#: The destination under which :func:`bytes_by_peer` counts bytes handed to the MPI
#: library's own collectives (:mod:`collectives.kernels.native`: an estimate).
MPI_LIBRARY = -2


class _Sent(threading.local):
    """What one thread sent: in all, and by destination (world rank)."""

    slot: watchdog.Slot | None = None
    poll = False  # this thread's waits poll (poll_waits)

    def __init__(self) -> None:
        self.by_peer: dict[int, int] = {}
        with _threads_lock:
            _threads.append(self.by_peer)


_threads: list[dict[int, int]] = []  # every thread's by_peer, also of threads that ended
_threads_lock = threading.Lock()
_sent = _Sent()
_WORLD_RANKS = MPI.Comm.Create_keyval()  # attribute: the world rank of each rank of a communicator
_clock = time.perf_counter


def operation(name: str) -> None:
    """Name the operation this thread's next transfers belong to (for the stall inspector)."""
    s = _sent.slot
    if s is None:
        s = _sent.slot = watchdog.slot()
    s.operation = name


def watch(comm: MPI.Comm | None, peers: tuple[int, ...]) -> watchdog.Slot:
    """Mark this thread blocked on ``peers`` of ``comm`` for the stall inspector;
    the caller sets ``since = 0.0`` on the returned slot when done."""
    s = _sent.slot
    if s is None:
        s = _sent.slot = watchdog.slot()
    s.comm, s.peers, s.since = comm, peers, _clock()
    return s


@contextmanager
def waiting(comm: MPI.Comm, peers: tuple[int, ...] | None = None) -> Iterator[None]:
    """Mark this thread blocked on ``peers`` of ``comm`` (default: every other rank)
    for the stall inspector while the block runs: a wait that does not go through
    this module (an MPI collective, a thread's end)."""
    if peers is None:
        rank = comm.Get_rank()
        peers = tuple(r for r in range(comm.Get_size()) if r != rank)
    s = watch(comm, peers)
    try:
        yield
    finally:
        s.since = 0.0


def bytes_sent() -> int:
    """Payload bytes this thread has sent through this module since it started."""
    return sum(_sent.by_peer.values())


def bytes_by_peer() -> dict[int, int]:
    """Payload bytes every thread of this process has sent, by destination: the
    destination's rank in ``MPI_COMM_WORLD``, or :data:`SHARED_MEMORY`."""
    out: dict[int, int] = {}
    with _threads_lock:
        tables = [dict(t) for t in _threads]  # dict() copies atomically under the GIL
    for table in tables:
        for peer, n in table.items():
            out[peer] = out.get(peer, 0) + n
    return out


def count_sent(nbytes: int, dest: int = SHARED_MEMORY) -> None:
    """Count ``nbytes`` this thread sent to ``dest``: a world rank (this module's
    transfers), or sent another way, through shared memory (the default) or
    (:data:`MPI_LIBRARY`) to the MPI library's collectives."""
    by_peer = _sent.by_peer  # one look-up of the thread's state: the hot path of small messages
    by_peer[dest] = by_peer.get(dest, 0) + nbytes


def world_ranks(comm: Any) -> Sequence[int]:
    """The ``MPI_COMM_WORLD`` rank of every rank of ``comm``, cached on the
    communicator (a group of ranks that is no communicator translates its own)."""
    if not isinstance(comm, MPI.Comm):
        return comm.world_ranks()
    table: Sequence[int] | None = comm.Get_attr(_WORLD_RANKS)  # type: ignore[assignment]  # what Set_attr stored
    if table is None:
        table = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group())
        comm.Set_attr(_WORLD_RANKS, table)
    return table


def sendrecv(comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None:
    """Send ``send`` to ``dest`` while receiving exactly ``recv``'s size into it from ``source``."""
    count_sent(send.nbytes, world_ranks(comm)[dest])
    s = watch(comm, (dest, source))
    try:
        if type(send) is np.ndarray and _sent.poll:
            _poll([comm.Irecv([recv, _BYTE], source, TAG), comm.Isend([send, _BYTE], dest, TAG)])
        elif type(send) is np.ndarray:
            comm.Sendrecv([send, _BYTE], dest, TAG, [recv, _BYTE], source, TAG)
        else:
            DEVICE_TRANSPORTS[type(send)].sendrecv(comm, send, dest, recv, source)
    finally:
        s.since = 0.0


def send(comm: MPI.Comm, buf: Any, dest: int) -> None:
    """Send ``buf`` to ``dest`` (blocking)."""
    count_sent(buf.nbytes, world_ranks(comm)[dest])
    s = watch(comm, (dest,))
    try:
        if type(buf) is np.ndarray and _sent.poll:
            _poll([comm.Isend([buf, _BYTE], dest, TAG)])
        elif type(buf) is np.ndarray:
            comm.Send([buf, _BYTE], dest, TAG)
        else:
            DEVICE_TRANSPORTS[type(buf)].send(comm, buf, dest)
    finally:
        s.since = 0.0


def recv(comm: MPI.Comm, buf: Any, source: int) -> None:
    """Receive into ``buf`` from ``source`` (blocking)."""
    s = watch(comm, (source,))
    try:
        if type(buf) is np.ndarray and _sent.poll:
            _poll([comm.Irecv([buf, _BYTE], source, TAG)])
        elif type(buf) is np.ndarray:
            comm.Recv([buf, _BYTE], source, TAG)
        else:
            DEVICE_TRANSPORTS[type(buf)].recv(comm, buf, source)
    finally:
        s.since = 0.0


def isend(comm: MPI.Comm, buf: Any, dest: int) -> Pending:
    """Start sending ``buf`` to ``dest``; ``buf`` must stay unchanged until waited on."""
    count_sent(buf.nbytes, world_ranks(comm)[dest])
    if type(buf) is np.ndarray:
        return comm.Isend([buf, _BYTE], dest, TAG)
    return DEVICE_TRANSPORTS[type(buf)].isend(comm, buf, dest)


def irecv(comm: MPI.Comm, buf: Any, source: int) -> Pending:
    """Start receiving exactly ``buf``'s size into ``buf`` from ``source``."""
    if type(buf) is np.ndarray:
        return comm.Irecv([buf, _BYTE], source, TAG)
    return DEVICE_TRANSPORTS[type(buf)].irecv(comm, buf, source)


def waitall(
    pending: Iterable[Pending], comm: MPI.Comm | None = None, peers: tuple[int, ...] = (), *, poll: bool = False
) -> None:
    """Complete every transfer in ``pending`` (all must have been started); ``comm``
    and ``peers`` name them for the stall inspector. ``poll``: test with
    :class:`Backoff` sleeps in between instead of blocking (for a thread that
    must leave the cores to the computation; always so after :func:`poll_waits`)."""
    s = watch(comm, peers)
    try:
        if poll or _sent.poll:
            _poll(list(pending))
        else:
            for p in pending:
                p.Wait()
    finally:
        s.since = 0.0


def poll_waits(enabled: bool = True) -> bool:
    """Make every later wait of this module on this thread poll (module docstring),
    or block again (``enabled=False``); returns whether they polled before."""
    before, _sent.poll = _sent.poll, enabled
    return before


def polls() -> bool:
    """Whether this thread's waits poll (:func:`poll_waits`)."""
    return _sent.poll


def _poll(pending: Sequence[Pending]) -> None:
    """Test ``pending`` with :class:`Backoff` sleeps in between until all have completed."""
    backoff = Backoff()
    while not test(pending):
        backoff.sleep()


def complete(request: MPI.Request, status: MPI.Status | None = None) -> None:
    """Complete one started MPI request, blocking or, on a thread whose waits poll
    (:func:`poll_waits`), testing it with :class:`Backoff` sleeps in between;
    ``status`` receives its status. (For transfers outside this module's
    counting, e.g. the argument check's headers.)"""
    if not _sent.poll:
        request.Wait(status)
        return
    backoff = Backoff()
    while not request.Test(status):
        backoff.sleep()


#: Longest GIL switch interval a process with service threads keeps (seconds).
SWITCH_INTERVAL = 5e-4


def prompt_threads() -> None:
    """Let threads take the GIL at least every :data:`SWITCH_INTERVAL` seconds (module docstring)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)


def test(pending: Sequence[Pending]) -> bool:
    """Whether every transfer in ``pending`` has completed; each is tested (and so
    progressed) every time, completed ones included."""
    return all([p.Test() for p in pending])


class Backoff:
    """Sleeps for a polling loop: short while messages keep coming, growing (by
    doubling, from ``first`` to ``longest`` seconds) while none does, so an idle
    poller costs little CPU and a busy one little latency."""

    def __init__(self, first: float = 10e-6, longest: float = 250e-6) -> None:
        self.first, self.longest = first, longest
        self.delay = first

    def reset(self) -> None:
        """Something arrived: poll soon again."""
        self.delay = self.first

    def sleep(self) -> None:
        """Nothing arrived: sleep, and sleep longer next time."""
        time.sleep(self.delay)
        self.delay = min(self.longest, 2 * self.delay)
