"""Bad input: the same clear error on every rank, no hang, buffer untouched."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, mpiexec, on_rank0_quietly

import collectives
from collectives import ArgumentError

pytestmark = pytest.mark.mpi


def expect_same_error(call, *match: str) -> ArgumentError:
    """Run ``call``; every rank must raise ArgumentError with identical text containing ``match``."""
    comm = MPI.COMM_WORLD
    with pytest.raises(ArgumentError) as info:
        call()
    text = str(info.value)
    assert all_ok(comm, len(set(comm.allgather(text))) == 1 and all(m in text for m in match)), text
    return info.value


def one_rank_differs(good, bad):
    """``bad`` on the last rank, ``good`` elsewhere (a single-rank world gets ``bad``)."""
    comm = MPI.COMM_WORLD
    return bad if comm.Get_rank() == comm.Get_size() - 1 else good


@pytest.mark.parametrize("algorithm", list(collectives.COLLECTIVES))
def test_length_mismatch_raises_everywhere_and_leaves_buffer(algorithm: str) -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.arange(one_rank_differs(6, 5), dtype=np.float32) + comm.Get_rank()
    before = x.copy()
    err = expect_same_error(lambda: collectives.allreduce(x, collective=algorithm), "length differs", "no data moved")
    assert err.ranks == (comm.Get_size() - 1,) or comm.Get_size() == 2
    assert np.array_equal(x, before)


def test_length_mismatch_across_the_fused_limit() -> None:
    """Small buffers travel with the argument check, large ones after it: a mix still fails cleanly."""
    from collectives.validation import FUSE_LIMIT

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.ones(one_rank_differs(100, FUSE_LIMIT // 4 + 100), dtype=np.float32)
    expect_same_error(lambda: collectives.allreduce(x, collective="butterfly"), "length differs")
    assert np.all(x == 1)


def test_persistent_allreduce_arguments_are_checked_when_made_and_when_called() -> None:
    """Making persistent all-reduces of different lengths, or of a bad buffer on one rank,
    raises on every rank together; ranks calling different handles get the check's error
    as with ``allreduce``, buffers untouched."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.ones(one_rank_differs(6, 5), dtype=np.float32)
    expect_same_error(lambda: collectives.allreduce_init(x, comm, "sum", "auto"), "length differs")
    bad = one_rank_differs(np.arange(4.0), np.arange(8.0)[::2])
    expect_same_error(lambda: collectives.allreduce_init(bad, comm), "not C-contiguous")
    six, five = np.ones(6, np.float32), np.ones(5, np.float32)
    handles = [collectives.allreduce_init(six, comm), collectives.allreduce_init(five, comm)]
    expect_same_error(one_rank_differs(*handles), "length differs", "no data moved")
    assert np.all(six == 1) and np.all(five == 1)


def test_algorithm_mismatch() -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.ones(10)
    expect_same_error(
        lambda: collectives.allreduce(x, collective=one_rank_differs("butterfly", "ring")),
        "collective differs",
        "butterfly",
        "ring",
    )
    assert np.all(x == 1)


def test_dtype_mismatch() -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    x = np.ones(4, dtype=one_rank_differs("float32", "float64"))
    expect_same_error(lambda: collectives.allreduce(x), "dtype differs", "float32", "float64")


def test_op_mismatch() -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    expect_same_error(
        lambda: collectives.allreduce(np.ones(4), op=one_rank_differs("sum", "max")),
        "op differs",
        "rank 0: sum",
        "max)",
    )


@pytest.mark.parametrize(
    "case, bad, match",
    [
        ("non-contiguous", lambda: np.arange(8.0)[::2], "not C-contiguous"),
        ("read-only", lambda: np.frombuffer(bytes(32), dtype=np.float64), "read-only"),
        ("unsupported dtype", lambda: np.zeros(4, dtype=np.uint8), "unsupported dtype uint8"),
        ("complex", lambda: np.zeros(4, dtype=np.complex64), "supported: float16, bfloat16"),
        ("byte order", lambda: np.zeros(4, dtype=">f8"), "byte order"),
        ("type", lambda: [1.0, 2.0, 3.0, 4.0], "unsupported buffer type builtins.list"),
    ],
)
def test_bad_buffer_on_one_rank_reported_on_all(case: str, bad, match: str) -> None:
    comm = MPI.COMM_WORLD
    x = one_rank_differs(np.arange(4.0), bad())
    before = np.array(x, copy=True)
    err = expect_same_error(lambda: collectives.allreduce(x), match, f"rank(s) [{comm.Get_size() - 1}]")
    assert err.ranks == (comm.Get_size() - 1,)
    assert np.array_equal(np.asarray(x), before)


def test_unknown_op_lists_valid_ops() -> None:
    expect_same_error(
        lambda: collectives.allreduce(np.ones(3), op="mean"), "unknown op 'mean'", "sum, avg, min, max, prod"
    )


def test_unknown_algorithm_lists_valid_algorithms() -> None:
    expect_same_error(
        lambda: collectives.allreduce(np.ones(3), collective="tree"),
        "unknown collective 'tree'",
        *collectives.COLLECTIVES,
    )


def test_avg_on_integers_is_an_error() -> None:
    expect_same_error(lambda: collectives.allreduce(np.ones(3, np.int32), op="avg"), "'avg' on integer dtype int32")


def test_validation_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """validate=False and set_default(False) skip the cross-rank check; local errors still raise locally."""
    from collectives import validation

    def boom(*args, **kwargs):
        raise AssertionError("validation ran")

    monkeypatch.setattr(validation, "check", boom)
    comm = MPI.COMM_WORLD
    x = np.ones(5)
    collectives.allreduce(x, collective="ring", validate=False)
    monkeypatch.setattr(validation, "_default", True)
    validation.set_default(False)
    collectives.allreduce(x, collective="ring")
    with pytest.raises(ArgumentError, match="unknown op"):
        collectives.allreduce(x, op="bogus", collective="ring")
    assert all_ok(comm, bool(np.all(x == comm.Get_size() ** 2)))


def test_environment_variable_switches_validation_off() -> None:
    code = "from collectives import validation; assert validation.enabled(None) is False"
    proc = on_rank0_quietly(mpiexec, 1, ["-c", code], env={"MPIDL_VALIDATE": "0"})
    assert proc.returncode == 0, proc.stderr


def test_collectives_work_after_errors() -> None:
    """A rejected call leaves no stray messages behind."""
    comm = MPI.COMM_WORLD
    with pytest.raises(ArgumentError):
        collectives.allreduce(np.ones(one_rank_differs(3, 4)) if comm.Get_size() > 1 else np.ones(3), op="nope")
    x = np.full(7, comm.Get_rank(), dtype=np.int64)
    collectives.allreduce(x, collective="halving_doubling")
    n = comm.Get_size()
    assert all_ok(comm, bool(np.all(x == n * (n - 1) // 2)))


#: A failed call (rank 1's length differs) leaves rank 1 one more resolved call,
#: so it drops its kept calls (the limit is ``api._CALLS``) one distinct call
#: before rank 0; then a repeated call is resolved on one rank and new on the other.
KEPT_CALLS_DIFFER = """
import sys
import numpy as np
from mpi4py import MPI
import collectives
from collectives import ArgumentError, api
comm, algorithm = MPI.COMM_WORLD, sys.argv[1]
r, n = comm.Get_rank(), comm.Get_size()

def exact(length):
    x = np.full(length, 10.0**r)
    collectives.allreduce(x, collective=algorithm)
    return bool(np.all(x == sum(10.0**i for i in range(n))))

ok = [exact(6)]
try:
    collectives.allreduce(np.ones(6 if r == 0 else 5), collective=algorithm)
except ArgumentError:
    pass
for length in range(8, 8 + api._CALLS + 8):
    ok += [exact(length), exact(6)]
wrong = comm.allreduce(ok.count(False))
if r == 0:  # one line: both ranks' prints could interleave
    print("wrong results:", wrong)
"""


@pytest.mark.parametrize("algorithm", ["butterfly", "auto"])
def test_ranks_that_kept_different_calls_across_nodes(algorithm: str) -> None:
    """On two nodes small butterfly all-reduces ride in the check's messages once
    the call is bound: a rank whose call was not bound sent the bare check, and
    both raised "ranks disagree" on agreeing arguments. The path a call takes
    must depend only on what every rank has built (plans, auto's choices)."""
    run = on_rank0_quietly(mpiexec, 2, ["-c", KEPT_CALLS_DIFFER, algorithm], hosts="a:1,b:1", timeout=60)
    assert run.returncode == 0 and "wrong results: 0" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


#: On nodes of several ranks: every way of disagreeing, on a leader, on another rank
#: and on the bare check's path (a bad buffer), against calls that reduce small vectors
#: in the check's messages (shm, auto) or after it (ring), with exact results between.
ACROSS_NODES = """
import numpy as np
from mpi4py import MPI
import collectives
from collectives import ArgumentError, validation
from collectives.transport.context import context
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
small, large = 1000, validation.FUSE_LIMIT // 4 + 3
wrong = []

def exact(collective, length, dtype="float32", op="sum"):
    x = (np.full(length, 10.0**r) if dtype == "float32" else np.full(length, r + 1)).astype(dtype)
    collectives.allreduce(x, op=op, collective=collective)
    floats = {"sum": sum(10.0**i for i in range(n)), "max": 10.0 ** (n - 1)}
    want = floats[op] if dtype == "float32" else n * (n + 1) // 2
    same = len(set(comm.allgather(x.tobytes()))) == 1
    if not (same and np.all(x == want)):
        wrong.append(f"{collective} {length} {dtype} {op}")

def refused(collective, x, *words):
    before = np.array(x, copy=True)
    try:
        collectives.allreduce(x, collective=collective)
        wrong.append(f"{collective}: no error for {words}")
    except ArgumentError as e:
        text = str(e)
        if len(set(comm.allgather(text))) != 1 or not all(w in text for w in words):
            wrong.append(f"{collective}: {text}")
    if not np.array_equal(np.asarray(x), before):
        wrong.append(f"{collective}: buffer changed by a refused call {words}")

for collective in ("shm", "auto", "butterfly", "ring"):
    for length in (0, 1, 3, small, large):
        exact(collective, length)
    exact(collective, small, "int64")
    exact(collective, 5, op="max")
split = validation.nodes(context(comm))
if split is None:
    wrong.append("the check did not go through the nodes")
last, leader_b = n - 1, 2  # node b's leader; the last rank leads node b on a:2,b:1
for collective in ("shm", "auto", "ring"):
    for odd in (1, leader_b, last):
        for good, bad in ((small, small + 1), (small, large), (large, small)):
            refused(collective, np.ones(bad if r == odd else good, np.float32), "length differs", "no data moved")
            exact(collective, small)
    refused(collective, np.ones(small, np.float64 if r == 1 else np.float32), "dtype differs")
    x = np.ones(small, np.float32)
    if r == leader_b:
        x.flags.writeable = False
    refused(collective, x, "read-only", f"rank(s) [{leader_b}]")
    x = np.ones(small, np.float32)
    if r == 1:
        x = np.ones(2 * small, np.float32)[::2]
    refused(collective, x, "not C-contiguous", "rank(s) [1]")
    exact(collective, small)
if wrong:
    print(f"rank {r}:", *wrong[:5], sep="\\n  ")
total = comm.allreduce(len(wrong))
if r == 0:
    print("wrong results:", total)
"""


@pytest.mark.parametrize("hosts, n", [("a:2,b:2", 4), ("a:2,b:1", 3)])
def test_the_check_across_nodes_of_several_ranks(hosts: str, n: int) -> None:
    """Where nodes hold several ranks the check goes through each node's segment and
    the leaders, and small shm all-reduces ride in it: exact results, and every
    disagreement (on a leader or not, fused or not, a bad buffer on the bare path)
    raises the same error on every rank with every buffer untouched, no hang."""
    run = on_rank0_quietly(mpiexec, n, ["-c", ACROSS_NODES], hosts=hosts, timeout=240)
    assert run.returncode == 0 and "wrong results: 0" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


RIDES = """
import numpy as np
from mpi4py import MPI
import collectives
from collectives import ArgumentError, validation
from collectives.transport.context import context
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
expect = validation.expected(context(comm))
wrong = []
WANT = {"sum": n * (n + 1) // 2, "avg": (n + 1) / 2, "max": n, "min": 1, "prod": np.prod(np.arange(1, n + 1))}

def exact(length, dtype="int64", op="sum", nans=False):
    x = np.full(length, r + 1, dtype)
    if nans:  # of another payload on each rank: the bits must come out alike
        bits = (np.uint32, 0x7FC00001) if x.itemsize == 4 else (np.uint64, 0x7FF8000000000001)
        x.view(bits[0])[::7] = bits[1] + r
    collectives.allreduce(x, op=op, collective="mpi")
    want = np.full(length, WANT[op], dtype)
    if nans:
        want[::7] = np.nan
    if not (np.array_equal(x, want, equal_nan=nans) and len(set(comm.allgather(x.tobytes()))) == 1):
        wrong.append(f"{length} {dtype} {op}: {x[:3]}")

def rode(calls, *shapes):
    # the shapes' calls in turn, `calls` rounds; how many calls rode in the library's all-reduce
    hits = expect.hits
    for _ in range(calls):
        for shape in shapes:
            exact(*shape)
    return expect.hits - hits

def refused(x, words, call=None):
    before = x.copy()
    try:
        call() if call else collectives.allreduce(x, collective="mpi")
        wrong.append(f"no error for {words}")
    except ArgumentError as e:
        if not all(w in str(e) for w in words):
            wrong.append(str(e))
    if not np.array_equal(x, before):
        wrong.append(f"buffer changed by a refused call {words}")

longest = validation.FUSE_LIMIT // 8  # int64: the longest vector that rides
shapes = [(1,), (3,), (1000,), (longest,), (1000, "int32", "max"), (7, "int64", "min"),
          (5, "float64", "prod"), (1001, "float32", "avg"), (9, "float32", "sum"), (100, "float32", "sum", True),
          (1, "float32", "sum", True), (3, "float64", "sum", True)]
for shape in shapes:
    rode(4, shape)  # learnt: the same call followed twice (after the call that built the plan)
    if rode(4, shape) != 4:
        wrong.append(f"{shape} did not ride")
    rode(2, (0,))  # an empty vector moves no data: checked, never riding
if rode(6, (longest + 1,)) != 0:
    wrong.append("a vector above the short limit rode")
rode(3, (10,), (20,), (10, "float64"))  # a cycle of three
if rode(3, (10,), (20,), (10, "float64")) != 9:
    wrong.append("a cycle of three did not ride")
if comm.allreduce(expect.hits) != n * expect.hits:
    wrong.append("ranks rode different calls")

a = 1000
for odd in sorted({0, 1, n - 1}):
    cases = [
        (np.ones(a + 1 if r == odd else a, np.int64), ["length differs", "no data moved"], None),
        (np.ones(a, np.int32 if r == odd else np.int64), ["dtype differs"], None),
        (np.ones(a, np.int64), ["op differs"],
         lambda x: collectives.allreduce(x, op="max" if r == odd else "sum", collective="mpi")),
        (np.ones(a, np.int64), ["collective differs"],
         lambda x: collectives.allreduce(x, collective="ring" if r == odd else "mpi")),
        (np.ones(a, np.int64), ["invalid arguments", f"rank(s) [{odd}]", "read-only"], "read-only"),
        (np.ones(a, np.int64), [],
         lambda x: collectives.broadcast(x) if r == odd else collectives.allreduce(x, collective="mpi")),
    ]
    for x, words, call in cases:
        rode(3, (a,))
        misses = expect.misses
        if call == "read-only":
            x.flags.writeable = r != odd
            call = None
        refused(x, words, call and (lambda: call(x)))
        if expect.misses != misses + 1:
            wrong.append(f"{words}: the ride did not miss")
        if rode(4, (a,)) < 1:  # and riding again once learnt
            wrong.append(f"{words}: no ride after the refusal")
if wrong:
    print(f"rank {r}:", *wrong[:5], sep="\\n  ")
total = comm.allreduce(len(wrong))
if r == 0:
    print("wrong results:", total, "rides:", expect.hits)
"""


@pytest.mark.parametrize("hosts, n", [("a:2,b:2", 4), ("a:1,b:1,c:1", 3)])
def test_the_check_rides_in_the_mpi_librarys_allreduce_where_the_call_is_expected(hosts: str, n: int) -> None:
    """Across nodes (of several ranks, or one each), a short "mpi" all-reduce that repeats
    the call expected after the last one (the same call twice in a row after it, a cycle of
    three) carries the check in the library's own all-reduce, a tag after the vector: exact
    results, bitwise the same on every rank (NaNs of other payloads too), for every riding op
    and dtype, lengths 1 to the fused limit (not above it, nor empty ones, which move no
    data); and where one rank's call is another (its length, dtype, op, collective, a
    broadcast, a read-only buffer), on a leader or not, every rank raises, every buffer
    untouched, no hang, and the calls ride again once learnt."""
    run = on_rank0_quietly(mpiexec, n, ["-c", RIDES], hosts=hosts, timeout=240)
    assert run.returncode == 0 and "wrong results: 0" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
