"""Asynchronous training algorithms under load: learning rate 0, random per-rank delays.

Used by the pytest suite on communicators of 1..4 ranks and, as a script,
under a separate ``mpiexec`` for 5..8 ranks::

    mpiexec -n 6 python tests/async_check.py [--steps 400]

Every worker starts from its own random float64 parameters
(``broadcast_init=False``) and takes ``steps`` steps with learning rate 0,
sleeping a random time before each (each rank has its own speed, so some are
several times slower than others). Only the algorithm's averaging changes the
parameters, so the sum over all workers must stay what it was — after a
``settle()`` halfway and after ``close()`` — and the workers must reach
consensus. Any deadlock is caught by the caller's timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI
from mpitest import random_start, spread

import algorithms

#: Relative tolerance of the sum: float64 rounding over a few thousand averagings.
SUM_RTOL = 1e-10

#: (name, options) of the configurations checked.
CONFIGS = (
    ("adpsgd", {}),
    ("adpsgd", {"partner": "aware"}),
    ("grsgd", {"max_lead": 0}),
    ("grsgd", {"max_lead": 3}),
    ("prague", {"policy": "smart"}),
    ("prague", {"policy": "aware"}),
    ("prague", {"policy": "random", "group_size": 3}),
    ("prague", {"policy": "static", "group_size": 3, "period": 2}),
)


def check(
    comm: MPI.Comm, name: str, options: dict, steps: int = 400, seed: int = 0, max_delay: float = 1e-3, length: int = 5
) -> tuple[list[str], int]:
    """Run one configuration on ``comm`` (collective); return this rank's failure messages
    and the number of exchanges (averagings it took part in) it counted."""
    n = comm.Get_size()
    rng, speed, x = random_start(comm, seed, length)
    before = comm.allreduce(x.copy())
    spread_before = spread(comm, x)
    scale = comm.allreduce(float(np.abs(x).sum())) + 1.0
    if "group_size" in options:
        options = {**options, "group_size": min(options["group_size"], n)}
    what = f"{name} {options} n={n}"
    failures = []
    opt = algorithms.SGD(x, lr=0.0)
    algo = algorithms.create(name, x, opt, comm, broadcast_init=False, **options)
    for phase in range(2):
        for _ in range(steps // 2):
            time.sleep(speed * rng.uniform(0, max_delay))
            algo.step(np.zeros(length))
        if phase == 0:
            algo.settle()
        else:
            algo.close()
        drift = np.abs(comm.allreduce(x.copy()) - before).max()
        if drift > SUM_RTOL * scale:
            failures.append(
                f"{what}: after {'settle' if phase == 0 else 'close'} the sum over workers moved by {drift:.3g}"
            )
    spread_after = spread(comm, x)
    if n > 1 and spread_after > 1e-6 * spread_before:
        failures.append(f"{what}: no consensus after {steps} steps: spread {spread_before:.3g} -> {spread_after:.3g}")
    if algo.iterations != steps:
        failures.append(f"{what}: {algo.iterations} iterations, expected {steps}")
    return failures, _exchanges(algo)


def _exchanges(algo: algorithms.Algorithm) -> int:
    """Averagings this worker took part in (each pair or group counted once per member)."""
    if isinstance(algo, algorithms.ADPSGD):
        return algo.averagings
    if isinstance(algo, algorithms.GRSGD):
        return sum(algo.exchanges.values())
    return algo.stats.groups


def run_all(comm: MPI.Comm, steps: int) -> tuple[list[str], dict[str, int]]:
    """Every configuration; (failures of all ranks, exchanges per configuration summed over ranks)."""
    failures, counts = [], {}
    for name, options in CONFIGS:
        mine, exchanges = check(comm, name, options, steps)
        failures += [f for fs in comm.allgather(mine) for f in fs]
        counts[f"{name} {options}"] = comm.allreduce(exchanges)
    return failures, counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    failures, counts = run_all(comm, args.steps)
    if comm.Get_rank() == 0:
        print("\n".join(failures) or f"ok: {len(CONFIGS)} configurations on {comm.Get_size()} ranks")
        print("exchanges " + json.dumps(counts))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
