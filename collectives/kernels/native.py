"""The MPI library's own all-reduce, as one more algorithm ("mpi").

Phases: one ``MPI_Allreduce(MPI_IN_PLACE)`` on the caller's buffer, with
the MPI datatype and op of the buffer's dtype and op (``avg`` reduces as
``sum``; the caller divides, as for every algorithm); then, for floats up to
:data:`SHORT_LIMIT` bytes that hold a NaN, every NaN is made the same quiet
NaN.

Why: MPI does not promise that every rank gets the same bits. In recursive
doubling the two ranks of an exchange combine the pair in opposite operand
orders. Sums and products are commutative, so finite results and infinities
come out the same, but a NaN keeps its own operand's payload and sign. MPICH
5.0.2 takes recursive doubling for vectors shorter than pof2, the largest
power of two not above the number of ranks, and there sums of NaNs of
different payloads differed between ranks (measured on 2 to 5 ranks); for
longer ones it reduces each block on one rank (reduce-scatter, then
all-gather), and every rank got the same bits at every length tested, NaN
payloads included (tests/test_allreduce.py). Other libraries take recursive
doubling for longer vectors (Open MPI 1.6's fixed decision: below 10,000
bytes), hence the generous limit. One ``x.dot(x)`` (NaN exactly where ``x``
holds one) finds the NaNs; only then are they rewritten. Integer results do
not depend on the order. ``auto`` in addition checks, on every size it
measures, that the library gives every rank the same bits
(:func:`collectives.tuning.sweep.identical`) and leaves "mpi" out where it
did not; an explicit "mpi" trusts the library beyond the limit, as a program
calling ``MPI_Allreduce`` does.

float16 and bfloat16 have no MPI datatype in the standard, and MPI's
``MPI_MIN`` and ``MPI_MAX`` on floats do not propagate NaNs as numpy's
``minimum`` and ``maximum`` (and so every other algorithm) do: MPICH
computes ``a < b ? a : b``, which keeps the second operand when either is NaN.
:func:`unsupported` names the problem (an explicit "mpi" raises it), and
``auto`` leaves "mpi" out there.

Cost: whatever the library's algorithm costs (MPICH: recursive doubling,
lg p (alpha + n beta + n gamma), below pof2 elements; Rabenseifner's
reduce-scatter + all-gather, 2 lg p alpha + 2n (p-1)/p beta + n (p-1)/p gamma,
for long ones, plus a temporary buffer it allocates per call); short float
vectors one more pass over n for the NaN scan.

Bytes: the library moves them, so :mod:`collectives.transport.p2p` cannot
count them. Each call counts 2 (p-1)/p n, the volume of a bandwidth-optimal
all-reduce, as handed to the library (destination
:data:`~collectives.transport.p2p.MPI_LIBRARY`): an estimate, not bytes seen.

Waits are shown to the stall inspector; on a thread whose waits poll
(:func:`collectives.transport.p2p.poll_waits`) the nonblocking forms are
started and tested with sleeps in between, so the thread leaves the cores to
the computation.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport import p2p
from ..transport.ops import Reduction

#: Largest float vector (bytes) whose NaNs are made alike after the call (module docstring).
SHORT_LIMIT = 64 << 10

DATATYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int32": MPI.INT32_T, "int64": MPI.INT64_T}
_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_INTEGERS = ("int32", "int64")


def unsupported(dtype: str, op: str) -> str | None:
    """Why the MPI library cannot reduce ``dtype`` with ``op`` as the other algorithms
    do (None if it can)."""
    if dtype not in DATATYPES:
        return f"algorithm 'mpi': MPI has no standard datatype for {dtype} (it reduces {', '.join(DATATYPES)})"
    if op in ("min", "max") and dtype not in _INTEGERS:
        return (
            f"algorithm 'mpi': MPI's {op} on {dtype} does not return NaN where an operand is NaN "
            "(MPICH keeps one operand or the other, depending on the order), unlike the other algorithms"
        )
    return None


def peers(comm: MPI.Comm) -> tuple[int, ...]:
    """The ranks of ``comm`` other than this one: whom a wait in the library waits for."""
    rank = comm.Get_rank()
    return tuple(r for r in range(comm.Get_size()) if r != rank)


def allreduce(x: Any, comm: MPI.Comm, red: Reduction, others: tuple[int, ...]) -> None:
    """Reduce the non-empty flat array ``x`` in place across ``comm`` with the
    library's ``MPI_Allreduce`` (module docstring); every rank ends with the same bits.
    ``others`` is :func:`peers` of ``comm`` (the plan keeps it: a call does not rebuild it)."""
    if not others:
        return
    library(x, comm, red, others)
    if red.dtype not in _INTEGERS and x.nbytes <= SHORT_LIMIT:
        same_nans(x)


def library(x: Any, comm: MPI.Comm, red: Reduction, others: tuple[int, ...]) -> None:
    """``MPI_Allreduce`` of ``x`` in place across ``comm`` (``others``: :func:`peers`), as
    the library computes it (NaN payloads may differ between ranks)."""
    p = len(others) + 1
    p2p.count_sent(2 * (p - 1) * x.nbytes // p, p2p.MPI_LIBRARY)
    spec, op = [x, DATATYPES[red.dtype]], _OPS[red.op]
    if p2p.polls():
        p2p.waitall([comm.Iallreduce(MPI.IN_PLACE, spec, op)], comm, others)
    else:
        s = p2p.watch(comm, others)  # as p2p.waiting does, without a generator's cost on the hot path
        try:
            comm.Allreduce(MPI.IN_PLACE, spec, op)
        finally:
            s.since = 0.0


def same_nans(x: Any) -> None:
    """Make every NaN of the float array ``x`` the same quiet NaN (one pass where there is none)."""
    square = x.dot(x)
    if square != square:
        x[x != x] = float("nan")
