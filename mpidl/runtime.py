"""MPI start-up for mpidl programs: thread level, fail-fast, stall limits, this rank's place."""

from __future__ import annotations

import sys

from mpi4py import MPI

from collectives.transport import threads, watchdog
from collectives.transport.threads import EXCEPTION_EXIT_CODE

from . import ranks


def init(
    abort_on_exception: bool = True, stall_warn: float | None = None, stall_abort: float | None = None
) -> MPI.Intracomm:
    """Initialise MPI for mpidl (idempotent; collective: every rank calls it) and return
    ``MPI.COMM_WORLD``, as Horovod's ``hvd.init()``; afterwards :func:`mpidl.rank`,
    :func:`~mpidl.size`, :func:`~mpidl.local_rank` and :func:`~mpidl.local_size` say
    where this rank is (:mod:`mpidl.ranks`).

    Args:
        abort_on_exception: install a ``sys.excepthook`` that prints the
            exception with the rank and calls ``MPI_Abort``
            (:func:`collectives.transport.threads.fail`), so that one rank
            failing ends the whole job at once instead of leaving the others
            blocked in their next collective. (mpidl's own service threads
            end the job this way in any case.)
        stall_warn, stall_abort: limits of the stall inspector in seconds
            (:mod:`collectives.transport.watchdog`); ``MPIDL_STALL_WARN`` and
            ``MPIDL_STALL_ABORT`` in the environment take precedence.

    mpidl needs ``MPI_THREAD_MULTIPLE`` (asynchronous algorithms communicate
    from a service thread), which is mpi4py's default; if the program
    initialised MPI with a lower level itself, a warning says so (and the
    parts that need service threads refuse to start:
    :func:`collectives.transport.threads.require_multiple`).

    Raises:
        ArgumentError: ``MPIDL_RANKS_PER_NODE`` is malformed (on every rank).
    """
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if not threads.multiple():
        print(
            f"mpidl: MPI provides thread level {thread_level()}; "
            "the parts of mpidl that communicate from service threads need 'multiple' and refuse to start "
            "(set mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)",
            file=sys.stderr,
        )
    if abort_on_exception:
        sys.excepthook = threads.fail
    watchdog.configure(stall_warn, stall_abort)
    ranks.locate(MPI.COMM_WORLD)
    return MPI.COMM_WORLD


def thread_level() -> str:
    """The thread level MPI provides, as a word ("single" ... "multiple")."""
    return threads.THREAD_LEVELS[MPI.Query_thread()].removeprefix("MPI_THREAD_").lower()


__all__ = ["EXCEPTION_EXIT_CODE", "init", "thread_level"]
