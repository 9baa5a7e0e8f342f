"""MPI start-up for mpidl programs: thread level, fail-fast, stall limits, logging, exit codes,
this rank's place.

Exit codes of the ``mpidl`` commands and of jobs that call :func:`init`
(``docs/failures.rst`` says what a batch script should do with each):

* :data:`USAGE_EXIT_CODE` (2): the command or its set-up is wrong (a bad
  option, a missing data file, a checkpoint of another run), on every rank
  alike; running it again unchanged fails again.
* :data:`STALL_EXIT_CODE` (3): a wait blocked past ``MPIDL_STALL_ABORT``
  (:mod:`collectives.transport.watchdog`).
* :data:`FAILED_EXIT_CODE` (4): an uncaught exception on some rank, or in a
  service thread (:func:`collectives.transport.threads.fail`).
* :data:`INTERRUPT_EXIT_CODE` (130): Ctrl-C on some rank.
"""

from __future__ import annotations

import logging
import sys

from mpi4py import MPI

from collectives.transport import logs, threads, watchdog
from collectives.transport.threads import EXCEPTION_EXIT_CODE, INTERRUPT_EXIT_CODE

from . import ranks

log = logging.getLogger("mpidl")

#: A usage error: a bad option or set-up, reported on every rank alike (argparse's code too).
USAGE_EXIT_CODE = 2
#: A stall: a wait blocked past the stall limit.
STALL_EXIT_CODE = watchdog.ABORT_EXIT_CODE
#: A failed rank: an uncaught exception on some rank or in a service thread.
FAILED_EXIT_CODE = EXCEPTION_EXIT_CODE


def init(
    abort_on_exception: bool = True,
    stall_warn: float | None = None,
    stall_abort: float | None = None,
    log_handler: bool = True,
) -> MPI.Intracomm:
    """Initialise MPI for mpidl (idempotent; collective: every rank calls it) and return
    ``MPI.COMM_WORLD``, as Horovod's ``hvd.init()``; afterwards :func:`mpidl.rank`,
    :func:`~mpidl.size`, :func:`~mpidl.local_rank` and :func:`~mpidl.local_size` say
    where this rank is (:mod:`mpidl.ranks`).

    Args:
        abort_on_exception: install a ``sys.excepthook`` that prints the
            exception with the rank and calls ``MPI_Abort``
            (:func:`collectives.transport.threads.fail`, exit code
            :data:`FAILED_EXIT_CODE`), so that one rank failing ends the whole
            job at once instead of leaving the others blocked in their next
            collective. (mpidl's own service threads end the job this way in
            any case.)
        stall_warn, stall_abort: limits of the stall inspector in seconds
            (:mod:`collectives.transport.watchdog`); ``MPIDL_STALL_WARN`` and
            ``MPIDL_STALL_ABORT`` in the environment take precedence.
        log_handler: give mpidl's loggers a handler that writes their records
            to stderr after ``mpidl: rank R:``, at the level ``MPIDL_LOG_LEVEL``
            names (default WARNING; :mod:`collectives.transport.logs`); False
            leaves logging to the program.

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
    if log_handler:
        logs.install()
    if not threads.multiple():
        log.warning(
            "MPI provides thread level %s; the parts of mpidl that communicate from service threads need "
            "'multiple' and refuse to start (set mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)",
            thread_level(),
        )
    if abort_on_exception:
        sys.excepthook = threads.fail
    watchdog.configure(stall_warn, stall_abort)
    ranks.locate(MPI.COMM_WORLD)
    return MPI.COMM_WORLD


def thread_level() -> str:
    """The thread level MPI provides, as a word ("single" ... "multiple")."""
    return threads.THREAD_LEVELS[MPI.Query_thread()].removeprefix("MPI_THREAD_").lower()


__all__ = [
    "EXCEPTION_EXIT_CODE",
    "FAILED_EXIT_CODE",
    "INTERRUPT_EXIT_CODE",
    "STALL_EXIT_CODE",
    "USAGE_EXIT_CODE",
    "init",
    "thread_level",
]
