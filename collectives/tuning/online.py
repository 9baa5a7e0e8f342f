"""Online tuning: the close candidates timed on the first calls of a size band.

As STAR-MPI does (Faraj, Yuan & Lowenthal, "STAR-MPI: self tuned adaptive
routines for MPI collective operations", ICS 2006): where the calibration
leaves two or more candidates within :data:`CLOSE` of the fastest for a size
(at most :data:`MOST`; calls of at least :data:`SHORTEST`), ``auto`` runs
them on the next calls of that size band in turn, :func:`rounds` calls each,
timing each call on every rank. After the
last, one ``MPI_Allreduce`` of the timings agrees on them: per call the
least of the ranks' times (the rank that arrived last waited for no one, so
its time is the collective's own, whatever the ranks' arrival skew), per
candidate the median of its calls. The fastest is kept for the band, and
persisted with the calibration (:mod:`collectives.tuning.cache`).

The calls do their work: tuning costs only the difference between the
candidates, which the calibration found within :data:`CLOSE` of each other,
plus one small all-reduce. But while it runs, successive calls of a band
combine in different orders, so a float result may differ in its last bits
from a run that tuned elsewhere or not at all. With ``deterministic``
(:mod:`collectives.tuning.settings`) the session runs all its calls at once
on a zeroed copy of the first call's buffer (:meth:`Session.rehearse`) before that
call runs the winner, so every real call of a band in a process runs one
algorithm, and with the persisted result every later process too. Those calls
run back to back, as a benchmark's do (and a training step's buckets), so
they are timed as such: each candidate's calls in a batch, a batch's time
the one on the rank that took the least (the batch begins with the previous
one's end, so only its first call sees the arrival skew); :data:`REHEARSALS`
batches per candidate, the candidates taking turns in an order that rotates,
and per candidate the median batch over its calls (one batch alone let a
slow moment of an oversubscribed machine decide). Interleaved single calls
would hide what one algorithm gains from its own previous call (shm's double
buffer lets a rank begin the next call while the last is still being read;
docs/performance.rst, "auto in fresh processes", has a case on 8 ranks where
that reversed the choice). A rehearsal's calls come on top of the program's:
:data:`REHEARSALS` x candidates x :func:`rounds` calls, once per size band and
process, none where the cache holds the result.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..kernels.plans import Run
from ..transport import gpu
from ..transport.ops import Reduction
from .sweep import rotated, zeroed
from .waits import waiting

#: Candidates whose estimate is within this factor of the fastest's are tuned.
CLOSE = 1.2
#: Most candidates tuned in one band.
MOST = 3
#: Seconds of calls each candidate aims for (within the bounds of :func:`rounds`).
TUNE_TIME = 1e-3
#: Calls shorter than this (seconds) are not tuned: a single call's time there is
#: mostly the jitter of the machine, and the calibration's batches of calls
#: measured it better.
SHORTEST = 100e-6
#: Batches of each candidate's calls when the session is rehearsed (deterministic).
REHEARSALS = 3


def close(predictions: Mapping[str, float]) -> list[str]:
    """The candidates worth tuning among ``predictions`` (seconds, least first): those
    within :data:`CLOSE` of the first, at most :data:`MOST`; none where the first
    takes less than :data:`SHORTEST`."""
    ranked = list(predictions)
    best = predictions[ranked[0]]
    if best < SHORTEST:
        return []
    return [c for c in ranked if predictions[c] <= CLOSE * best][:MOST]


def rounds(seconds: float) -> int:
    """Calls per candidate for a call of about ``seconds``: :data:`TUNE_TIME` worth,
    3 to 7 (a median of single calls needs a few; fast calls are noisier)."""
    return max(3, min(7, math.ceil(TUNE_TIME / max(seconds, 1e-9))))


class Session:
    """The online tuning of one size band (module docstring): call it in place of an
    algorithm on the band's calls until :attr:`result` is set."""

    def __init__(
        self, runs: Mapping[str, Run], names: list[str], calls: int, comm: MPI.Comm, deterministic: bool = False
    ) -> None:
        self.runs, self.comm, self.deterministic, self.calls = runs, comm, deterministic, calls
        if deterministic:  # batches of each candidate's calls, the candidates in a rotating order
            self.order = [name for r in range(REHEARSALS) for name in rotated(names, r) for _ in range(calls)]
        else:  # single calls, in turn
            self.order = names * calls
        self.times: list[float] = []
        #: Each candidate's agreed seconds, once every call has run.
        self.result: dict[str, float] | None = None
        #: Called with :attr:`result` when it is set.
        self.done: Callable[[dict[str, float]], None] = lambda result: None

    def __call__(self, x: Any, red: Reduction) -> None:
        """All-reduce ``x`` with the next candidate, timed; after the last, agree (collective)."""
        run = self.runs[self.order[len(self.times)]]
        t0 = time.perf_counter()
        run(x, red)
        if type(x) is not np.ndarray:
            gpu.synchronize()
        self.times.append(time.perf_counter() - t0)
        if len(self.times) == len(self.order):
            self._agree()

    def rehearse(self, x: Any, red: Reduction) -> None:
        """Run every call of the session on a zeroed copy of ``x`` now (zeros: the many sums
        of one buffer never overflow into warnings, and cost what any finite values do;
        collective)."""
        copy = zeroed(x)
        while self.result is None:
            self(copy, red)

    def _agree(self) -> None:
        """Per call (per batch when rehearsed) the least of the ranks' times; per
        candidate the median of its calls (of its batches' times over their calls)."""
        times, order, calls = np.array(self.times), self.order, 1
        if self.deterministic:  # the order holds each batch's calls in a row
            times, order, calls = times.reshape(-1, self.calls).sum(axis=1), order[:: self.calls], self.calls
        with waiting(self.comm, "Allreduce of the online tuning's timings", "auto's online tuning"):
            self.comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MIN)
        per: dict[str, list[float]] = {}
        for name, t in zip(order, times.tolist()):
            per.setdefault(name, []).append(t / calls)
        self.result = {name: statistics.median(ts) for name, ts in per.items()}
        self.done(self.result)
