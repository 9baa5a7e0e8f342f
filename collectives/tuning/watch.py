"""Watching ``auto``'s choice: its calls timed against what its measurement promised.

STAR-MPI (Faraj, Yuan & Lowenthal, "STAR-MPI: self tuned adaptive routines
for MPI collective operations", ICS 2006) does not stop at selecting: it
monitors the selected algorithm on the program's calls and selects again
when its performance changes. A machine's speed for one algorithm can change
while another's does not (docs/performance.rst, "A machine that changes"),
so a choice measured earlier in the process, or persisted by another
process, can be wrong now.

A :class:`Watch` belongs to one of ``auto``'s decisions (a size, memory and
dtype on one communicator) whose expected time is at least
:data:`SHORTEST` (shorter calls are more the machine's jitter than the
algorithm's). It collects the times of :data:`WINDOW` calls; then the ranks
agree on them with one ``MPI_Allreduce`` (per call the least of the ranks'
times, as online tuning takes it: the rank that came last waited for no
one). If their median is over :data:`DRIFT` times the expected time, the
decision has *drifted*: ``auto`` drops the measurements it came from, and
the next call of that size measures and decides anew. Every rank learns it
at the same call, so every rank takes the same steps. Windows follow at
gaps that double up to :data:`LONGEST_GAP` calls (one small all-reduce per
some hundreds of calls, once settled); a decision is measured anew at most
:data:`RETRIES` times per process.

With deterministic tuning (:mod:`collectives.tuning.settings`) every real call
of a size must run one algorithm: the one window is rehearsed on a copy of
the first call's buffer before that call runs (:meth:`Watch.rehearse`, one
batch, as online tuning rehearses), and no later window follows.

Cost: two clock readings per watched call, one ``MPI_Allreduce`` of
:data:`WINDOW` doubles per window; a drift costs what the first measurement
of that size did (every candidate at the grid sizes around it,
:mod:`collectives.tuning.sweep`), at most :data:`RETRIES` times.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..kernels.plans import Run
from ..transport import gpu
from ..transport.ops import Reduction
from .waits import waiting

#: Calls timed per window.
WINDOW = 8
#: A window's median over this many times the expected time is a drift.
DRIFT = 1.5
#: Decisions expected to take less (seconds) are not watched.
SHORTEST = 100e-6
#: Most calls between two windows.
LONGEST_GAP = 1024
#: Most times one decision is measured anew in a process.
RETRIES = 2
#: What the stall inspector says a rank waits in.
DURING = "auto's watch on its choice"


class Watch:
    """The watch on one of ``auto``'s decisions (module docstring): :meth:`record` each
    call's seconds, or :meth:`rehearse` its one window."""

    __slots__ = ("comm", "drifted", "expected", "gap", "on_drift", "skip", "times")

    def __init__(self, expected: float, comm: MPI.Comm) -> None:
        self.expected, self.comm = expected, comm
        self.times: list[float] = []
        self.skip = 0  # calls before the next window
        self.gap = WINDOW  # the next gap
        #: Set, on every rank at the same call, once a window has found a drift.
        self.drifted = False
        #: Called with the window's seconds per call when it finds a drift.
        self.on_drift: Callable[[float], None] = lambda seconds: None

    def record(self, seconds: float) -> None:
        """Note one call's time; at a window's last call, agree and judge (collective)."""
        if self.skip:
            self.skip -= 1
            return
        self.times.append(seconds)
        if len(self.times) == WINDOW:
            times = np.array(self.times)
            self.times.clear()
            with waiting(self.comm, "Allreduce of the watched calls' times", DURING):
                self.comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MIN)
            self._judge(float(np.median(times)))

    def rehearse(self, run: Run, x: Any, red: Reduction) -> None:
        """Time :data:`WINDOW` calls of ``run`` on a copy of ``x`` as one batch, after one
        untimed call (its scratch and pages), and judge them (collective)."""
        copy = x.copy()
        run(copy, red)
        start = time.perf_counter()
        for _ in range(WINDOW):
            run(copy, red)
        if type(x) is not np.ndarray:
            gpu.synchronize()
        took = np.array([(time.perf_counter() - start) / WINDOW])
        with waiting(self.comm, "Allreduce of the rehearsed calls' time", DURING):
            self.comm.Allreduce(MPI.IN_PLACE, took, op=MPI.MIN)
        self._judge(float(took[0]))

    def _judge(self, seconds: float) -> None:
        self.skip, self.gap = self.gap, min(2 * self.gap, LONGEST_GAP)
        if seconds > DRIFT * self.expected:
            self.drifted = True
            self.on_drift(seconds)
