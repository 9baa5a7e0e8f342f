"""Diagnostics on stderr: every line names its rank, the level comes from ``MPIDL_LOG_LEVEL``.

mpidl's diagnostics (stall reports, what ``auto`` chose, the thread level MPI
provides) are records of the standard :mod:`logging` module, on the loggers
of the three packages (:data:`LOGGERS`: ``collectives.watchdog``,
``collectives.auto``, ``mpidl``, ...). Importing mpidl configures nothing;
:func:`install`, which ``mpidl.init()`` and the ``mpidl`` command call, gives
those loggers a handler that writes each record to stderr in one write (so
that the launcher does not mix it with other ranks' lines) as::

    mpidl: rank 3: MainThread has waited 60 s in allreduce(collective='ring') for rank(s) 2 of MPI_COMM_WORLD

at the level ``MPIDL_LOG_LEVEL`` names (``DEBUG``, ``INFO``, ``WARNING``, the
default, ``ERROR``, ``CRITICAL``, or a number). Warnings that a program may
want to filter by category (a device path slower than asked for) stay
:mod:`warnings`; what ends the job (an uncaught exception, a stall past its
limit) is written directly, whatever the level.
"""

from __future__ import annotations

import logging
import os
import sys

from mpi4py import MPI

#: The loggers :func:`install` configures: the packages' own (their modules log on children of these).
LOGGERS = ("collectives", "algorithms", "mpidl")
#: The environment variable that sets their level.
LEVEL_ENV = "MPIDL_LOG_LEVEL"
DEFAULT_LEVEL = logging.WARNING


def line(message: str) -> str:
    """``message`` as mpidl writes it on stderr: after ``mpidl: rank R: `` (R: the rank in
    ``MPI.COMM_WORLD``), a continuation line indented under it."""
    return f"mpidl: rank {MPI.COMM_WORLD.Get_rank()}: " + message.replace("\n", "\n    ")


def write(message: str) -> None:
    """:func:`line` of ``message`` on stderr, in one write, flushed (whatever the level)."""
    sys.stderr.write(line(message) + "\n")
    sys.stderr.flush()


class RankFormatter(logging.Formatter):
    """Formats a record as :func:`line` of its message (with its traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        return line(super().format(record))


class StderrHandler(logging.Handler):
    """Writes each record to the ``sys.stderr`` of the moment (as :func:`write` does)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except Exception:  # logging's convention: a failing handler reports, never raises
            self.handleError(record)


def level_from_env() -> tuple[int, str | None]:
    """The level ``MPIDL_LOG_LEVEL`` names (default WARNING), and what was wrong with it (None if nothing)."""
    text = os.environ.get(LEVEL_ENV, "").strip()
    if not text:
        return DEFAULT_LEVEL, None
    if text.lstrip("-").isdigit():
        return int(text), None
    level = logging.getLevelName(text.upper())
    if isinstance(level, int):
        return level, None
    return DEFAULT_LEVEL, (
        f"{LEVEL_ENV}={text!r} is not a level (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number); using WARNING"
    )


def install() -> None:
    """Give each logger of :data:`LOGGERS` that has no handler of its own the rank-prefixed
    stderr handler, at the level of ``MPIDL_LOG_LEVEL`` (idempotent; local).

    A logger given the handler no longer passes its records on to the root logger's
    handlers, which would print them a second time; one that the program gave a
    handler before is left as it is. A bad ``MPIDL_LOG_LEVEL`` is reported once, by rank 0.
    """
    level, problem = level_from_env()
    for name in LOGGERS:
        logger = logging.getLogger(name)
        ours = [h for h in logger.handlers if isinstance(h, StderrHandler)]
        if logger.handlers and not ours:
            continue
        if not ours:
            handler = StderrHandler()
            handler.setFormatter(RankFormatter())
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(level)
    if problem and MPI.COMM_WORLD.Get_rank() == 0:
        logging.getLogger("mpidl").warning("%s", problem)
