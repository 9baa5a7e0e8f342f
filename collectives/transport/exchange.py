"""The step every reducing algorithm repeats: send a block, receive the matching
block from a peer and combine it into place, in cache-sized segments.

Receiving a whole chunk into scratch memory and then combining it reads and
writes the chunk through main memory twice; receiving and combining one
segment at a time keeps the scratch in cache. Measured on 2 ranks of one
machine (MPICH wheel): a 64 MiB ring all-reduce took 17.9 ms unsegmented and
14.5 ms with 256 KiB segments (16 MiB: 4.5 -> 4.1 ms). Device (GPU) buffers
are exchanged whole: with CUDA-aware Open MPI on one H100, 256 KiB segments
made a 64 MiB ring all-reduce take 74 ms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .ops import Reduction
from .p2p import sendrecv
from .scratch import scratch

#: Segment size in bytes.
SEGMENT = 256 << 10


def sendrecv_combine(
    comm: MPI.Comm, send: Any, dest: int, into: Any, source: int, red: Reduction, src_first: bool, longest: int
) -> None:
    """Send ``send`` to ``dest`` while receiving from ``source`` a block as long as
    ``into`` and combining it into ``into`` (``into <- op(received, into)`` if
    ``src_first``, else ``op(into, received)``).

    Blocks are cut into segments; every rank taking part must pass the same
    ``longest`` (an upper bound on every block of the exchange, e.g. the
    largest chunk), so that all send and receive the same number of segments,
    the shorter blocks' last ones empty.
    """
    # Device memory has no cache to stay in, and each message costs far more
    # than on the host: one segment.
    step = max(1, SEGMENT // into.itemsize) if type(into) is np.ndarray else max(longest, 1)
    tmp = scratch(into, min(step, into.shape[0]))
    for off in range(0, max(longest, 1), step):
        got = into[off : off + step]
        buf = tmp[: got.shape[0]]
        sendrecv(comm, send[off : off + step], dest, buf, source)
        red.combine(got, buf, src_first)
