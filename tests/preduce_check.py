"""P-Reduce atomicity under load: learning rate 0, random per-rank delays.

Used by the pytest suite on communicators of 1..4 ranks and, as a script,
under a separate ``mpiexec`` for 5..8 ranks::

    mpiexec -n 6 python tests/preduce_check.py [--rounds 100]

Every worker starts from random float64 parameters and calls ``average()``
``rounds`` times, sleeping a random time before each call (each rank has its
own speed, so some are several times slower than others). Only averaging
changes the parameters, so the sum over all workers must stay what it was
(averaging within a group preserves it; two groups touching one worker at
once would not) and the workers must reach consensus. Any deadlock is caught
by the caller's timeout.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI
from mpitest import random_start, spread

import collectives

#: Relative tolerance of the sum: float64 reassociation over a few hundred averages.
SUM_RTOL = 1e-10


def configs(n: int) -> list[tuple[str, int]]:
    """(policy, group size) pairs worth running on n ranks: pairs, triples, everyone."""
    wanted = [("random", 2), ("random", 3), ("random", n), ("smart", 2), ("smart", 3), ("aware", 2), ("aware", 3)]
    wanted += [("static", 3), ("static", n)]
    return list(dict.fromkeys((policy, min(k, n)) for policy, k in wanted))


def check(
    comm: MPI.Comm,
    policy: str,
    group_size: int,
    rounds: int = 100,
    seed: int = 0,
    max_delay: float = 1e-3,
    length: int = 5,
) -> list[str]:
    """Run the experiment on ``comm``; return this rank's failure messages (collective)."""
    n, r = comm.Get_size(), comm.Get_rank()
    rng, speed, x = random_start(comm, seed, length)
    before = comm.allreduce(x.copy())
    spread_before = spread(comm, x)
    with collectives.PReduce(x, comm, group_size=group_size, policy=policy, seed=seed, period=2) as pr:
        for _ in range(rounds):
            time.sleep(speed * rng.uniform(0, max_delay))
            assert pr.average() is x
            assert pr.last_group is not None and r in pr.last_group and len(pr.last_group) <= group_size
    after = comm.allreduce(x.copy())
    spread_after = spread(comm, x)
    what = f"{policy} k={group_size} n={n}"
    failures = []
    scale = comm.allreduce(float(np.abs(x).sum()) + 1.0)
    if np.abs(after - before).max() > SUM_RTOL * scale:
        failures.append(f"{what}: sum over workers changed by {np.abs(after - before).max():.3g}")
    if n > 1 and group_size > 1 and spread_after > 1e-6 * spread_before:
        failures.append(f"{what}: no consensus after {rounds} rounds: spread {spread_before:.3g} -> {spread_after:.3g}")
    if pr.stats.calls != rounds or pr.stats.groups < rounds:
        failures.append(f"{what}: stats {pr.stats}")
    return failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    failures = []
    for policy, k in configs(comm.Get_size()):
        failures += check(comm, policy, k, args.rounds)
    failures = [f for fs in comm.allgather(failures) for f in fs]
    if comm.Get_rank() == 0:
        print("\n".join(failures) or f"ok: {len(configs(comm.Get_size()))} configurations on {comm.Get_size()} ranks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
