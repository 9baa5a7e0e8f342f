"""``auto``'s choice on one communicator: candidates, measurements, online tuning, the watch.

A :class:`Selector` belongs to ``auto``'s plan on a communicator (with its
layout and grid). Its candidates are every algorithm's plan: the
message-passing ones, "shm" for host memory where ranks share a node's
memory, and "mpi" (the MPI library's own all-reduce) for the dtypes MPI can
reduce, on device memory only where the library is GPU-aware.

For each kind of memory it keeps a :class:`~collectives.tuning.table.Table`:
loaded from the persisted cache (:mod:`collectives.tuning.cache`) when it is
first needed, else empty. A size needs the grid sizes around it
(:func:`~collectives.tuning.table.needed`); those not yet in the table are
measured there and then (:mod:`collectives.tuning.sweep`: every candidate,
interleaved, medians, the slowest rank's time), so the calibration spends
time only on the sizes the program uses. Where the measurements leave
candidates close, the first calls of the size band tune among them
(:mod:`collectives.tuning.online`), on single calls where every rank has a
core of its own: on an oversubscribed machine a single call's time is as
much the scheduler's as the collective's, and there only the deterministic
tuning runs, whose rehearsed calls are timed as back-to-back batches
(otherwise the calibration's choice stands). Then the choice is watched
(:mod:`collectives.tuning.watch`): where its calls take well over what was
measured (the machine changed since, or since another process saved the
measurement), the measurements it came from are dropped and the next call
of that size measures anew. What was measured or tuned is saved when the
communicator is freed or the program ends.

With ``MPIDL_COSTMODEL`` set on rank 0, the alpha-beta model decides instead
(:func:`collectives.tuning.costmodel.choose`, parameters from that file):
no grid, no online tuning, and no "mpi", which the model cannot predict.

Every step that communicates (loading the cache, measuring a grid size,
starting or ending a tuning, a watch's agreement) happens at the same call
on every rank, after the argument check passed, and every rank holds the
same table, so every rank makes the same choices.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np

from ..kernels import shm
from ..kernels.plans import PLANNERS, Request, Run
from ..topology.layout import Layout, cores_per_rank
from ..transport import gpu
from ..transport.ops import Reduction
from . import cache, online, settings, sweep
from .costmodel import MODELS, Choice, Params, check_rides, choose
from .table import Table, band, needed
from .waits import waiting
from .watch import DURING as WATCHING
from .watch import RETRIES, SHORTEST, Watch

log = logging.getLogger("collectives.auto")


class Selector:
    """The candidates, measurements and tunings of ``auto`` on one communicator
    (module docstring). Built collectively: the candidates' plans are built."""

    def __init__(self, req: Request, lay: Layout, params: Callable[[Any], Params]) -> None:
        self.ctx, self.layout, self.grid, self.params = req.ctx, lay, req.grid, params
        self.shared = shm.capable(req.ctx, lay)
        self.runs: dict[str, Run] = {name: PLANNERS[name](req) for name in PLANNERS if name != "shm" or self.shared}
        with waiting(self.ctx.comm, "whether MPIDL_COSTMODEL is set and each rank has a core", "auto's set-up"):
            flags = self.ctx.comm.allgather((bool(os.environ.get("MPIDL_COSTMODEL")), cores_per_rank(self.ctx)))
        self.model = flags[0][0]
        #: The fewest cores per rank on any machine: below 1, a single call's time is the
        #: scheduler's as much as the collective's, and no single call is timed.
        self.cores_per_rank = min(cores for _, cores in flags)
        self.tables: dict[str, tuple[dict[str, Any] | None, Table]] = {}
        self.changed: set[str] = set()
        self.sessions: dict[tuple[str, str], online.Session] = {}
        #: Per memory and size band, how often a watch found a drift, and the last one's story.
        self.drifts: dict[tuple[str, int], tuple[int, str]] = {}

    def candidates(self, xp: Any = np, dtype_ok: bool = True) -> list[str]:
        """The algorithms ``auto`` chooses from for ``xp`` memory (module docstring);
        ``dtype_ok``: the MPI library can reduce the dtype."""
        names = [name for name in self.runs if name != "shm" or xp is np]
        if not dtype_ok or (xp is not np and gpu.PATH.mode != "direct"):
            names.remove("mpi")
        return [name for name in names if name in MODELS] if self.model else names

    def choose(self, nbytes: int, xp: Any = np, validate: bool = False, dtype_ok: bool = True) -> Choice:
        """What ``auto`` runs for ``nbytes`` of ``xp`` memory now, every candidate's time
        and the reason (collective where a grid size or the check must be measured)."""
        if self.model:
            return choose(nbytes, self.layout, self.params(xp), self.grid, self.candidates(xp, dtype_ok), validate)
        if self.ctx.size == 1:
            name = self.candidates(xp, dtype_ok)[0]
            return Choice(
                name, nbytes, {name: 0.0}, f"auto: {name} for {nbytes} B on 1 rank: nothing moves", "one rank"
            )
        memory, table = self.table(xp)  # first: it probes the device transport, which decides "mpi"
        names = self.candidates(xp, dtype_ok)
        for size in needed(nbytes):
            if size not in table.points:
                self._measure(memory, table, size, xp)
        if validate and table.check is None:
            table.check = sweep.check_time(self.ctx)
            self.changed.add(memory)
        where = f"on {self.ctx.size} ranks ({self.layout})"
        choice = table.decide(nbytes, names, validate, self._rides(nbytes), where)
        drifts = self.drifts.get((memory, band(nbytes)))
        if drifts is not None:
            choice.reason += f" ({drifts[1]})"
        tune = online.close(choice.predictions) if choice.source.endswith("calibration") else []
        mode = settings.current()
        if len(tune) > 1 and mode.online:
            choice.reason += (
                f" (online tuning among {', '.join(tune)} decides on the first calls)"
                if self.timeable or mode.deterministic
                else f" (no online tuning among {', '.join(tune)}: "
                f"{self.cores_per_rank:.2g} cores per rank on a machine)"
            )
        return choice

    @property
    def timeable(self) -> bool:
        """Whether single calls can be timed for the online tuning and the watch: every
        rank has a core of its own (on an oversubscribed machine a call's time depends on
        which ranks the scheduler runs; batches of calls measure it better, as the
        calibration's and the deterministic tuning's rehearsal do)."""
        return self.cores_per_rank >= 1

    def session(self, choice: Choice, xp: Any = np, dtype_ok: bool = True) -> online.Session | None:
        """The online tuning of ``choice``'s size band, started here if the calibration
        left close candidates and rank 0 has online tuning on, timing single calls where
        every rank has a core (:attr:`timeable`) or rehearsed batches with rank 0's
        deterministic tuning (collective then); None where there is nothing to tune."""
        if not choice.source.endswith("calibration"):
            return None
        names = online.close(choice.predictions)
        if len(names) < 2:
            return None
        memory, table = self.table(xp)
        key = table.band(choice.nbytes, self.candidates(xp, dtype_ok))
        session = self.sessions.get((memory, key))
        if session is None:
            with waiting(self.ctx.comm, "Bcast of the tuning settings", "auto's online tuning"):
                mode = self.ctx.comm.bcast(settings.current(), root=0)
            if not mode.online or not (self.timeable or mode.deterministic):
                return None
            calls = online.rounds(choice.predictions[names[0]])
            session = online.Session(self.runs, names, calls, self.ctx.comm, mode.deterministic)
            session.done = lambda result: self._tuned(memory, key, result)
            self.sessions[memory, key] = session
        return session

    def watch(
        self, choice: Choice, xp: Any, validate: bool, dtype_ok: bool, x: Any, red: Reduction
    ) -> tuple[Choice, Watch | None]:
        """The watch on ``choice`` (:mod:`collectives.tuning.watch`) where it was measured,
        takes at least :data:`~collectives.tuning.watch.SHORTEST` and has not drifted
        :data:`~collectives.tuning.watch.RETRIES` times, with rank 0's ``watch`` switch on
        (collective then). Its windows time the real calls, and probe :meth:`rivals` on them,
        where every rank has a core (:attr:`timeable`); with rank 0's deterministic tuning
        its one window is rehearsed here instead, on a copy of ``x``, as one batch (a drift
        confirmed by a batch of the fastest rival), and a drifted choice measured and made
        anew: (that choice, None)."""
        expected = choice.predictions.get(choice.algorithm, 0.0)
        drifts, _ = self.drifts.get((_memory(xp), band(choice.nbytes)), (0, ""))
        if not choice.source.endswith(("calibration", "tuning")) or expected < SHORTEST or drifts >= RETRIES:
            return choice, None
        with waiting(self.ctx.comm, "Bcast of the tuning settings", WATCHING):
            mode = self.ctx.comm.bcast(settings.current(), root=0)
        if not mode.watch:
            return choice, None
        if not mode.deterministic:  # single calls are timed: only where every rank has a core
            if not self.timeable:
                return choice, None
            return choice, Watch(choice.algorithm, expected, self.ctx.comm, self.rivals(choice, xp, validate, dtype_ok))
        watch = Watch(choice.algorithm, expected, self.ctx.comm)
        watch.on_drift = lambda seconds: self.forget(choice.nbytes, xp, choice.algorithm, expected, seconds)
        rivals = self.rivals(choice, xp, validate, dtype_ok)
        fastest = min(rivals, key=rivals.__getitem__, default=None)
        watch.rehearse(self.runs[choice.algorithm], x, red, None if fastest is None else (fastest, self.runs[fastest]))
        if watch.story:
            log.info("auto on %d ranks, %d B: %s", self.ctx.size, choice.nbytes, watch.story)
        if watch.drifted:
            choice = self.choose(choice.nbytes, xp, validate, dtype_ok)
        return choice, None

    def rivals(self, choice: Choice, xp: Any, validate: bool, dtype_ok: bool) -> dict[str, float]:
        """The candidates a watch on ``choice`` probes, with their seconds a call: every
        candidate but the choice, as calibrated (the times of one scale, batches of
        calls, where the choice was tuned online too)."""
        _, table = self.table(xp)
        names, nbytes = self.candidates(xp, dtype_ok), choice.nbytes
        times = table.estimates(nbytes, names, validate, self._rides(nbytes))
        times.pop(choice.algorithm, None)
        return times

    def forget(self, nbytes: int, xp: Any, name: str, expected: float, seconds: float) -> None:
        """Drop the measurements of ``nbytes``, whose choice ``name`` took ``seconds`` a call
        where ``expected`` were (a watch's drift), so that the next :meth:`choose` of the
        size measures anew (no communication: every rank learns of a drift at the same call)."""
        memory, table = self.table(xp)
        where = (memory, band(nbytes))
        table.drop(nbytes)
        self.changed.add(memory)
        drifts, _ = self.drifts.get(where, (0, ""))
        story = f"measured anew: {name} took {seconds * 1e6:.1f} us a call where {expected * 1e6:.1f} us were expected"
        self.drifts[where] = (drifts + 1, story)
        log.info("auto on %d ranks, %d B: %s", self.ctx.size, nbytes, story)

    def table(self, xp: Any = np) -> tuple[str, Table]:
        """The memory's name and table, loaded from the cache on first use (collective then)."""
        memory = _memory(xp)
        entry = self.tables.get(memory)
        if entry is None:
            if xp is not np:
                gpu.configure(self.ctx.comm)  # the device transport the algorithms will use (collective)
            kind = memory if xp is np else f"device, {gpu.PATH.mode}"
            key = cache.describe(self.ctx.comm, self.layout, self.grid, kind)
            entry = self.tables[memory] = (key, cache.load(self.ctx.comm, key) or Table())
        return memory, entry[1]

    def save(self) -> None:
        """Persist what was measured or tuned (rank 0 writes; no communication)."""
        for memory in sorted(self.changed):
            key, table = self.tables[memory]
            cache.save(key, table)
        self.changed.clear()

    def _rides(self, nbytes: int) -> Callable[[str], bool]:
        """Whether the argument check rides with a candidate's data at ``nbytes``."""
        return lambda name: check_rides(name, nbytes, self.layout)

    def _measure(self, memory: str, table: Table, size: int, xp: Any) -> None:
        names = self.candidates(xp)
        table.points[size] = sweep.point(self.ctx, {name: self.runs[name] for name in names}, size, xp)
        if "mpi" in names and "mpi" not in table.excluded and not sweep.identical(self.ctx, self.runs["mpi"], size, xp):
            table.excluded["mpi"] = f"the MPI library's result differed between ranks at {size} B"
        self.changed.add(memory)

    def _tuned(self, memory: str, key: str, result: dict[str, float]) -> None:
        self.tables[memory][1].tuned[key] = result
        self.sessions.pop((memory, key), None)
        self.changed.add(memory)


def _memory(xp: Any) -> str:
    """The name of ``xp``'s memory in the tables: "host" (numpy) or "device"."""
    return "host" if xp is np else "device"
