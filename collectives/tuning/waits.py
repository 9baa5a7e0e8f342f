"""The tuning's collective waits, shown to the stall inspector (:mod:`collectives.transport.watchdog`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mpi4py import MPI

from ..transport import p2p

#: What the cost model's calibration (:mod:`collectives.tuning.calibration`) names its waits.
CALIBRATION = "the cost model's calibration"


@contextmanager
def waiting(comm: MPI.Comm, what: str, during: str = CALIBRATION) -> Iterator[None]:
    """Show the stall inspector that this thread waits in ``what``, a collective of
    ``during`` on all ranks of ``comm``, while the block runs."""
    me = comm.Get_rank()
    blocked = p2p.watch(comm, tuple(r for r in range(comm.Get_size()) if r != me))
    operation, blocked.operation = blocked.operation, f"{during} ({what})"
    try:
        yield
    finally:
        blocked.since, blocked.operation = 0.0, operation


def barrier(comm: MPI.Comm, during: str = CALIBRATION) -> None:
    """``MPI_Barrier`` on ``comm``, watched."""
    with waiting(comm, "Barrier", during):
        comm.Barrier()


def slowest(comm: MPI.Comm, seconds: float, during: str = CALIBRATION) -> float:
    """The largest of every rank's ``seconds`` (collective, watched)."""
    with waiting(comm, "Allreduce of the timings", during):
        return comm.allreduce(seconds, op=MPI.MAX)
