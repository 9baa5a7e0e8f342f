"""Surviving a dead peer: ULFM (User-Level Failure Mitigation), where the MPI library has it.

Bland, Bouteiller, Herault, Bosilca & Dongarra, "Post-failure recovery of
MPI communication capability: Design and rationale", IJHPCA 27(3), 2013.
With ULFM a process that dies does not end the job: an operation that
involves it fails with ``MPIX_ERR_PROC_FAILED`` on the communicators whose
errors are returned (``MPI.ERRORS_RETURN``), and the survivors go on:

1. **revoke**: the rank that sees the failure revokes the communicator
   (:func:`revoke`), so that every operation on it, pending or later, fails
   with ``MPIX_ERR_REVOKED`` on every rank; nobody is left waiting for the
   dead. A failure seen inside a block of :func:`revoking` does it and raises
   :class:`PeerFailure`; the requests still pending there are completed
   (:func:`drain`).
2. **agree**: the survivors reach one verdict (:func:`agree`, ``MPI_Comm_agree``:
   a fault-tolerant AND of a flag, with the failure reported to all or to none).
3. **shrink**: the survivors build a communicator of themselves
   (:func:`shrink`, ``MPI_Comm_shrink``), and learn who is gone.

Cost: nothing while no one fails; a recovery is an agreement and a shrink,
each O(log p) messages of a few bytes (plus the failure detector's delay).

Where it is available (:func:`unavailable`): mpi4py must have the ULFM calls
(it compiles them out for MPICH) and, under Open MPI, the launcher must have
enabled them (``mpiexec --with-ft ulfm``, which sets the MCA parameter
``mpi_ft_enable``). Elsewhere a dead rank ends the job as it always did
(``docs/failures.rst``).

The end of the job: Open MPI's ``MPI_Finalize`` (5.0) first drains the failures
among the survivors (a shrink and a barrier of ``MPI_COMM_WORLD``), then waits
in a fence of the runtime (PMIx) over all of the job's processes, the dead
included, which the runtime sometimes never completes after
``MPI_COMM_WORLD`` rank 0 died (6 of 41 runs of 4 ranks on a busy 2-core machine;
none of 17 that killed rank 1; none of 55 that killed rank 0 with the fence
skipped). The launcher
option ``--mca async_mpi_finalize 1`` (:data:`LAUNCH_OPTIONS`) skips that fence;
the survivors are still synchronised by the shrink and barrier before it.
:func:`finalize_hazard` says where it is missing.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from mpi4py import MPI

from ..errors import ArgumentError, CollectiveError
from . import context, logs, p2p

log = logging.getLogger("collectives.faults")
C = TypeVar("C", bound=MPI.Comm)

#: Error classes that say a peer died, or that another rank saw one die and revoked the communicator.
FAILURE_CLASSES = frozenset(
    getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, name)
)

#: What a worker's death does to an algorithm that can survive it: end the job, or let the
#: survivors go on (:func:`survival`).
ON_FAILURE = ("abort", "continue")

#: Where Open MPI's launcher passes the MCA parameter that enables ULFM (``--with-ft ulfm`` sets it).
FT_ENABLE = "OMPI_MCA_mpi_ft_enable"
#: The Open MPI launcher options that skip MPI_Finalize's closing fence (module docstring), and
#: where the launcher passes them on.
LAUNCH_OPTIONS = ("--mca", "async_mpi_finalize", "1")
ASYNC_FINALIZE = "OMPI_MCA_async_mpi_finalize"


class PeerFailure(CollectiveError):
    """A peer died (or another rank saw one die): the communicator is revoked; the
    survivors :func:`agree` and :func:`shrink`."""


@functools.cache
def unsupported() -> str | None:
    """None where mpi4py has the ULFM calls for this MPI library; otherwise why not."""
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except NotImplementedError:
        return f"mpi4py has no ULFM calls (MPIX_Comm_revoke) for this MPI library ({_library()})"
    finally:
        probe.Free()
    return None


def unavailable() -> str | None:
    """None where ULFM can be used in this process; otherwise why not (a sentence)."""
    why = unsupported()
    if why is None and _library().startswith("Open MPI") and not _on(FT_ENABLE):
        why = f"{_library()} was started without fault tolerance (launch with mpiexec --with-ft ulfm)"
    return why


def finalize_hazard() -> str | None:
    """Where a survived failure may leave the survivors waiting in ``MPI_Finalize`` (Open MPI
    with ULFM, launched without :data:`LAUNCH_OPTIONS`; module docstring): what to do, as a
    sentence; None elsewhere."""
    if unavailable() is not None or not _library().startswith("Open MPI") or _on(ASYNC_FINALIZE):
        return None
    return (
        "after a worker died, Open MPI's MPI_Finalize may wait for it forever (its closing fence): "
        f"launch with mpiexec --with-ft ulfm {' '.join(LAUNCH_OPTIONS)}"
    )


def survival(on_failure: str, who: str, rank: int) -> bool:
    """Whether ``who`` (an algorithm's name) survives a worker's death: ``on_failure`` is
    "continue" and ULFM is available. Where it is asked for but not available, or where
    :func:`finalize_hazard` applies, rank 0 warns (saying what stays: the fail-fast abort).

    Raises:
        ArgumentError: ``on_failure`` is not one of :data:`ON_FAILURE`.
    """
    if on_failure not in ON_FAILURE:
        raise ArgumentError(f"unknown on_failure {on_failure!r}; valid: {', '.join(ON_FAILURE)}")
    if on_failure != "continue":
        return False
    why, hazard = unavailable(), finalize_hazard()
    if why is not None and rank == 0:
        warn(
            f"{who} on_failure='continue': ULFM is not available ({why}); "
            "a worker that dies ends the job (the fail-fast abort stays)"
        )
    if hazard is not None and rank == 0:
        warn(f"{who} on_failure='continue': {hazard}")
    return why is None


def _on(variable: str) -> bool:
    """Whether the MCA parameter the environment ``variable`` passes is true."""
    return os.environ.get(variable, "0").lower() in ("1", "true", "yes", "on")


def _library() -> str:
    """The MPI library's name and version, e.g. "Open MPI v5.0.11"."""
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an MPI error saying that a peer died or the communicator was revoked."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES


def returning(comm: C) -> C:
    """Make ``comm``'s errors return (raise ``MPI.Exception``) instead of aborting; returns it."""
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def revoke(comm: MPI.Comm) -> None:
    """Revoke ``comm`` (every rank's operations on it fail from now on); revoking it twice is harmless."""
    try:
        comm.Revoke()
    except MPI.Exception as exc:
        if not is_failure(exc):
            raise


def drain(pending: Iterable[Any]) -> None:
    """Complete started transfers on a revoked communicator, whatever their outcome:
    revoking completes every pending operation, so none waits for long."""
    for request in pending:
        try:
            request.Wait()
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise


@contextmanager
def revoking(comm: MPI.Comm | Sequence[MPI.Comm], pending: Iterable[Any] = ()) -> Iterator[None]:
    """Run the block; where it raises an MPI error of a dead peer (or of a revoked
    communicator), revoke ``comm`` (or each of a sequence of communicators), complete
    ``pending`` and raise :class:`PeerFailure`. Other errors pass unchanged."""
    try:
        yield
    except MPI.Exception as exc:
        if not is_failure(exc):
            raise
        for c in [comm] if isinstance(comm, MPI.Comm) else comm:
            revoke(c)
        drain(pending)
        raise PeerFailure(f"a peer failed or the communicator was revoked: {exc.Get_error_string()}") from exc


@contextmanager
def failing(comm: MPI.Comm | Sequence[MPI.Comm], survives: bool = True) -> Iterator[None]:
    """Where a worker's death is survived (``survives``): a block of :func:`revoking` (an MPI
    error of a dead peer, or of a revoked communicator, revokes ``comm`` or each of a
    sequence of communicators, so that every survivor sees it, and raises
    :class:`PeerFailure`) whose waits poll (:func:`~collectives.transport.p2p.poll_waits`):
    Open MPI (5.0) ends every blocked wait of a process with an error when it learns of a
    failure or a revocation, on whatever communicator, so a survivor that heard of a death
    late would see one on the survivors' new communicators (a recovery that lost no one
    was seen once); a test of a request is not ended so. Elsewhere the block runs as it is."""
    if not survives:
        yield
        return
    blocking = p2p.poll_waits(True)
    try:
        with revoking(comm):
            yield
    finally:
        p2p.poll_waits(blocking)


def agree(comm: MPI.Comm, flag: bool) -> bool:
    """Collective over the survivors of ``comm`` (revoked or not): True on every rank
    if every rank passed a true ``flag`` and no failure was reported; else False on
    every rank."""
    try:
        return bool(comm.Agree(int(flag)))
    except MPI.Exception as exc:
        if not is_failure(exc):
            raise
        return False


def shrink(comm: MPI.Comm) -> tuple[MPI.Intracomm, list[int]]:
    """Collective over the survivors of ``comm``: a new communicator of them (errors
    returned, ranks in their old order) and the ``MPI_COMM_WORLD`` ranks of those gone.
    The collectives' state of every communicator with one of those is left to the
    process's end (:func:`~collectives.transport.context.abandon`)."""
    survivors = returning(cast(MPI.Intracomm, comm.Shrink()))
    world = MPI.COMM_WORLD.Get_group()
    before = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world)
    after = set(MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())), world))
    lost = [r for r in before if r not in after]
    context.abandon(lost)
    return survivors, lost


def recover(comm: MPI.Comm, who: str, agreed: bool = False) -> tuple[MPI.Intracomm, list[int]]:
    """Collective over the survivors of ``comm``, revoked: agree that a peer failed (unless
    the caller did, ``agreed``) and :func:`shrink`; the stall inspector names the wait as
    ``who``'s (an algorithm's name) recovery."""
    p2p.operation(f"{who} recovery (agreeing with the survivors and shrinking the communicator)")
    with p2p.waiting(comm):
        if not agreed:
            agree(comm, False)
        return shrink(comm)


def false_alarm(who: str, rank: int) -> None:
    """Say (rank 0) that ``who``'s recovery found every worker alive: the agreement that
    ends a settle (``MPI_Comm_agree``) answered false with every rank passing true and no
    process failed (seen under Open MPI 5.0.11 on a loaded machine: docs/failures.rst).
    The caller goes on with the same workers on the caller's communicator; only the
    exchanges the recovery interrupted were settled, as after a death."""
    if rank == 0:
        warn(f"{who}: a recovery found no worker dead (the agreement failed without a failure); all continue")


def warn(message: str) -> None:
    """A warning on the ``collectives.faults`` logger (to stderr in the same form where
    logging is not configured)."""
    if log.hasHandlers():
        log.warning("%s", message)
    else:
        logs.write(message)
