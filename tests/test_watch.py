"""auto's watch: probes of the rivals, changes of places, drifts and what probing costs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok

import collectives
from collectives import api
from collectives.transport.context import context
from collectives.tuning import selector, sweep, watch
from collectives.tuning.watch import WINDOW, Watch

KIB = 1 << 10


def feed(w: Watch, times: dict[str, float], calls: int) -> list[str]:
    """Record ``calls`` calls of ``w``, each taking ``times`` of the algorithm it runs;
    the algorithm of every call, in order."""
    ran = []
    for _ in range(calls):
        ran.append(w.running)
        w.record(times[w.running])
    return ran


# --- the watch alone (COMM_SELF: its agreement is with itself) -------------------


def test_a_faster_rival_takes_the_choices_place() -> None:
    """After a window of the choice, a rival whose known time would beat it is probed at
    once; beating the choice by more than MARGIN, it becomes the choice (a new version,
    so bound calls bind anew), and the choice a rival."""
    w = Watch("shm", 1.0, MPI.COMM_SELF, rivals={"ring": 0.8, "torus2d": 1.2})
    ran = feed(w, {"shm": 1.0, "ring": 0.5, "torus2d": 1.2}, 2 * WINDOW)
    assert ran == ["shm"] * WINDOW + ["ring"] * WINDOW
    assert (w.chosen, w.running, w.rivals, w.expected) == ("ring", "ring", {"torus2d": 1.2, "shm": 1.0}, 0.5)
    assert w.version == 1 and not w.drifted
    assert "ring took the place of shm" in w.story


def test_slower_rivals_are_probed_in_turn_within_their_share() -> None:
    """A rival found slower than its measurement said is noted, and the rivals take
    turns, each probed when the calls since the last probe paid for its extra cost with
    PROBE_SHARE of their time: over a long run the probes cost no more, but for the
    first probe of each rival at its measured time."""
    w = Watch("shm", 1.0, MPI.COMM_SELF, rivals={"ring": 0.8, "torus2d": 1.5})
    times = {"shm": 1.0, "ring": 4.0, "torus2d": 2.0}
    ran = feed(w, times, 40000)
    assert ran[WINDOW : 2 * WINDOW] == ["ring"] * WINDOW  # the first probe, at once
    assert (w.chosen, w.rivals) == ("shm", {"ring": 4.0, "torus2d": 2.0})
    probes = {name: ran.count(name) // WINDOW for name in ("ring", "torus2d")}
    extra = sum(WINDOW * n * (times[name] - times["shm"]) for name, n in probes.items())
    first = WINDOW * (times["ring"] - 0.8 + times["torus2d"] - 1.5)  # each rival's first probe, at its measured time
    assert min(probes.values()) >= 2 and abs(probes["ring"] - probes["torus2d"]) <= 1
    assert extra <= watch.PROBE_SHARE * len(ran) * times["shm"] + first
    assert w.version == 2 * sum(probes.values()) and not w.drifted


def test_a_close_rival_is_not_probed_at_every_window() -> None:
    """A rival within MARGIN of the choice (here 5 % slower) is probed when the calls have
    paid for what a rival within the margin could cost: windows stay apart and the probes
    within PROBE_SHARE of the time."""
    w = Watch("shm", 1.0, MPI.COMM_SELF, rivals={"ring": 1.05})
    ran = feed(w, {"shm": 1.0, "ring": 1.05}, 20000)
    probes = ran.count("ring") // WINDOW
    assert 0 < probes * WINDOW * (watch.MARGIN - 1) <= watch.PROBE_SHARE * len(ran)
    assert w.chosen == "shm" and w.rivals == {"ring": 1.05}


def test_a_drift_probes_the_rival_before_it_measures_anew() -> None:
    """A choice over DRIFT times its expected time hands over to a rival that beats it
    (no drift), and drifts where the rival does not."""
    w = Watch("shm", 1.0, MPI.COMM_SELF, rivals={"ring": 1e9})  # never probed unless drifted
    drifts: list[float] = []
    w.on_drift = drifts.append
    assert feed(w, {"shm": 5.0, "ring": 2.0}, 2 * WINDOW) == ["shm"] * WINDOW + ["ring"] * WINDOW
    assert w.chosen == "ring" and not w.drifted and drifts == []
    w = Watch("shm", 1.0, MPI.COMM_SELF, rivals={"ring": 1e9})
    w.on_drift = drifts.append
    feed(w, {"shm": 5.0, "ring": 5.0}, 2 * WINDOW)
    assert w.chosen == "shm" and w.drifted and drifts == [5.0]
    w = Watch("shm", 1.0, MPI.COMM_SELF)  # no rivals: a drift is a drift
    w.on_drift = drifts.append
    assert feed(w, {"shm": 5.0}, WINDOW) == ["shm"] * WINDOW and w.drifted and drifts == [5.0, 5.0]


def test_a_rehearsal_drifts_only_if_a_second_batch_does() -> None:
    """With deterministic tuning the one window is rehearsed as a batch: one slow batch
    (a busy moment) is timed again and passes if the second is fast; a choice slow in
    both has drifted."""
    x = np.zeros(4, np.float32)
    for slow_batches, drifted in ((1, False), (2, True)):
        calls = [0]

        def run(y: Any, red: Any, slow_batches: int = slow_batches, calls: list[int] = calls) -> None:
            calls[0] += 1
            if 1 < calls[0] <= 1 + slow_batches * WINDOW:  # after the untimed first call
                time.sleep(1e-3)

        w = Watch("ring", 1e-4, MPI.COMM_SELF)
        w.rehearse(run, x, None)
        assert (w.drifted, calls[0]) == (drifted, 1 + 2 * WINDOW)


def test_a_rehearsed_drift_is_confirmed_by_the_fastest_rival() -> None:
    """A rehearsed choice slow in both batches has drifted only where a batch of the
    fastest rival beats it by MARGIN; a rival as slow leaves the choice kept (the
    machine is slower for all, and a new measurement would only add its noise)."""
    x = np.zeros(4, np.float32)
    for rival_sleep, drifted in ((1e-3, False), (0.0, True)):
        w = Watch("ring", 1e-4, MPI.COMM_SELF)
        drifts: list[float] = []
        w.on_drift = drifts.append
        w.rehearse(lambda y, red: time.sleep(1e-3), x, None, ("shm", lambda y, red, s=rival_sleep: time.sleep(s)))
        assert (w.drifted, bool(drifts)) == (drifted, drifted)
        assert ("ring kept" in w.story and "shm no faster" in w.story) == (not drifted)


# --- on a communicator ---------------------------------------------------------


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[MPI.Intracomm]:
    """A new communicator whose auto uses a cache directory of its own, with online
    tuning off, the watch on and every rank counted as having a core of its own."""
    world = MPI.COMM_WORLD
    path = world.bcast(str(tmp_path_factory.mktemp("cache")) if world.rank == 0 else None)
    monkeypatch.setenv("MPIDL_CACHE_DIR", path)
    monkeypatch.setattr(selector, "cores_per_rank", lambda ctx: 1.0)
    previous = collectives.set_tuning(online=False, deterministic=False, cache=True, watch=True)
    comm = world.Dup()
    try:
        yield comm
    finally:
        comm.Free()
        collectives.set_tuning(**dataclasses.asdict(previous))


@pytest.mark.timeout(60)
def test_auto_follows_the_faster_of_choice_and_rival_on_real_calls(
    fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calibration says ring, then halving-doubling; ring's calls take 2 ms more:
    after a window auto probes halving-doubling and runs it, without measuring anew;
    then halving-doubling slows and ring does not: ring comes back. Every call exact,
    every rank alike."""
    if fresh.size == 1:
        pytest.skip("one rank measures nothing")
    monkeypatch.setattr(selector, "SHORTEST", 0.0)
    fake = {"ring": 1e-4, "halving_doubling": 1.3e-4}
    points: list[int] = []
    monkeypatch.setattr(
        sweep, "point", lambda ctx, runs, nbytes, xp=np: points.append(nbytes) or {n: fake.get(n, 1.0) for n in runs}
    )
    x = np.zeros(6 * KIB, np.float32)
    p = fresh.size
    slow: set[str] = set()
    assert collectives.explain(x.nbytes, fresh).algorithm == "ring"  # builds auto's plan
    runs = context(fresh).cache[api._plan_key("auto", None, None)].selector.runs

    def delayed(name: str, run: Any) -> Any:
        def call(y: Any, red: Any) -> None:
            run(y, red)
            if name in slow:
                time.sleep(2e-3)

        return call

    for name in fake:
        runs[name] = delayed(name, runs[name])

    def calls(n: int) -> None:
        for _ in range(n):
            x[:] = fresh.rank + 1
            collectives.allreduce(x, fresh)
            assert all_ok(fresh, bool(np.all(x == p * (p + 1) / 2)))

    slow.add("ring")
    calls(1 + 2 * WINDOW)  # the first call chooses (untimed), a window of ring, drifted: the probe
    choice = collectives.explain(x.nbytes, fresh)
    assert all_ok(fresh, (choice.algorithm, choice.source) == ("halving_doubling", "watch")), choice.reason
    assert all_ok(fresh, "halving_doubling took the place of ring" in choice.reason)
    slow.symmetric_difference_update(fake)
    calls(4 * WINDOW)  # a pause, a window of halving_doubling, drifted: the probe of ring
    choice = collectives.explain(x.nbytes, fresh)
    assert all_ok(fresh, (choice.algorithm, choice.source) == ("ring", "calibration")), choice.reason
    assert all_ok(fresh, len(points) == len(set(points)))  # nothing measured anew
