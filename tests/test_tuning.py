"""auto's measurements: the table's decisions, the persisted cache, online tuning, "mpi"."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok

import collectives
from collectives.transport import p2p
from collectives.transport.context import context
from collectives.tuning import cache, online, selector, sweep, watch
from collectives.tuning.table import GRID, Table, band, needed
from mpidl import bench

KIB = 1 << 10


def same_everywhere(comm: MPI.Comm, value: object) -> bool:
    return all_ok(comm, len({json.dumps(v, sort_keys=True) for v in comm.allgather(value)}) == 1)


# --- the table (pure) ----------------------------------------------------------


def test_estimates_between_and_beyond_the_grid() -> None:
    table = Table(points={1 * KIB: {"a": 10.0}, 2 * KIB: {"a": 20.0}, GRID[0]: {"a": 3.0}})
    table.points[GRID[-2]], table.points[GRID[-1]] = {"a": 100.0}, {"a": 200.0}
    assert needed(1536) == (1 * KIB, 2 * KIB) and needed(2 * KIB) == (2 * KIB,)
    assert table.estimate("a", 1536) == pytest.approx(15.0)  # a straight line between grid sizes
    assert table.estimate("a", 2 * KIB) == 20.0
    assert table.estimate("a", 8) == 3.0  # below the grid: its smallest size's
    assert table.estimate("a", 2 * GRID[-1]) == pytest.approx(400.0)  # above: the line through the largest two
    assert table.estimate("b", 1536) is None
    assert band(192 * KIB) != band(256 * KIB) != band(128 * KIB) and band(3 << 20) != band(4 << 20)


def test_decisions_tuned_checked_excluded_and_cached() -> None:
    table = Table(points={4 * KIB: {"ring": 10e-6, "shm": 11e-6, "mpi": 1e-6}}, check=2e-6)
    rides = {"ring": False, "shm": True, "mpi": False}.__getitem__
    unchecked = table.decide(4 * KIB, ["ring", "shm", "mpi"], False, rides)
    assert (unchecked.algorithm, unchecked.source) == ("mpi", "calibration")
    table.excluded["mpi"] = "differed between ranks"
    checked = table.decide(4 * KIB, ["ring", "shm", "mpi"], True, rides)
    assert checked.algorithm == "shm" and checked.predictions == {"shm": 11e-6, "ring": 12e-6}
    assert "mpi left out: differed between ranks" in checked.reason
    key = next(iter({f"{band(4 * KIB)}:ring,shm"}))
    table.tuned[key] = {"ring": 5e-6, "shm": 9e-6}
    tuned = table.decide(4 * KIB, ["ring", "shm", "mpi"], False, rides)
    assert (tuned.algorithm, tuned.source) == ("ring", "online tuning")
    loaded = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert loaded.decide(4 * KIB, ["ring", "shm", "mpi"], False, rides).source == "cached online tuning"
    assert loaded.decide(4 * KIB, ["ring", "shm"], False, rides).source == "cached online tuning"
    assert loaded.decide(4 * KIB, ["ring"], False, rides).source == "cached calibration"


def test_what_a_drift_dropped_stays_dropped_when_saved_over_the_file() -> None:
    """A drift drops a size's grid points and its band's tuning. Saving merges the table
    with the file, which still holds them: the merge must not bring them back, or the
    next process would load the stale tuning, drift and measure again, and the choice
    would change from one process to the next."""
    size = 3 << 20
    lo, hi = needed(size)
    key = f"{band(size)}:ring,shm"
    on_disk = Table({lo: {"ring": 1.0}, hi: {"ring": 2.0}, 4 * KIB: {"ring": 3.0}}, {key: {"ring": 1.0, "shm": 2.0}})
    table = Table.from_json(json.loads(json.dumps(on_disk.to_json())))
    table.drop(size)
    assert table.points == {4 * KIB: {"ring": 3.0}} and table.tuned == {}
    assert table.loaded == {4 * KIB}  # what is left still counts as cached
    table.points[hi] = {"ring": 5.0}  # measured anew
    table.merge(on_disk)
    assert table.points == {hi: {"ring": 5.0}, 4 * KIB: {"ring": 3.0}} and table.tuned == {}


@pytest.mark.parametrize(
    "raw",
    [None, [], {"points": {"x": {}}, "tuned": {}, "check": None, "excluded": {}}, {"points": {}, "tuned": {}}],
)
def test_foreign_tables_are_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="not a table"):
        Table.from_json(raw)


# --- on a communicator -----------------------------------------------------------


@pytest.fixture
def fresh(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[MPI.Intracomm]:
    """A new communicator whose auto uses a cache directory of its own (rank 0's
    temporary directory), online tuning, the watch and the cache on."""
    world = MPI.COMM_WORLD
    path = world.bcast(str(tmp_path_factory.mktemp("cache")) if world.rank == 0 else None)
    monkeypatch.setenv("MPIDL_CACHE_DIR", path)
    previous = collectives.set_tuning(online=True, deterministic=False, cache=True, watch=True)
    comm = world.Dup()
    try:
        yield comm
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()
        collectives.set_tuning(**dataclasses.asdict(previous))


def test_slow_single_calls_do_not_prune_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose first two calls are slow (a 4.5 us all-reduce timed at 31 us
    while the machine jittered) is judged by a batch, not pruned on one call."""
    clock = [0.0]
    monkeypatch.setattr(sweep.time, "perf_counter", lambda: clock[0])
    calls = {"jittery": 0, "steady": 0}

    def run(name: str, seconds: Callable[[int], float]) -> Callable[[object, object], None]:
        def call(x: object, red: object) -> None:
            calls[name] += 1
            clock[0] += seconds(calls[name])

        return call

    runs = {"jittery": run("jittery", lambda k: 31e-6 if k <= 2 else 4.5e-6), "steady": run("steady", lambda k: 6e-6)}
    times = sweep.point(context(MPI.COMM_WORLD), runs, 4 * KIB)
    assert times["jittery"] == pytest.approx(4.5e-6) and times["steady"] == pytest.approx(6e-6)
    assert calls["jittery"] > 2 + sweep.ROUNDS  # timed in every round: not pruned


def test_choice_is_agreed_on_every_rank(fresh: MPI.Intracomm) -> None:
    """Every rank chooses alike, from the same measurements (the slowest rank's times)."""
    choices = [collectives.explain(n, fresh) for n in (3 * KIB, 48 * KIB)]
    assert same_everywhere(fresh, [(c.algorithm, c.source, c.predictions) for c in choices])
    assert all(c.source == ("calibration" if fresh.size > 1 else "one rank") for c in choices)


def explained(nbytes: int, **options: object) -> collectives.costmodel.Choice:
    """auto's choice for ``nbytes`` on a new duplicate of the world, freed after (rank 0 saves)."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        return collectives.explain(nbytes, comm, **options)  # type: ignore[arg-type]
    finally:
        comm.Free()


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The grid sizes measured from now on, in order."""
    sizes: list[int] = []
    real = sweep.point
    monkeypatch.setattr(
        sweep, "point", lambda ctx, runs, nbytes, xp=np: sizes.append(nbytes) or real(ctx, runs, nbytes, xp)
    )
    return sizes


@pytest.mark.timeout(60)
def test_cache_of_another_machine_library_or_shape_is_not_used(
    fresh: MPI.Intracomm, measured: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a communicator measured is saved when it is freed and used by the next one
    of the same machine, library and shape; with any of them changed the sizes are
    measured anew."""
    if fresh.size == 1:
        pytest.skip("one rank measures nothing")
    world = MPI.COMM_WORLD
    first = collectives.explain(5 * KIB, fresh)
    fresh.Free()  # rank 0 saves
    measured.clear()
    again = explained(5 * KIB)
    assert all_ok(world, not measured and again.source == "cached calibration")
    assert all_ok(world, again.predictions == first.predictions)
    host, namespace = cache.machine()
    elsewhere = {
        "another host": ("machine", lambda: (host + "-elsewhere", namespace)),
        "another network namespace": ("machine", lambda: (host, (namespace or 0) + 1)),
        "another MPI library": ("library", lambda: "Open MPI v5.0.8"),
    }
    for what, (name, fake) in elsewhere.items():
        with monkeypatch.context() as m:
            m.setattr(cache, name, fake)
            measured.clear()
            choice = explained(5 * KIB)
            assert all_ok(world, choice.source == "calibration" and sorted(measured) == [4 * KIB, 8 * KIB]), what
    measured.clear()
    choice = explained(5 * KIB, layout="1")  # the same ranks as nodes of one: another shape
    assert all_ok(world, choice.source == "calibration" and sorted(measured) == [4 * KIB, 8 * KIB])


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:mpidl. ignoring auto's measurements")
@pytest.mark.parametrize("damage", ["foreign key", "not JSON", "not a table"])
def test_file_not_saved_under_this_key_is_not_used(fresh: MPI.Intracomm, measured: list[int], damage: str) -> None:
    """A file at this job's path whose key is not the job's (edited, or written by
    another version of the key), or that holds no table, is ignored: measured anew."""
    if fresh.size == 1:
        pytest.skip("one rank measures nothing")
    world = MPI.COMM_WORLD
    lay = collectives.topology.layout.layout(fresh)
    key = cache.describe(fresh, lay, None, "host")
    if world.rank == 0:
        assert key is not None
        target = cache.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        forged = Table(points={s: {"ring": 1e-9} for s in GRID})
        text = {
            "foreign key": json.dumps({"key": {**key, "hosts": ["elsewhere"] * world.size}, "table": forged.to_json()}),
            "not JSON": '{"key": ',
            "not a table": json.dumps({"key": key, "table": {"points": []}}),
        }[damage]
        target.write_text(text)
    world.Barrier()
    choice = collectives.explain(5 * KIB, fresh)
    assert all_ok(world, choice.source == "calibration" and sorted(measured) == [4 * KIB, 8 * KIB]), choice.reason


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_session_times_single_calls_in_turn_or_rehearsed_batches(
    deterministic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On real calls the candidates run in turn and each call counts at its fastest rank
    (the median of those per candidate); rehearsed (deterministic) each candidate's calls
    run as one batch, whose time on its fastest rank, over its calls, counts. With a
    fake clock: "a" alternates slow and fast calls, on rank 0 out of step with the others
    (as a pipelined algorithm's calls may), "b" takes 0.8 everywhere."""
    comm = MPI.COMM_WORLD
    clock = [0.0]
    monkeypatch.setattr(online.time, "perf_counter", lambda: clock[0])
    pattern = {"a": [2.0, 0.5, 2.0] if comm.rank == 0 else [0.5, 2.0, 0.5], "b": [0.8] * 3}
    ran: list[str] = []

    def run(name: str):
        def timed(x: np.ndarray, red: object) -> None:
            clock[0] += pattern[name][ran.count(name)]
            ran.append(name)

        return timed

    monkeypatch.setattr(online, "REHEARSALS", 1)
    session = online.Session({n: run(n) for n in "ab"}, ["a", "b"], 3, comm, deterministic)
    if deterministic:
        session.rehearse(np.zeros(4), None)
    else:
        for _ in range(6):
            session(np.zeros(4), None)
    assert ran == (["a"] * 3 + ["b"] * 3 if deterministic else ["a", "b"] * 3)
    # a: single calls, the least of the ranks' per call: 0.5 each (2, 0.5, 2 alone);
    # batches: the least of the ranks' sums 3.0 (4.5 alone), over 3 calls
    a = {(False, True): 0.5, (False, False): 2.0, (True, True): 1.0, (True, False): 1.5}[deterministic, comm.size > 1]
    assert session.result == pytest.approx({"a": a, "b": 0.8})
    assert all_ok(comm, min(session.result, key=session.result.__getitem__) == ("b" if a > 0.8 else "a"))


def test_a_rehearsal_takes_the_median_of_batches_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rehearsed, each candidate runs :data:`online.REHEARSALS` batches, the candidates
    taking turns in a rotating order, and its median batch counts: one slow batch of
    "a" (a slow moment of the machine) does not hand the band to "b", as one batch per
    candidate did. A fake clock: "a"'s first batch takes 10 a call, its others 0.5;
    "b" takes 0.8."""
    comm = MPI.COMM_WORLD
    clock = [0.0]
    monkeypatch.setattr(online.time, "perf_counter", lambda: clock[0])
    ran: list[str] = []

    def run(name: str):
        def timed(x: np.ndarray, red: object) -> None:
            clock[0] += 0.8 if name == "b" else 10.0 if ran.count("a") < 3 else 0.5
            ran.append(name)

        return timed

    session = online.Session({n: run(n) for n in "ab"}, ["a", "b"], 3, comm, deterministic=True)
    session.rehearse(np.zeros(4), None)
    assert ran == ["a"] * 3 + ["b"] * 6 + ["a"] * 6 + ["b"] * 3
    assert session.result == pytest.approx({"a": 0.5, "b": 0.8})


def tune_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online tuning finds every candidate close, at every size (so the three fastest are
    tuned), and every rank a core of its own (the machine running the tests may have fewer)."""
    monkeypatch.setattr(online, "CLOSE", 1e9)
    monkeypatch.setattr(online, "SHORTEST", 0.0)
    monkeypatch.setattr(selector, "cores_per_rank", lambda ctx: 1.0)


def calls_until_decided(comm: MPI.Comm, x: np.ndarray, expected: float, most: int = 30) -> int:
    """All-reduce ``x`` (each rank's ones times rank + 1) with auto until explain says
    online tuning chose; every result must be exact. The number of calls."""
    for calls in range(1, most + 1):
        x[:] = comm.rank + 1
        collectives.allreduce(x, comm)
        assert all_ok(comm, bool(np.all(x == expected)))
        if collectives.explain(x.nbytes, comm).source.endswith("online tuning"):
            return calls
    return most + 1


@pytest.mark.timeout(60)
def test_online_tuning_runs_the_close_candidates_agrees_and_persists(
    fresh: MPI.Intracomm, measured: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first calls of a size band run the candidates the calibration found close
    (here: all, so the three fastest) in turn; one agreement later the fastest is
    kept on every rank, and a later communicator of the same shape uses it at once."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    p, x = fresh.size, np.zeros(10 * KIB, np.float32)
    calls = calls_until_decided(fresh, x, p * (p + 1) / 2)
    choice = collectives.explain(x.nbytes, fresh)
    assert same_everywhere(fresh, (calls, choice.algorithm, choice.predictions))
    assert calls in range(online.MOST * 3, online.MOST * 7 + 1) and len(choice.predictions) == online.MOST, choice
    fresh.Free()
    monkeypatch.setattr(online, "Session", lambda *a, **k: pytest.fail("tuned again"))
    measured.clear()
    comm = MPI.COMM_WORLD.Dup()
    try:
        assert calls_until_decided(comm, x, p * (p + 1) / 2) == 1 and not measured
        again = collectives.explain(x.nbytes, comm)
        assert all_ok(comm, again.source == "cached online tuning" and again.algorithm == choice.algorithm)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_bench_times_auto_after_its_tuning(fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mpidl bench`` times auto's steady state: its online tuning runs in full at its first
    call, however few calls a size gets (here 4, where the tuning takes 9 or more; an
    unfinished tuning is lost at exit, and each new process then chose by how many calls
    its batch timing happened to make). The switches are put back after."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    results = bench.run([13 * KIB], ["auto", "ring"], repeat=1, batch_time=0.0, progress=False, comm=fresh)
    auto = next(r for r in results if r.algorithm == "auto")
    assert all_ok(fresh, auto.source.endswith("online tuning")), auto.source
    assert collectives.set_tuning() == collectives.TuningSettings(online=True, deterministic=False, cache=True)


@pytest.mark.timeout(60)
def test_no_online_tuning_where_ranks_share_cores(fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node with fewer cores than ranks a single call's time is the scheduler's as
    much as the collective's: the calibration's choice stands, and explain() says why."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    monkeypatch.setattr(selector, "cores_per_rank", lambda ctx: 0.5 if ctx.rank == fresh.size - 1 else 2.0)
    monkeypatch.setattr(online, "Session", lambda *a, **k: pytest.fail("tuned"))
    p, x = fresh.size, np.zeros(11 * KIB, np.float32)
    assert calls_until_decided(fresh, x, p * (p + 1) / 2, most=4) == 5
    choice = collectives.explain(x.nbytes, fresh)
    assert all_ok(fresh, choice.source == "calibration" and "no online tuning" in choice.reason), choice.reason
    assert all_ok(fresh, "0.5 cores per rank" in choice.reason)


@pytest.mark.timeout(60)
def test_deterministic_tuning_where_ranks_share_cores(fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deterministic tuning times rehearsed batches of back-to-back calls, not single
    calls: it runs on an oversubscribed machine too, where the calibration's batches of
    one call each miss what back-to-back calls overlap."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    monkeypatch.setattr(selector, "cores_per_rank", lambda ctx: 0.5 if ctx.rank == fresh.size - 1 else 2.0)
    collectives.set_tuning(deterministic=True, watch=False)  # a drift would measure anew: not tested here
    x = np.zeros(11 * KIB, np.float32)
    collectives.allreduce(x, fresh)
    choice = collectives.explain(x.nbytes, fresh)
    assert all_ok(fresh, choice.source == "online tuning"), (choice.source, choice.reason)


@pytest.mark.timeout(60)
def test_ranks_follow_rank_0s_switches(fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online tuning on at rank 0 only: every rank tunes (rank 0's switches rule), so
    the calls stay matched (a rank that did not tune left the others' agreement
    waiting, or mixed algorithms)."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    collectives.set_tuning(online=fresh.rank == 0)
    p, x = fresh.size, np.zeros(12 * KIB, np.float32)
    assert all_ok(fresh, calls_until_decided(fresh, x, p * (p + 1) / 2) > 1)


@pytest.mark.timeout(60)
def test_deterministic_tuning_leaves_the_callers_buffer_to_one_algorithm(
    fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``deterministic``, the first call tunes on a copy and then runs the winner:
    its result has the winner's bits (summation order) and the choice is made. No
    watch window is rehearsed after the tuning's: it would time what was just timed."""
    if fresh.size == 1:
        pytest.skip("one rank has nothing to tune")
    tune_everything(monkeypatch)
    monkeypatch.setattr(selector, "SHORTEST", 0.0)  # every choice watched, but for the tuned
    windows: list[str] = []
    monkeypatch.setattr(watch.Watch, "rehearse", lambda self, *args: windows.append(self.chosen))
    collectives.set_tuning(deterministic=True)
    rng = np.random.default_rng(fresh.rank)
    values = (rng.standard_normal(9 * KIB // 4) * 10.0 ** rng.integers(-6, 7, 9 * KIB // 4)).astype(np.float32)
    x = values.copy()
    collectives.allreduce(x, fresh)
    choice = collectives.explain(x.nbytes, fresh)
    y = values.copy()
    collectives.allreduce(y, fresh, collective=choice.algorithm)
    assert all_ok(fresh, choice.source == "online tuning" and x.tobytes() == y.tobytes()), choice
    assert windows == []


def test_native_only_where_it_reduces_as_the_others(fresh: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto leaves "mpi" out for float16, for min on floats, and everywhere once the
    library gave ranks different bits at a measured size."""
    if fresh.size == 1:
        pytest.skip("one rank measures nothing")
    assert "mpi" in collectives.explain(5 * KIB, fresh).predictions
    assert "mpi" in collectives.explain(5 * KIB, fresh, dtype="int32", op="min").predictions
    assert "mpi" not in collectives.explain(5 * KIB, fresh, dtype="float16").predictions
    assert "mpi" not in collectives.explain(5 * KIB, fresh, op="min").predictions
    monkeypatch.setattr(sweep, "identical", lambda *a: False)
    choice = collectives.explain(40 * KIB, fresh)
    assert "mpi" not in choice.predictions and "mpi left out: the MPI library's result differed" in choice.reason


@pytest.mark.parametrize("dtype, length", [("int64", 5), ("float32", 5), ("float64", 20000)])
def test_native_counts_an_estimate_and_polls_in_service_threads(dtype: str, length: int) -> None:
    """ "mpi" counts 2 (p-1)/p of the vector as handed to the library, and works on a
    thread whose waits poll (nonblocking collectives tested with sleeps)."""
    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    x = np.full(length, r + 1, dtype)
    before = p2p.bytes_by_peer().get(p2p.MPI_LIBRARY, 0)
    collectives.allreduce(x, comm, collective="mpi")
    counted = p2p.bytes_by_peer().get(p2p.MPI_LIBRARY, 0) - before
    ok = counted == 2 * (p - 1) * x.nbytes // p and bool(np.all(x == p * (p + 1) // 2))
    y = np.full(length, r + 1, dtype)

    def polling() -> None:
        p2p.poll_waits()
        collectives.allreduce(y, comm, collective="mpi", validate=False)

    thread = threading.Thread(target=polling)
    thread.start()
    thread.join(30)
    assert all_ok(comm, ok and not thread.is_alive() and bool(np.all(y == p * (p + 1) // 2)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_choice_slower_than_its_measurement_is_measured_anew(
    fresh: MPI.Intracomm, measured: list[int], monkeypatch: pytest.MonkeyPatch, deterministic: bool
) -> None:
    """A choice whose calls take over ``DRIFT`` times what its measurement promised (here
    the first measurement made 1000 times too fast, as a cache from a faster spell of
    the machine would be) is measured anew, on every rank at the same call: on real
    calls after a window of ``WINDOW`` timed calls and one of a rival's, which did not
    beat it; with deterministic tuning before the first call runs (its window rehearsed
    on a copy, and a batch of the rival, which beat it: a rival that does not keeps the
    choice, ``test_watch.py``). Every result is exact."""
    if fresh.size == 1:
        pytest.skip("one rank measures nothing")
    monkeypatch.setattr(selector, "cores_per_rank", lambda ctx: 1.0)
    monkeypatch.setattr(selector, "SHORTEST", 0.0)
    monkeypatch.setattr(online, "close", lambda predictions: [])  # no online tuning, only the watch
    monkeypatch.setattr(watch, "MARGIN", 1e-6 if deterministic else 1e6)  # the rival beats the choice, or not
    collectives.set_tuning(deterministic=deterministic)
    p, x = fresh.size, np.zeros(6 * KIB, np.float32)
    once, twice = list(needed(x.nbytes)), list(needed(x.nbytes)) * 2
    real = sweep.point  # measured's: it notes the size first
    monkeypatch.setattr(
        sweep,
        "point",
        lambda *args: {n: t * (1e-3 if len(measured) <= len(once) else 1.0) for n, t in real(*args).items()},
    )
    calls = 1 if deterministic else 2 + 2 * watch.WINDOW
    for call in range(1, calls + 1):
        x[:] = fresh.rank + 1
        collectives.allreduce(x, fresh)
        assert all_ok(fresh, bool(np.all(x == p * (p + 1) / 2)))
        assert all_ok(fresh, measured == (twice if call == calls else once)), (call, measured)
    choice = collectives.explain(x.nbytes, fresh)
    assert same_everywhere(fresh, (choice.algorithm, choice.predictions))
    assert all_ok(fresh, choice.source == "calibration" and "measured anew" in choice.reason), choice.reason
