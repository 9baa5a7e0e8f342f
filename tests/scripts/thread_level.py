"""Everything that starts a service thread, created under ``MPI_THREAD_SERIALIZED``
(for tests/test_service_threads.py): ``python thread_level.py`` under mpiexec.

Rank 0 prints, as JSON, every rank's outcome of each case: ``{CASE: "raised MESSAGE"
or "created"}`` by rank.
"""

from __future__ import annotations

import json

import mpi4py

mpi4py.rc.thread_level = "serialized"

import numpy as np  # noqa: E402  (after choosing the thread level)
from mpi4py import MPI  # noqa: E402

import algorithms  # noqa: E402
import collectives  # noqa: E402
from algorithms import SGD  # noqa: E402
from mpidl import pacing  # noqa: E402

comm = MPI.COMM_WORLD
assert MPI.Query_thread() == MPI.THREAD_SERIALIZED


def model(name: str, **options: object) -> algorithms.Algorithm:
    x = np.zeros(8)
    return algorithms.create(name, x, SGD(x, lr=0.1), comm, **options)


CASES = {
    "prague": lambda: model("prague"),
    "prague-random": lambda: model("prague", policy="random"),
    "preduce": lambda: collectives.PReduce(np.zeros(8), comm, policy="smart"),
    "adpsgd": lambda: model("adpsgd"),
    "lsgd": lambda: model("lsgd"),
    "step-budget": lambda: pacing.StepBudget(comm, 10),
    "allreduce-async": lambda: collectives.allreduce_async(np.zeros(8), comm),
    "prague-static": lambda: model("prague", policy="static"),  # no service thread: allowed
}

outcomes = {}
for case, make in CASES.items():
    try:
        made = make()
    except collectives.ArgumentError as exc:
        outcomes[case] = f"raised {exc}"
    else:
        made.close()
        outcomes[case] = "created"
every = comm.gather(outcomes)
if comm.Get_rank() == 0:
    print(json.dumps(every))
