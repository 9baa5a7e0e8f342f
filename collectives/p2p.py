"""Point-to-point transfers of 1-D arrays, the only way the algorithms move data.

Arrays travel as raw bytes (``MPI.BYTE``): every reduction is done by
:mod:`collectives.ops`, so MPI never needs to know the element type, and
float16/bfloat16 need no MPI datatype. Host (numpy) arrays go to MPI directly;
other arrays go through the transport registered for their type in
:data:`DEVICE_TRANSPORTS` (device memory: direct GPU-aware MPI or staging).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

#: Tag of every message the algorithms send on their private communicators.
TAG = 0x6D70  # "mp"

_BYTE = MPI.BYTE


class Transport(Protocol):
    """How arrays of one kind (e.g. CuPy) reach MPI."""

    def sendrecv(self, comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None: ...
    def send(self, comm: MPI.Comm, buf: Any, dest: int) -> None: ...
    def recv(self, comm: MPI.Comm, buf: Any, source: int) -> None: ...


#: Transports for array types other than numpy.ndarray, keyed by type.
DEVICE_TRANSPORTS: dict[type, Transport] = {}


def sendrecv(comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None:
    """Send ``send`` to ``dest`` while receiving exactly ``recv``'s size into it from ``source``."""
    if type(send) is np.ndarray:
        comm.Sendrecv([send, _BYTE], dest, TAG, [recv, _BYTE], source, TAG)
    else:
        DEVICE_TRANSPORTS[type(send)].sendrecv(comm, send, dest, recv, source)


def send(comm: MPI.Comm, buf: Any, dest: int) -> None:
    """Send ``buf`` to ``dest`` (blocking)."""
    if type(buf) is np.ndarray:
        comm.Send([buf, _BYTE], dest, TAG)
    else:
        DEVICE_TRANSPORTS[type(buf)].send(comm, buf, dest)


def recv(comm: MPI.Comm, buf: Any, source: int) -> None:
    """Receive into ``buf`` from ``source`` (blocking)."""
    if type(buf) is np.ndarray:
        comm.Recv([buf, _BYTE], source, TAG)
    else:
        DEVICE_TRANSPORTS[type(buf)].recv(comm, buf, source)
