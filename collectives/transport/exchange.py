"""The step every reducing algorithm repeats: send a block, receive the matching
block from a peer and combine it into place, in cache-sized segments.

Receiving a whole chunk into scratch memory and then combining it reads and
writes the chunk through main memory twice; receiving and combining one
segment at a time keeps the scratch in cache. Measured on 2 ranks of one
machine (MPICH wheel): a 64 MiB ring all-reduce took 17.9 ms unsegmented and
14.5 ms with 256 KiB segments (16 MiB: 4.5 -> 4.1 ms). The segments are
pipelined: segment k+1's transfers are started (into the other of two scratch
slots) before segment k is combined, so a network link is not left idle while
a segment is reduced, nor the reduction waiting for a message's round trip. Device (GPU) buffers
are exchanged whole: with CUDA-aware Open MPI on one H100, 256 KiB segments
made a 64 MiB ring all-reduce take 74 ms.

A thread whose waits poll (:func:`~collectives.transport.p2p.poll_waits`:
the service threads) uses segments of :data:`POLLED_SEGMENT`: it sees a
segment arrive up to one poll interval late, and its peer answers a large
message's rendezvous only when it polls, so each segment can leave a link
idle for that long. Measured on two emulated nodes with 1 Gbit/s links, a
16.3 MiB all-reduce of two ranks, polling: 152-165 ms with 256 KiB
segments, 144-145 ms with 1 MiB ones (blocking, 145-163 ms with the cores
100 % busy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .ops import Reduction
from .p2p import Pending, irecv, isend, polls, sendrecv, waitall
from .scratch import scratch

#: Segment size in bytes.
SEGMENT = 256 << 10

#: Segment size in bytes of a thread whose waits poll (module docstring).
POLLED_SEGMENT = 1 << 20


def sendrecv_combine(
    comm: MPI.Comm, send: Any, dest: int, into: Any, source: int, red: Reduction, src_first: bool, longest: int
) -> None:
    """Send ``send`` to ``dest`` while receiving from ``source`` a block as long as
    ``into`` and combining it into ``into`` (``into <- op(received, into)`` if
    ``src_first``, else ``op(into, received)``).

    Blocks are cut into segments; every rank taking part must pass the same
    ``longest`` (an upper bound on every block of the exchange, e.g. the
    largest chunk), so that all send and receive the same number of segments,
    the shorter blocks' last ones empty, and run it on threads of one kind:
    all polling or none (the segment size: module docstring).
    """
    # Device memory has no cache to stay in, and each message costs far more
    # than on the host: one segment.
    step = (
        max(1, (POLLED_SEGMENT if polls() else SEGMENT) // into.itemsize)
        if type(into) is np.ndarray
        else max(longest, 1)
    )
    segments = -(-max(longest, 1) // step)
    slot = min(step, into.shape[0])
    if segments == 1:
        buf = scratch(into, slot)
        sendrecv(comm, send, dest, buf, source)
        red.combine(into, buf, src_first)
        return
    tmp = scratch(into, 2 * slot)

    def start(k: int) -> tuple[list[Pending], Any]:
        """Start segment k's transfers, into the scratch slot k mod 2."""
        off = k * step
        buf = tmp[(k % 2) * slot :][: into[off : off + step].shape[0]]
        return [irecv(comm, buf, source), isend(comm, send[off : off + step], dest)], buf

    pending, buf = start(0)
    for k in range(segments):
        waitall(pending, comm, (dest, source))
        got = into[k * step : (k + 1) * step]
        if k + 1 < segments:
            pending, nxt = start(k + 1)  # in flight while segment k is combined
        red.combine(got, buf, src_first)
        if k + 1 < segments:
            buf = nxt
