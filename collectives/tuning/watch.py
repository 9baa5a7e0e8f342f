"""Watching ``auto``'s choice: its calls timed against what was measured, and against a rival's.

STAR-MPI (Faraj, Yuan & Lowenthal, "STAR-MPI: self tuned adaptive routines
for MPI collective operations", ICS 2006) does not stop at selecting: it
monitors the selected algorithm on the program's calls and selects again
when its performance changes. A machine's speed for one algorithm can change
while another's does not (docs/performance.rst, "A machine that changes"),
so a choice measured earlier in the process, or persisted by another
process, can be wrong now, and later right again.

A :class:`Watch` belongs to one of ``auto``'s decisions (a size, memory and
dtype on one communicator) whose expected time is at least
:data:`SHORTEST` (shorter calls are more the machine's jitter than the
algorithm's). It collects the times of :data:`WINDOW` calls; then the ranks
agree on them with one ``MPI_Allreduce`` (per call the least of the ranks'
times, as online tuning takes it: the rank that came last waited for no
one) and judge their median. Windows follow at gaps that double up to
:data:`LONGEST_GAP` calls (one small all-reduce per some hundreds of calls,
once settled). Every rank judges the same agreed times, so every rank
takes the same steps at the same call.

Phases, on a program's real calls:

1. *Probe.* Every other candidate is a *rival*, with its last known time
   (measured, then from its probes). They take turns: next is one whose
   known time beats the choice's by :data:`MARGIN`, else the one probed
   longest ago. After a window of the choice, the next :data:`WINDOW` calls
   run that rival: at once where its time would beat the choice, else when
   the calls since the last probe have paid for it, its extra cost
   ``WINDOW * (rival - choice)`` (at least ``WINDOW * (MARGIN - 1) *
   choice``, so that a close rival is not probed at every window) within
   :data:`PROBE_SHARE` of their time (the window comes early where a probe
   is paid for before the gap is over). If the rival's median beats the
   choice's by :data:`MARGIN`, the two change places; else the rival's time
   is noted (a slower rival costs more, so the turns come more rarely) and
   the choice runs on.
2. *Drift.* A window whose median is over :data:`DRIFT` times the expected
   time (the choice's measurement, or its first window after a change of
   places) first probes the fastest rival; if that does not beat it, the
   decision has *drifted*: ``auto`` drops the measurements it came from,
   and the next call of that size measures and decides anew. A decision is
   measured anew at most :data:`RETRIES` times per process; changes of
   places are not limited.

So ``auto`` follows a machine whose speed for one algorithm comes and goes
(a probe brings the better one back), and mends a measurement that ranked
the candidates wrongly, at a cost of at most :data:`PROBE_SHARE` of the
time, one probe of each rival that was slower than its measurement said,
and the windows' all-reduces.

With deterministic tuning (:mod:`collectives.tuning.settings`) every real call
of a size must run one algorithm: there are no rivals, the one window is
rehearsed on a zeroed copy of the first call's buffer before that call runs
(:meth:`Watch.rehearse`, one batch, timed as online tuning times its
rehearsed batches; a batch that drifted is rehearsed once more, and the
faster of the two judged), and
no later window follows. A drift there is confirmed by a batch of the
fastest rival: unless the rival beats the choice by :data:`MARGIN`, every
candidate is slower alike and the choice is kept, so that fresh processes
keep running the persisted choice rather than one that a new measurement's
noise ranked first.

Cost: two clock readings per watched call, one ``MPI_Allreduce`` of
:data:`WINDOW` doubles per window; a probe at most :data:`PROBE_SHARE` of
the time; a drift what the first measurement of that size did (every
candidate at the grid sizes around it, :mod:`collectives.tuning.sweep`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..kernels.plans import Run
from ..transport import gpu
from ..transport.ops import Reduction
from .sweep import zeroed
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
#: Most share of the calls' time that probing the rivals may cost.
PROBE_SHARE = 0.03
#: A rival takes the choice's place where its median is below the choice's by this factor.
MARGIN = 1.1
#: What the stall inspector says a rank waits in.
DURING = "auto's watch on its choice"


class Watch:
    """The watch on one of ``auto``'s decisions (module docstring): :meth:`record` each
    call's seconds, running :attr:`running`, or :meth:`rehearse` its one window."""

    __slots__ = (
        "calls",
        "chosen",
        "comm",
        "drifted",
        "expected",
        "gap",
        "last",
        "on_drift",
        "paid",
        "probed",
        "rivals",
        "running",
        "skip",
        "story",
        "suspect",
        "times",
        "version",
    )

    def __init__(self, chosen: str, expected: float, comm: MPI.Comm, rivals: dict[str, float] | None = None) -> None:
        self.chosen, self.expected, self.comm = chosen, expected, comm
        #: The candidates probed against the choice, with their last known seconds a call.
        self.rivals = dict(rivals or {})
        self.calls = 0  # calls recorded
        self.probed = dict.fromkeys(self.rivals, 0)  # per rival, the calls recorded when it was last probed
        self.paid = 0  # the calls recorded when a rival was last probed
        #: The algorithm the next calls run: the choice, or a rival while it is probed.
        self.running = chosen
        #: Counts the changes of :attr:`running` and the drift: a call bound at another
        #: version binds anew.
        self.version = 0
        #: How the choice took a rival's place ("" until one did).
        self.story = ""
        self.times: list[float] = []
        self.last = expected  # the choice's latest window
        self.suspect = False  # the probe running was started by a drift
        self.skip = 0  # calls before the next window
        self.gap = WINDOW  # the next gap
        #: Set, on every rank at the same call, once the choice has drifted.
        self.drifted = False
        #: Called with the drifted window's seconds per call.
        self.on_drift: Callable[[float], None] = lambda seconds: None

    def record(self, seconds: float) -> None:
        """Note one call's time (of :attr:`running`); at a window's last call, agree and
        judge (collective)."""
        self.calls += 1
        if self.skip:
            self.skip -= 1
            return
        self.times.append(seconds)
        if len(self.times) == WINDOW:
            times = np.array(self.times)
            self.times.clear()
            with waiting(self.comm, "Allreduce of the watched calls' times", DURING):
                self.comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MIN)
            median = float(np.median(times))
            if self.running == self.chosen:
                self._judge(median)
            else:
                self._compare(median)

    def rehearse(self, run: Run, x: Any, red: Reduction, rival: tuple[str, Run] | None = None) -> None:
        """Time :data:`WINDOW` calls of ``run`` on a zeroed copy of ``x`` as one batch, after one
        untimed call (its scratch and pages), and judge them; a batch that drifted is
        timed once more and the faster judged (a busy moment of the node slows one batch
        as often as a changed machine does). If that drifted too, ``rival`` (name, run:
        the fastest other candidate) is timed the same way: only where it beats the choice
        by :data:`MARGIN` has the choice drifted; else every candidate is slower alike, the
        ranking stands, and the choice is kept (collective)."""
        copy = zeroed(x)
        run(copy, red)
        seconds = self._batch(run, copy, red)
        if seconds > DRIFT * self.expected:
            seconds = min(seconds, self._batch(run, copy, red))
        if seconds > DRIFT * self.expected and rival is not None:
            name, other = rival
            other(copy, red)
            theirs = self._batch(other, copy, red)
            if theirs * MARGIN >= seconds:
                self.last = seconds
                self.story = (
                    f"{self.chosen} kept: {seconds * 1e6:.1f} us a call where {self.expected * 1e6:.1f} us were "
                    f"expected, and {name} no faster ({theirs * 1e6:.1f} us)"
                )
                return
        self._judge(seconds)

    def _batch(self, run: Run, x: Any, red: Reduction) -> float:
        """Seconds a call of :data:`WINDOW` calls of ``run`` on ``x`` in a row, the least of
        the ranks' (collective)."""
        start = time.perf_counter()
        for _ in range(WINDOW):
            run(x, red)
        if type(x) is not np.ndarray:
            gpu.synchronize()
        took = np.array([(time.perf_counter() - start) / WINDOW])
        with waiting(self.comm, "Allreduce of the rehearsed calls' time", DURING):
            self.comm.Allreduce(MPI.IN_PLACE, took, op=MPI.MIN)
        return float(took[0])

    def _judge(self, seconds: float) -> None:
        """A window of the choice: probe a rival at once, or drift, or wait for the next."""
        self.last = seconds
        drifted = seconds > DRIFT * self.expected
        rival = self._turn()
        if rival is not None and self._owed(rival) > 0:
            rival = min(self.rivals, key=self.rivals.__getitem__) if drifted else None  # after a drift, the fastest
        if rival is not None:
            self.suspect = drifted
            self._run(rival)
        elif drifted:
            self._drift()
        else:
            self._wait()

    def _compare(self, seconds: float) -> None:
        """A window of a rival: it takes the choice's place if it won, else the choice runs on."""
        rival = self.running
        self.probed[rival] = self.paid = self.calls
        if seconds * MARGIN < self.last:
            self.story = (
                f"{rival} took the place of {self.chosen} on real calls: "
                f"{seconds * 1e6:.1f} us a call against {self.last * 1e6:.1f}"
            )
            del self.rivals[rival], self.probed[rival]
            self.rivals[self.chosen], self.probed[self.chosen] = self.last, self.calls
            self.chosen, self.expected, self.last = rival, seconds, seconds
            self.skip, self.gap = WINDOW, 2 * WINDOW  # the new choice is looked at again soon
            return
        self.rivals[rival] = seconds
        self._run(self.chosen)
        if self.suspect:
            self._drift()
        else:
            self._wait()

    def _turn(self) -> str | None:
        """The rival whose turn it is: one that would beat the choice if its time held,
        else the one probed longest ago (the fastest of those)."""
        return min(
            self.rivals,
            key=lambda r: (not self._promising(r), self.probed[r], self.rivals[r]),
            default=None,
        )

    def _promising(self, rival: str) -> bool:
        """Whether ``rival``'s known time beats the choice's latest by :data:`MARGIN`."""
        return self.rivals[rival] * MARGIN < self.last

    def _owed(self, rival: str) -> int:
        """Calls still to come before those since the last probe pay for probing ``rival``:
        its extra time over the choice's, at least what a rival within :data:`MARGIN`
        could cost (so that a close rival is not probed at every window); none for a
        rival that would beat the choice (:meth:`_promising`), probed at once."""
        if self._promising(rival):
            return 0
        cost = WINDOW * max(self.rivals[rival] - self.last, (MARGIN - 1) * self.last)
        return math.ceil(cost / (self.last * PROBE_SHARE)) - (self.calls - self.paid)

    def _wait(self) -> None:
        """Skip calls to the next window: the gap, or fewer where the next probe is paid
        for sooner (its window of the choice comes right before it)."""
        self.skip, self.gap = self.gap, min(2 * self.gap, LONGEST_GAP)
        rival = self._turn()
        if rival is not None:
            self.skip = min(self.skip, max(self._owed(rival) - WINDOW, 0))

    def _run(self, name: str) -> None:
        self.running = name
        self.version += 1

    def _drift(self) -> None:
        self.drifted = True
        self.version += 1
        self.on_drift(self.last)
