"""The stall inspector: a blocked operation is reported, and past a limit the job ends.

Every blocking transfer of the collectives (:mod:`collectives.transport.p2p`) records,
in a per-thread slot, which operation it belongs to, on which communicator,
and which peers it waits for. A daemon thread looks at the slots once a
second (or more often for short limits):

* a transfer blocked for longer than ``warn`` seconds is reported once, as a
  warning on the ``collectives.watchdog`` logger (:mod:`~collectives.transport.logs`;
  straight to stderr in the same form where logging is not configured), naming the
  operation, this rank and the peers (as ranks of ``MPI.COMM_WORLD``);
  reporters add stalls they see themselves (the P-Reduce group generator:
  queued groups, with the lock vector and the groups holding the locks, and
  the workers that a ``settle()`` or ``close()`` waits for);
* one blocked for longer than ``abort`` seconds ends the whole job:
  the message goes to stderr and ``MPI_Abort`` is called on
  ``MPI.COMM_WORLD`` with exit code 3 (:data:`ABORT_EXIT_CODE`), so the launcher (mpiexec, srun) stops
  every rank instead of letting the job hang until its allocation runs out.

Limits come from ``MPIDL_STALL_WARN`` (default 60 s) and
``MPIDL_STALL_ABORT`` (default 0, off, for library use; the ``mpidl``
commands default to 600 s) or :func:`configure`; 0 switches either off.
The bookkeeping costs a few attribute writes per message
(:func:`collectives.transport.p2p.watch`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Callable

from mpi4py import MPI

from . import logs

log = logging.getLogger("collectives.watchdog")

#: Exit code of a job that the stall limit ended (distinct from a failed rank's and a usage error's).
ABORT_EXIT_CODE = 3
#: Seconds between printing why the job aborts and calling MPI_Abort: mpiexec
#: (hydra) drops what a rank wrote last when the abort stops it first.
ABORT_GRACE = 1.0


class Slot:
    """What one thread is blocked on (``since`` is 0.0 when it is not)."""

    __slots__ = ("comm", "operation", "peers", "since", "thread")

    def __init__(self) -> None:
        self.operation = "a collective operation"
        self.comm: MPI.Comm | None = None
        self.peers: Sequence[int] = ()
        self.since = 0.0
        self.thread = threading.current_thread().name


def _limit(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


_warn = _limit("MPIDL_STALL_WARN", 60.0)
_abort = _limit("MPIDL_STALL_ABORT", 0.0)
_slots: list[Slot] = []
#: Callables returning (key, age in seconds, message) for stalls they see
#: themselves (e.g. the P-Reduce group generator's queued requests).
Reporter = Callable[[], Sequence[tuple[Hashable, float, str]]]
_reporters: list[Reporter] = []
_reported: set = set()
_local = threading.local()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def configure(warn: float | None = None, abort: float | None = None, *, keep_env: bool = True) -> None:
    """Set the limits in seconds (0 = off). With ``keep_env``, a limit set in the
    environment wins over the one given here (the commands pass their defaults
    this way)."""
    global _warn, _abort
    if warn is not None and not (keep_env and "MPIDL_STALL_WARN" in os.environ):
        _warn = max(0.0, warn)
    if abort is not None and not (keep_env and "MPIDL_STALL_ABORT" in os.environ):
        _abort = max(0.0, abort)


def limits() -> tuple[float, float]:
    """The current (warn, abort) limits in seconds."""
    return _warn, _abort


def slot() -> Slot:
    """This thread's slot (created and watched on first use)."""
    s = getattr(_local, "slot", None)
    if s is None:
        s = _local.slot = Slot()
        with _lock:
            _slots.append(s)
        _ensure_thread()
    return s


def add_reporter(fn: Reporter) -> None:
    """Also watch the stalls ``fn`` reports (called from the watchdog thread)."""
    with _lock:
        _reporters.append(fn)
    _ensure_thread()


def remove_reporter(fn: Reporter) -> None:
    """Stop calling ``fn``."""
    with _lock:
        if fn in _reporters:
            _reporters.remove(fn)


def _ensure_thread() -> None:
    global _thread
    with _lock:
        if _thread is None and (_warn or _abort):
            _thread = threading.Thread(target=_watch, name="mpidl-watchdog", daemon=True)
            _thread.start()


def _world_ranks(comm: MPI.Comm | None, peers: Sequence[int]) -> list[int]:
    if comm is None or comm == MPI.COMM_NULL:
        return list(peers)
    try:
        return list(MPI.Group.Translate_ranks(comm.Get_group(), list(peers), MPI.COMM_WORLD.Get_group()))
    except Exception:  # a report must not fail: fall back to the communicator's own ranks
        return list(peers)


def describe(s: Slot, age: float) -> str:
    """The report for a slot blocked for ``age`` seconds (:func:`logs.line` adds this rank)."""
    peers = ", ".join(map(str, sorted(set(_world_ranks(s.comm, s.peers))))) or "?"
    return f"{s.thread} has waited {age:.0f} s in {s.operation} for rank(s) {peers} of MPI_COMM_WORLD"


def _stalls() -> list[tuple[Hashable, float, str]]:
    """Every stall now visible: blocked slots and what the reporters see."""
    now = time.perf_counter()
    with _lock:
        slots, reporters = list(_slots), list(_reporters)
    out: list[tuple[Hashable, float, str]] = []
    for s in slots:
        # The slot's thread ends its wait (since = 0.0) or starts the next one at any
        # moment: read ``since`` once, and keep the report only if the wait it
        # describes is still the same one after its operation and peers were read.
        since = s.since
        if since:
            age = now - since
            message = describe(s, age)
            if s.since == since:
                out.append(((id(s), since), age, message))
    for fn in reporters:
        try:
            out.extend(fn())
        except Exception as exc:  # a diagnostic must never take the job down by itself
            log.debug("stall reporter %r failed: %s", fn, exc)
    return out


def abort_job(code: int) -> None:
    """``MPI_Abort`` on ``MPI.COMM_WORLD`` with ``code``, :data:`ABORT_GRACE` seconds
    after the caller's last message (flushed), so that the launcher passes it on."""
    sys.stderr.flush()
    time.sleep(ABORT_GRACE)
    MPI.COMM_WORLD.Abort(code)


def _watch() -> None:
    while True:
        warn, abort = _warn, _abort
        shortest = min((x for x in (warn, abort) if x), default=4.0)
        time.sleep(max(0.05, min(1.0, shortest / 4)))
        try:
            _check(warn, abort)
        except Exception as exc:  # the watchdog must outlive any bug in a report
            log.debug("stall check failed: %s", exc)


def _check(warn: float, abort: float) -> None:
    for key, age, message in _stalls():
        if abort and age > abort:
            logs.write(f"{message}; aborting the job (stall limit MPIDL_STALL_ABORT={abort:g} s)")
            abort_job(ABORT_EXIT_CODE)
        if warn and age > warn and key not in _reported:
            _reported.add(key)
            message += f"; the job aborts after {abort:g} s" if abort else ""
            if log.hasHandlers():
                log.warning("%s", message)
            else:  # no logging configured (library use without mpidl.init()): to stderr all the same
                logs.write(message)
