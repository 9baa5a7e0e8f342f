"""Service threads: refused below ``MPI_THREAD_MULTIPLE`` on every rank, and an
exception in one is never lost (the job-ending side is in test_failures.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpitest import mpiexec, on_rank0_quietly

from collectives.transport.background import Background


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_service_threads_are_refused_below_thread_multiple(ranks: int) -> None:
    """Under ``MPI_THREAD_SERIALIZED`` every part that would start a thread making MPI
    calls (Prague's and P-Reduce's group generator, AD-PSGD, LSGD, the step budget)
    raises an ArgumentError that says why, on every rank, in bounded time (the
    nonblocking all-reduce at its first call); static Prague, which starts none, is
    created."""
    proc = on_rank0_quietly(mpiexec, ranks, ["tests/scripts/thread_level.py"], timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    every = json.loads(proc.stdout)
    assert len(every) == ranks
    for outcomes in every:
        assert outcomes.pop("prague-static") == "created"
        assert outcomes.keys() == {
            "prague",
            "prague-random",
            "preduce",
            "adpsgd",
            "lsgd",
            "step-budget",
            "allreduce-async",
        }
        for case, outcome in outcomes.items():
            assert (
                outcome.startswith("raised ")
                and ("MPI must provide MPI_THREAD_MULTIPLE (mpi4py's default), but it provides MPI_THREAD_SERIALIZED")
                in outcome
            ), (case, outcome)


def test_background_close_raises_a_failure_no_one_collected() -> None:
    """A task whose result close() drops does not take its exception with it."""
    service = Background("test-dropped")
    data = np.zeros(3)
    service.submit(np.add, data, 1, out=data)
    service.submit(lambda: 1 / 0)
    service.submit(np.add, data, 1, out=data)
    with pytest.raises(ZeroDivisionError):
        service.close()
    assert data.tolist() == [2, 2, 2]  # the queued tasks ran first
    assert service.pending == 0
