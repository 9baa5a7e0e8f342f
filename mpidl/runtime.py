"""MPI start-up for mpidl programs: thread level, fail-fast, stall limits."""

from __future__ import annotations

import sys
import traceback
from types import TracebackType

from mpi4py import MPI

from collectives.transport import watchdog

#: Exit code of a job brought down by an uncaught exception on some rank.
EXCEPTION_EXIT_CODE = 2

_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def init(
    abort_on_exception: bool = True, stall_warn: float | None = None, stall_abort: float | None = None
) -> MPI.Intracomm:
    """Initialise MPI for mpidl (idempotent) and return ``MPI.COMM_WORLD``.

    Args:
        abort_on_exception: install a ``sys.excepthook`` that prints the
            exception with the rank and calls ``MPI_Abort``, so that one rank
            failing ends the whole job at once instead of leaving the others
            blocked in their next collective.
        stall_warn, stall_abort: limits of the stall inspector in seconds
            (:mod:`collectives.transport.watchdog`); ``MPIDL_STALL_WARN`` and
            ``MPIDL_STALL_ABORT`` in the environment take precedence.

    mpidl needs ``MPI_THREAD_MULTIPLE`` (asynchronous algorithms communicate
    from a service thread), which is mpi4py's default; if the program
    initialised MPI with a lower level itself, a warning says so.
    """
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        print(
            f"mpidl: MPI provides thread level {_THREAD_LEVELS.get(provided, provided)}; "
            "asynchronous algorithms need 'multiple' (set mpi4py.rc.thread_level = 'multiple' "
            "before importing mpi4py.MPI)",
            file=sys.stderr,
        )
    if abort_on_exception:
        sys.excepthook = _abort_job
    watchdog.configure(stall_warn, stall_abort)
    return MPI.COMM_WORLD


def thread_level() -> str:
    """The thread level MPI provides, as a word."""
    return _THREAD_LEVELS[MPI.Query_thread()]


def _abort_job(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Print the exception with this rank's number and abort every rank."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(f"mpidl: rank {rank} failed; aborting the job:\n{text}")
    watchdog.abort_job(130 if issubclass(kind, KeyboardInterrupt) else EXCEPTION_EXIT_CODE)
