"""A job that stalls or loses a rank ends, non-zero and within bounds, saying why."""

from __future__ import annotations

import time

import pytest

from mpitest import mpiexec, on_rank0_quietly

pytestmark = pytest.mark.mpi

STALL_ENV = {"MPIDL_STALL_WARN": "1", "MPIDL_STALL_ABORT": "4"}


def run(mode: str, ranks: int, env: dict[str, str] | None = None):
    def go():
        t0 = time.monotonic()
        proc = mpiexec(ranks, ["tests/scripts/failure.py", mode], timeout=120, env=env)
        return proc, time.monotonic() - t0
    return on_rank0_quietly(go)


def test_stalled_collective_is_reported_then_aborts_the_job() -> None:
    proc, elapsed = run("stall", 3, STALL_ENV)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    err = proc.stderr
    assert "has waited" in err and "allreduce(algorithm='ring')" in err, err[-3000:]
    assert "rank(s) 1" in err or "rank(s) 1," in err or ", 1 " in err, err[-3000:]
    assert "the job aborts after 4 s" in err and "aborting the job" in err, err[-3000:]


def test_stalled_preduce_names_the_lock_holders() -> None:
    proc, elapsed = run("preduce", 3, STALL_ENV)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "P-Reduce" in proc.stderr, proc.stderr[-3000:]
    assert "group generator: the request of worker" in proc.stderr and "locks [" in proc.stderr, proc.stderr[-3000:]


def test_exception_on_one_rank_ends_the_job() -> None:
    proc, elapsed = run("raise", 3)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "mpidl: rank 1 failed" in proc.stderr and "injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]


def test_killed_rank_ends_the_job() -> None:
    proc, elapsed = run("kill", 3)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
