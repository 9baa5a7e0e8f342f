"""Point-to-point transfers of 1-D arrays, the only way the algorithms move data.

Arrays travel as raw bytes (``MPI.BYTE``): every reduction is done by
:mod:`collectives.ops`, so MPI never needs to know the element type, and
float16/bfloat16 need no MPI datatype. Host (numpy) arrays go to MPI directly;
other arrays go through the transport registered for their type in
:data:`DEVICE_TRANSPORTS` (device memory: direct GPU-aware MPI or staging).

Blocking (:func:`send`, :func:`recv`, :func:`sendrecv`) and nonblocking
(:func:`isend`, :func:`irecv`, then :func:`waitall`) forms are offered; a
nonblocking call returns a handle whose ``Wait()`` completes it (an
``MPI.Request`` for host arrays; a transport may return its own handle, e.g.
one that copies a staged receive to the device when waited on). The buffer of
a pending transfer must not be touched until it is waited on.

Every blocking call marks the thread as waiting on its peers for the stall
inspector (:mod:`collectives.watchdog`). Every payload byte sent through this
module is counted per thread
(:func:`bytes_sent`), so training algorithms can report their traffic exactly.
The shared-memory all-reduce (:mod:`collectives.shm`) counts the bytes each
rank copies into the shared segment for its peers (:func:`count_sent`). The
argument check's messages (:mod:`collectives.validation`), and the small
butterfly all-reduces that ride in them, bypass this module and are not
counted; the training algorithms run their steps unchecked, so their counts
are exact.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Optional, Protocol

import numpy as np
from mpi4py import MPI

from . import watchdog

#: Tag of every message the algorithms send on their private communicators.
TAG = 0x6D70  # "mp"

_BYTE = MPI.BYTE


class Pending(Protocol):
    """A started nonblocking transfer."""

    def Wait(self) -> Any: ...


class Transport(Protocol):
    """How arrays of one kind (e.g. CuPy) reach MPI."""

    def sendrecv(self, comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None: ...
    def send(self, comm: MPI.Comm, buf: Any, dest: int) -> None: ...
    def recv(self, comm: MPI.Comm, buf: Any, source: int) -> None: ...
    def isend(self, comm: MPI.Comm, buf: Any, dest: int) -> Pending: ...
    def irecv(self, comm: MPI.Comm, buf: Any, source: int) -> Pending: ...


#: Transports for array types other than numpy.ndarray, keyed by type.
DEVICE_TRANSPORTS: dict[type, Transport] = {}


class _Sent(threading.local):
    total = 0
    slot: Optional[watchdog.Slot] = None


_sent = _Sent()
_clock = time.perf_counter


def operation(name: str) -> None:
    """Name the operation this thread's next transfers belong to (for the stall inspector)."""
    s = _sent.slot
    if s is None:
        s = _sent.slot = watchdog.slot()
    s.operation = name


def watch(comm: MPI.Comm, peers: tuple[int, ...]) -> watchdog.Slot:
    """Mark this thread blocked on ``peers`` of ``comm`` for the stall inspector;
    the caller sets ``since = 0.0`` on the returned slot when done."""
    s = _sent.slot
    if s is None:
        s = _sent.slot = watchdog.slot()
    s.comm, s.peers, s.since = comm, peers, _clock()
    return s


def bytes_sent() -> int:
    """Payload bytes this thread has sent through this module since it started."""
    return _sent.total


def count_sent(nbytes: int) -> None:
    """Count ``nbytes`` this thread handed to its peers another way (through shared memory)."""
    _sent.total += nbytes


def sendrecv(comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None:
    """Send ``send`` to ``dest`` while receiving exactly ``recv``'s size into it from ``source``."""
    _sent.total += send.nbytes
    s = watch(comm, (dest, source))
    try:
        if type(send) is np.ndarray:
            comm.Sendrecv([send, _BYTE], dest, TAG, [recv, _BYTE], source, TAG)
        else:
            DEVICE_TRANSPORTS[type(send)].sendrecv(comm, send, dest, recv, source)
    finally:
        s.since = 0.0


def send(comm: MPI.Comm, buf: Any, dest: int) -> None:
    """Send ``buf`` to ``dest`` (blocking)."""
    _sent.total += buf.nbytes
    s = watch(comm, (dest,))
    try:
        if type(buf) is np.ndarray:
            comm.Send([buf, _BYTE], dest, TAG)
        else:
            DEVICE_TRANSPORTS[type(buf)].send(comm, buf, dest)
    finally:
        s.since = 0.0


def recv(comm: MPI.Comm, buf: Any, source: int) -> None:
    """Receive into ``buf`` from ``source`` (blocking)."""
    s = watch(comm, (source,))
    try:
        if type(buf) is np.ndarray:
            comm.Recv([buf, _BYTE], source, TAG)
        else:
            DEVICE_TRANSPORTS[type(buf)].recv(comm, buf, source)
    finally:
        s.since = 0.0


def isend(comm: MPI.Comm, buf: Any, dest: int) -> Pending:
    """Start sending ``buf`` to ``dest``; ``buf`` must stay unchanged until waited on."""
    _sent.total += buf.nbytes
    if type(buf) is np.ndarray:
        return comm.Isend([buf, _BYTE], dest, TAG)
    return DEVICE_TRANSPORTS[type(buf)].isend(comm, buf, dest)


def irecv(comm: MPI.Comm, buf: Any, source: int) -> Pending:
    """Start receiving exactly ``buf``'s size into ``buf`` from ``source``."""
    if type(buf) is np.ndarray:
        return comm.Irecv([buf, _BYTE], source, TAG)
    return DEVICE_TRANSPORTS[type(buf)].irecv(comm, buf, source)


def waitall(pending: Iterable[Pending], comm: Optional[MPI.Comm] = None, peers: tuple[int, ...] = ()) -> None:
    """Complete every transfer in ``pending`` (all must have been started); ``comm``
    and ``peers`` name them for the stall inspector."""
    s = watch(comm, peers)
    try:
        for p in pending:
            p.Wait()
    finally:
        s.since = 0.0
