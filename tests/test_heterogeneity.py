"""Heterogeneous workers: the seeded slowdown schedule, the paced step clock, and the
per-worker report that names the slowest worker (the pieces; ``mpidl train`` with them
is in tests/test_train.py)."""

from __future__ import annotations

import argparse

import pytest
from mpitest import all_ok, comm_of_size

from mpidl import stepclock, stragglers
from mpidl.slowdowns import RandomSlowdown, Slowdowns, parse_random

pytestmark = pytest.mark.mpi


def test_slowdown_specs_parse_and_bad_ones_say_what_is_wrong() -> None:
    assert parse_random("p=0.1,F=4,P=10") == RandomSlowdown(0.1, 4.0, 10, None)
    assert parse_random("P=5, F=2.5, p=1, seed=7") == RandomSlowdown(1.0, 2.5, 5, 7)
    for text, problem in [
        ("p=0.1,F=4", "P missing"),
        ("p=0.1,F=4,P=10,q=1", "use p=PROB,F=FACTOR,P=STEPS"),
        ("p=0.1,p=0.2,F=4,P=10", "p given twice"),
        ("p=1.5,F=4,P=10", "probability p must be in [0, 1]"),
        ("p=0.1,F=0.5,P=10", "factor F must be a number >= 1"),
        ("p=0.1,F=4,P=0", "period P must be at least one step"),
        ("p=0.1,F=4,P=2.5", "bad --slowdown"),
    ]:
        with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
            parse_random(text)


def test_the_schedule_is_seeded_per_rank_and_period_and_composes_with_fixed_factors() -> None:
    random = RandomSlowdown(0.1, 4.0, 10)
    steps = 20_000

    def schedule(rank: int, seed: int, fixed: dict[int, float], spec: RandomSlowdown = random) -> list[float]:
        s = Slowdowns(rank, fixed, spec, seed)
        return [s.factor(k) for k in range(steps)]

    a = schedule(0, 5, {})
    assert a == schedule(0, 5, {})  # the same seed: the same schedule (whichever algorithm runs)
    assert a != schedule(1, 5, {}) and a != schedule(0, 6, {})  # another rank, another seed
    assert schedule(0, 6, {}, RandomSlowdown(0.1, 4.0, 10, seed=5)) == a  # its own seed overrides the run's
    periods = [a[k : k + 10] for k in range(0, steps, 10)]
    assert all(len(set(p)) == 1 for p in periods)  # slowed for whole periods
    assert set(a) == {1.0, 4.0} and 0.08 < a.count(4.0) / steps < 0.12  # 2000 periods at p = 0.1
    fixed = schedule(3, 5, {3: 2.0})
    random_part = schedule(3, 5, {})
    assert fixed == [2.0 * f for f in random_part]  # factors multiply
    assert Slowdowns(1, {3: 2.0}, None, 0).factor(7) == 1.0 and not Slowdowns(1, {3: 2.0}, None, 0).active
    assert Slowdowns(3, {3: 2.0}, None, 0).factor(7) == 2.0


def test_durations_need_their_unit() -> None:
    assert stepclock.parse_duration("150ms") == pytest.approx(0.15)
    assert stepclock.parse_duration("0.2s") == pytest.approx(0.2)
    assert stepclock.parse_duration("500us") == pytest.approx(5e-4)
    for bad in ["150", "0ms", "-1s", "fast"]:
        with pytest.raises(argparse.ArgumentTypeError, match="with its unit"):
            stepclock.parse_duration(bad)


@pytest.mark.parametrize("step_time", [None, 0.15])
def test_the_clock_sleeps_out_the_step(step_time: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpaced, a step slowed f-fold sleeps (f - 1) c; paced, f C - c - u (u the previous
    step's update), and a step whose computation and update outlast f C sleeps nothing
    and is an overrun."""
    slept: list[float] = []
    monkeypatch.setattr(stepclock.time, "sleep", slept.append)
    clock = stepclock.StepClock(Slowdowns(0, {0: 3.0}, None, 0), step_time)
    assert clock.active
    assert clock.pause(0, 0.01, 0.005) == (3.0, False)
    assert clock.pause(1, 0.5) == (3.0, step_time is not None)
    assert clock.pause(2, 0.3, 0.2) == (3.0, step_time is not None)
    expected = [0.02, 1.0, 0.6] if step_time is None else [0.435]
    assert slept == pytest.approx(expected)
    idle = stepclock.StepClock(Slowdowns(1, {0: 3.0}, None, 0), None)
    assert not idle.active and idle.pause(0, 0.01) == (1.0, False) and slept == pytest.approx(expected)


def test_the_slowest_worker_is_named_past_one_and_a_half_times_the_median() -> None:
    assert stragglers.slowest([1.0, 1.1, 0.9, 4.0]) == {
        "rank": 3,
        "own_s": 4.0,
        "median_own_s": 1.05,
        "ratio": 4 / 1.05,
    }
    assert stragglers.slowest([1.0, 1.0, 1.5]) is None  # 1.5 x is not more than 1.5 x
    assert stragglers.slowest([1.0, 1.0, 1.6])["rank"] == 2  # type: ignore[index]
    assert stragglers.slowest([0.0, 0.0]) is None and stragglers.slowest([]) is None


def test_the_report_gathers_every_worker_and_prints_a_row_each() -> None:
    """Each rank of a communicator of up to 4 takes 10 steps of 10 ms of its own, the last
    rank 3 (n - 1) + 1 times that; the report holds every rank's means and names the
    last rank (none on one rank: it is the median)."""
    comm = comm_of_size(4)
    n, r = comm.size, comm.rank
    times = stragglers.StepTimes()
    for k in range(10):
        own = 0.01 * (1 + 3 * r * (r == n - 1))
        times.add(
            gradient_s=0.001,
            compute_s=own,
            step_s=own + 0.02,
            comm_wait_s=0.02,
            factor=2.0 if k < 3 else 1.0,
            overrun=k == 0,
        )
    cpu = stragglers.CpuMeter()
    cpu.start()
    cpu.stop()
    report = stragglers.report(times, cpu, comm)
    means = report["mean_s"]
    ok = report["steps"] == [10] * n and report["slowed_steps"] == [3] * n and report["overruns"] == [1] * n
    ok = ok and means["comm_wait"] == pytest.approx([0.02] * n) and means["gradient"] == pytest.approx([0.001] * n)
    ok = ok and means["own"] == pytest.approx([s - 0.02 for s in means["step"]])
    slow = report["slowest"]
    ok = ok and (slow["rank"] if slow else None) == (None if n == 1 else n - 1)
    ok = ok and report["cpu"]["machine_cores"] >= 1 and len(report["cpu"]["cpu_s"]) == n
    text = stragglers.table(report)
    ok = ok and len([line for line in text.splitlines() if line.split()[0].isdigit()]) == n
    ok = ok and ("slowest worker: rank" in text) == (slow is not None) and "overrun" in text
    assert all_ok(comm, ok), (report, text)
