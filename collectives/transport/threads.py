"""Service threads: the MPI thread level they need, and how their failure ends the job.

Parts of mpidl communicate from a thread of their own while the caller's
thread communicates too: P-Reduce's group generator, AD-PSGD's server and
averaging thread, LSGD's inter-group all-reduce, the overlapped all-reduces
and averages of AllReduce-SGD and D-PSGD (:class:`collectives.transport.background.Background`),
the step budget of ``mpidl train`` (:mod:`mpidl.pacing`). MPI defines two
threads calling it at once only at ``MPI_THREAD_MULTIPLE`` (mpi4py's default);
below it the result is undefined (a run of Prague under
``MPI_THREAD_SERIALIZED`` hung). :func:`require_multiple` refuses up front,
with the reason, where one of those threads would start.

A service thread's exception would end only that thread and leave every rank
waiting for it: no one collects it. :func:`start` starts a service thread
whose uncaught exception is printed with the rank and the thread's name and
ends the job with ``MPI_Abort`` (:func:`fail`, exit code
:data:`EXCEPTION_EXIT_CODE`), as ``mpidl.init()``'s ``sys.excepthook``
(the same function) does for the main thread.
"""

from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType
from typing import Any, Callable

from mpi4py import MPI

from ..errors import ArgumentError
from . import watchdog
from .p2p import prompt_threads

#: Exit code of a job brought down by an uncaught exception on some rank: a failed rank
#: (distinct from a usage error's 2 and a stall's 3, :data:`~collectives.transport.watchdog.ABORT_EXIT_CODE`).
EXCEPTION_EXIT_CODE = 4
#: Exit code of a job brought down by Ctrl-C (``KeyboardInterrupt``) on some rank.
INTERRUPT_EXIT_CODE = 130

THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}


def multiple() -> bool:
    """Whether MPI provides ``MPI_THREAD_MULTIPLE``: service threads may call it
    while the caller does."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def require_multiple(what: str) -> None:
    """Raise ArgumentError saying that ``what`` needs ``MPI_THREAD_MULTIPLE`` unless MPI provides it.

    Local: call it where the caller's arguments are checked across ranks (or
    before its first collective), so that every rank raises it alike.
    """
    if not multiple():
        provided = MPI.Query_thread()
        raise ArgumentError(
            f"{what}: MPI must provide MPI_THREAD_MULTIPLE (mpi4py's default), but it provides "
            f"{THREAD_LEVELS.get(provided, provided)}, where two threads calling MPI at once is undefined "
            "(leave mpi4py.rc.thread_level at 'multiple', or initialise MPI with that level)"
        )


def fail(kind: type[BaseException], value: BaseException, tb: TracebackType | None, thread: str | None = None) -> None:
    """Print the exception with this rank's number (and ``thread``'s name) and abort
    every rank: exit code :data:`EXCEPTION_EXIT_CODE` (:data:`INTERRUPT_EXIT_CODE`
    for Ctrl-C). A ``sys.excepthook``."""
    where = f"rank {MPI.COMM_WORLD.Get_rank()}" + (f" (thread {thread})" if thread else "")
    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(f"mpidl: {where} failed; aborting the job:\n{text}")
    watchdog.abort_job(INTERRUPT_EXIT_CODE if issubclass(kind, KeyboardInterrupt) else EXCEPTION_EXIT_CODE)


def start(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread ``name`` running ``target(*args)``; an exception
    that leaves ``target`` ends the job (:func:`fail`). Lowers the GIL's switch
    interval first (:func:`~collectives.transport.p2p.prompt_threads`)."""

    def run() -> None:
        try:
            target(*args)
        except BaseException as exc:  # no one would collect it, and the other ranks would wait for this thread
            fail(type(exc), exc, exc.__traceback__, thread=name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    prompt_threads()
    thread.start()
    return thread
