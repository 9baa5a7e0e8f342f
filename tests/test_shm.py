"""The shared-memory all-reduce: pieces, the check riding in the segment, the
segment's life cycle, threads, and the bytes it counts."""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest
from allreduce_matrix import available_dtypes, check
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, mpiexec, on_rank0_quietly

import collectives
from collectives import ArgumentError, api
from collectives.kernels import resident, shm
from collectives.transport import p2p
from collectives.transport.context import context
from collectives.transport.ops import reduction

pytestmark = pytest.mark.mpi


def fresh(size: int) -> MPI.Intracomm:
    """A new communicator of min(size, world) ranks (so a new segment is allocated)."""
    return comm_of_size(size).Dup()


@pytest.mark.parametrize("replicate", [shm.REPLICATE, 0])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_pieces_and_their_boundaries(size: int, replicate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long vectors go through the segment in pieces: make pieces 24 bytes, so
    every length below spans several, with odd tails and empty slices; and
    reduce them replicated (small vectors, two ranks) and sliced."""
    monkeypatch.setattr(shm, "SEGMENT", 24)
    monkeypatch.setattr(shm, "REPLICATE", replicate)
    comm = fresh(size)
    try:
        failures = check(comm, ["shm"], available_dtypes(), ["sum", "max", "prod"], [1, 2, 5, 17, 100])
        failures += check(comm, ["shm"], ["float64", "int32"], ["sum", "min"], [1, 7, 41], layout="2")
        assert comm.Get_size() == 1 or shm.shared(context(comm)).capacity == 24
    finally:
        comm.Free()
    failures = gather_failures(MPI.COMM_WORLD, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures[:20])


@pytest.mark.parametrize("replicate", [shm.REPLICATE, 0])
def test_equal_dtypes_of_other_buffer_formats(replicate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """int64 is numpy's "l" and "q" on Linux: equal dtypes whose buffers differ in
    format. The segment's views of one must not be reused for the other, in either
    buffer of the double buffer, replicated or sliced."""
    monkeypatch.setattr(shm, "REPLICATE", replicate)
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    vectors = [np.full(5, r + 1, dtype=np.dtype(char)) for char in "lqqqll"]
    for v in vectors:
        collectives.allreduce(v, comm, "sum", "shm")
    assert all_ok(comm, all(bool(np.all(v == n * (n + 1) // 2)) for v in vectors))


@pytest.mark.job
@pytest.mark.parametrize("layout", [None, "2", "4,2"])
def test_pieces_on_six_ranks(layout: str | None) -> None:
    """Sliced pieces on a node of six ranks, and on emulated nodes of several."""
    args = ["tests/allreduce_matrix.py", "--collectives", "shm", "--shm-piece", "40", "--design", "pairs"]
    proc = on_rank0_quietly(mpiexec, 6, args + (["--layout", layout] if layout else []), timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def one_rank_differs(comm: MPI.Comm, good, bad):
    return bad if comm.Get_rank() == comm.Get_size() - 1 else good


@pytest.mark.parametrize("algorithm", ["shm", "auto"])
def test_disagreement_after_the_plan_exists(algorithm: str) -> None:
    """Once a call is bound the check rides in the segment (ranks 0..n-2 here),
    while a rank whose arguments changed goes through the plain check: they
    meet at the same barrier and all raise the same error, buffers untouched."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    for _ in range(2):
        x = np.arange(6, dtype=np.float32)
        collectives.allreduce(x, comm, collective=algorithm)
    assert all_ok(comm, bool(np.all(x == np.arange(6) * comm.Get_size())))
    if algorithm == "shm":  # the bound call carries the check in the segment
        assert any(call.carrier is not None for call in context(comm).calls.values())
    cases = [
        (np.arange(one_rank_differs(comm, 6, 5), dtype=np.float32), "length differs"),
        (np.arange(6, dtype=one_rank_differs(comm, np.float32, np.float64)), "dtype differs"),
        (one_rank_differs(comm, np.arange(6, dtype=np.float32), np.frombuffer(bytes(24), np.float32)), "read-only"),
    ]
    for x, match in cases:
        before = x.copy()
        with pytest.raises(ArgumentError) as info:
            collectives.allreduce(x, comm, collective=algorithm)
        text = str(info.value)
        assert all_ok(comm, len(set(comm.allgather(text))) == 1 and match in text), text
        assert np.array_equal(x, before)
    x = np.arange(6, dtype=np.float32)
    collectives.allreduce(x, comm, collective=algorithm)  # and the segment still works
    assert all_ok(comm, bool(np.all(x == np.arange(6) * comm.Get_size())))


def fail_once(comm: MPI.Comm, algorithm: str, length: int, kind: str = "length") -> None:
    """A call that is wrong on the last rank only: its length differs (the call is
    resolved there too), or its buffer is read-only (it fails before it is resolved)."""
    x = np.ones(length)
    if comm.Get_rank() == comm.Get_size() - 1:
        x = x[1:] if kind == "length" else np.frombuffer(x.tobytes())
    if comm.Get_size() == 1:
        return
    with pytest.raises(ArgumentError, match="length differs" if kind == "length" else "read-only"):
        collectives.allreduce(x, comm, collective=algorithm)
    assert np.all(x == 1)


def exact(comm: MPI.Comm, algorithm: str, length: int) -> bool:
    """All-reduce 10**rank (an exact sum in float64) and say whether every element is right."""
    x = np.full(length, 10.0 ** comm.Get_rank())
    collectives.allreduce(x, comm, collective=algorithm)
    return bool(np.all(x == sum(10.0**r for r in range(comm.Get_size()))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["length", "read-only"])
@pytest.mark.parametrize("failures", [1, 3])
@pytest.mark.parametrize("algorithm", ["shm", "auto"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_caught_errors_leave_the_segment_in_step(size: int, algorithm: str, failures: int, kind: str) -> None:
    """A bound call carries its check in the segment and takes a buffer before the
    check fails; a rank whose call is not bound (or fails before it is resolved)
    takes the plain check. Both must leave the segment alike: later results
    exact (a stale buffer read gave 2.0 instead of 11.0 on two ranks). Short
    vectors (replicated) and long ones (sliced on more than two ranks)."""
    comm = fresh(size)
    ok = []
    try:
        for length in (6, 20_000):
            ok.append(exact(comm, algorithm, length))  # binds the call
            for _ in range(failures):
                fail_once(comm, algorithm, length, kind)
            ok += [exact(comm, algorithm, length) for _ in range(3)]
            ok.append(exact(comm, algorithm, 7))
    finally:
        comm.Free()
    assert all_ok(MPI.COMM_WORLD, all(ok)), ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["shm", "auto"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ranks_that_kept_different_calls_stay_in_step(size: int, algorithm: str) -> None:
    """A failed call leaves the last rank one more resolved call than the others, so
    it reaches the limit of kept calls (512) and drops them one distinct call
    earlier: for a while a repeated call is resolved on some ranks and new on
    others. The way its check goes must not depend on that (it desynchronised the
    segment's barriers: wrong sums, then a hang)."""
    comm = fresh(size)
    calls = context(comm).calls
    ok, kept = [exact(comm, algorithm, 6)], []
    try:
        fail_once(comm, algorithm, 6)
        for length in range(8, 8 + api._CALLS + 8):  # more distinct calls than are kept
            ok.append(exact(comm, algorithm, length))
            kept.append(any(isinstance(k, tuple) and k[3] == 48 for k in calls))  # the 6-element call
            ok.append(exact(comm, algorithm, 6))
        differed = comm.Get_size() == 1 or len(set(comm.allgather(tuple(kept)))) > 1
    finally:
        comm.Free()
    assert all_ok(MPI.COMM_WORLD, all(ok)), [i for i, good in enumerate(ok) if not good][:10]
    assert all_ok(MPI.COMM_WORLD, differed)  # the mechanism was exercised


def test_segment_allocated_once_and_freed_with_the_communicator() -> None:
    comm = MPI.COMM_WORLD.Dup()
    ctx = context(comm)
    for n in (10, 100_000, 3, 1_000_000):
        collectives.allreduce(np.ones(n), comm, collective="shm")
        collectives.allreduce(np.ones(n), comm, collective="ring")  # the check uses the same segment
        seg = shm.shared(ctx)
        if n == 10:
            first = seg
        assert seg is first
    segments = [v for v in ctx.cache.values() if isinstance(v, shm.Segment)]
    assert len(segments) == (comm.Get_size() > 1)
    comm.Free()
    assert all(s._raw is None for s in segments) and not ctx.cache


def shared_directory(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A new directory of rank 0's, the same path on every rank."""
    comm = MPI.COMM_WORLD
    return comm.bcast(str(tmp_path_factory.mktemp("shm")) if comm.rank == 0 else None)


def test_shared_vectors_have_no_file(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared vectors' memory is a file without a name: none in its directory while
    the ranks map and use it."""
    directory = shared_directory(tmp_path_factory)
    monkeypatch.setattr(resident, "SHM_DIR", directory)
    comm = context(MPI.COMM_WORLD).comm
    vectors = resident.SharedVectors(comm, 10, np.int64)
    try:
        vectors.mine[:] = comm.rank
        vectors.allreduce(0, 10, reduction("sum", "int64"))
        n = comm.size
        ok = bool(np.all(vectors.mine == n * (n - 1) // 2)) and os.listdir(directory) == []
    finally:
        vectors.free()
    assert all_ok(MPI.COMM_WORLD, ok)


#: A rank dies while the shared vectors are allocated: rank 1 when it opens the
#: file rank 0 made, or rank 0 right after it made it.
DIES_IN_ALLOCATION = """
import os, signal, sys
import numpy as np
from mpi4py import MPI
from collectives.kernels import resident
from collectives.transport.context import context
from collectives.transport.ops import reduction
resident.SHM_DIR, victim = sys.argv[1], int(sys.argv[2])
comm = context(MPI.COMM_WORLD).comm
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if comm.rank == victim == 1:
    os.open = die
elif comm.rank == victim == 0:
    os.ftruncate = die
resident.SharedVectors(comm, 1000, np.float32)
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_no_file_left_when_a_rank_dies_in_allocation(victim: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The file had a name until every rank had opened it: a rank killed in between left
    it behind (the CHANGELOG promised no file left behind)."""
    directory = shared_directory(tmp_path_factory)
    run = on_rank0_quietly(mpiexec, 2, ["-c", DIES_IN_ALLOCATION, directory, str(victim)], timeout=60)
    assert run.returncode != 0 and "signal 9" in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]
    assert os.listdir(directory) == []


#: Rank 1 ends (os._exit, no MPI_Finalize) between two shared-memory all-reduces; each
#: other rank prints the error it got and how long after that end, then ends too (MPI
#: cannot finalize without rank 1; an abort would cut the others' reports short).
PEER_ENDS = """
import os, sys, time
import numpy as np
from mpi4py import MPI
import collectives
comm = MPI.COMM_WORLD
x = np.ones(1000)
try:
    for step in range(100000):
        if step == 5 and comm.rank == 1:
            with open(sys.argv[1], "w") as f:
                f.write(repr(time.time()))
            os._exit(0)
        collectives.allreduce(x, comm, collective="shm")
except collectives.CollectiveError as exc:
    with open(sys.argv[1]) as f:
        print(f"rank {comm.rank} after {time.time() - float(f.read()):.1f} s: {exc}", flush=True)
os._exit(0)
"""


def test_peer_that_ended_is_reported_not_waited_for(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A rank that waits in the segment for a peer whose process has ended raises
    CollectiveError naming it within seconds (it spun forever when the stall limit was
    off, its default). MPICH's launcher ends the job itself when a rank ends before
    MPI_Finalize (with status 0 too), so this runs with its clean-up off, as launchers
    that leave the other ranks running do."""
    stamp = shared_directory(tmp_path_factory) + "/ended"
    run = on_rank0_quietly(mpiexec, 3, ["-c", PEER_ENDS, stamp], timeout=60, options=["-disable-auto-cleanup"])
    out = run.stdout + run.stderr
    for rank in (0, 2):
        found = re.search(
            rf"rank {rank} after ([\d.]+) s: mpidl: rank 1 of MPI_COMM_WORLD \(process \d+, on this node\) has ended",
            out,
        )
        assert found and float(found.group(1)) < 2 + 10 * shm.ALIVE_EVERY, out[-3000:]


def test_concurrent_communicators_on_threads() -> None:
    """Two threads reduce on two communicators at once (as LSGD's service thread does)."""
    world = MPI.COMM_WORLD
    comms = [world.Dup(), world.Dup()]
    n, r = world.Get_size(), world.Get_rank()
    results: dict[int, bool] = {}

    def work(k: int) -> None:
        ok = True
        for step in range(50):
            x = np.full(1000 + 4000 * k, r + step + k, dtype=np.int64)
            collectives.allreduce(x, comms[k], collective="shm", validate=step % 2 == 0)
            ok &= bool(np.all(x == n * (step + k) + n * (n - 1) // 2))
        results[k] = ok

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.Free()
    assert all_ok(world, results == {0: True, 1: True}), results


def test_bytes_counted_are_the_bytes_published() -> None:
    """Each rank copies its vector into the segment once: that is what it "sends"."""
    comm = MPI.COMM_WORLD
    x = np.ones(1000, np.float64)
    before = p2p.bytes_sent()
    collectives.allreduce(x, comm, collective="shm", validate=False)
    sent = p2p.bytes_sent() - before
    assert all_ok(comm, sent == (x.nbytes if comm.Get_size() > 1 else 0)), sent
