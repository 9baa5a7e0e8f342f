#!/usr/bin/env python3
"""Whether a node's shared-memory all-reduce has slow spells: ``shm`` and the ring, timed again and again.

    mpiexec -n 2 python jobs/shm_spells.py [--size 48MiB] [--minutes 5] [--every 10] [--pieces 256KiB,1MiB,4MiB]

On one node: every ``--every`` seconds for ``--minutes``, a float32 sum of
``--size`` bytes is timed 7 times (barrier-aligned, rank 0's clock, the
median kept) through the shared-memory kernel with each piece size of
``--pieces`` (a segment of each, as :mod:`collectives.kernels.shm` uses one
of 1 MiB), then through the ring; one line per round. At the end, per way:
the median and mean over the rounds, and in how many rounds it took over
1.5x the ring's time. A machine whose ``shm`` time jumps between rounds
while the ring's does not is one where a calibration taken once can be
wrong later (docs/performance.rst, "A machine that changes").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from collectives.kernels import ring, shm
from collectives.transport.ops import reduction
from mpidl.bench import parse_size


def median_time(comm: MPI.Comm, work: Callable[[], object], calls: int = 7) -> float:
    """The median of ``calls`` barrier-aligned calls of ``work`` (seconds, this rank's clock)."""
    times = []
    for _ in range(calls):
        comm.Barrier()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="48MiB", help="bytes of the vector (default 48MiB)")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to keep timing (default 5)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds from one round to the next (default 10)")
    parser.add_argument("--pieces", default="256KiB,1MiB,4MiB", help="shm piece sizes (default 256KiB,1MiB,4MiB)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() != comm.Get_size():
        raise SystemExit("shm_spells.py: run it on the ranks of one node")
    x = np.zeros(parse_size(args.size) // 4, np.float32)
    red = reduction("sum", "float32", np)
    ways: dict[str, Callable[[], object]] = {}
    for text in args.pieces.split(","):
        seg = shm.Segment(comm, parse_size(text))
        ways[f"shm {text}"] = functools.partial(shm.allreduce, x, seg, red)
    ways["ring"] = lambda: ring.allreduce(x, comm, red)
    for way in ways.values():
        way()  # pages and scratch
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    end = time.monotonic() + 60 * args.minutes
    while True:
        started = time.monotonic()
        for name, way in ways.items():
            rounds[name].append(median_time(comm, way))
        if comm.rank == 0:
            line = "  ".join(f"{name} {times[-1] * 1e3:5.1f}" for name, times in rounds.items())
            print(time.strftime("%H:%M:%S"), line, flush=True)
        pause = comm.bcast(max(0.0, args.every - (time.monotonic() - started)) if started < end else -1.0)
        if pause < 0:
            break
        time.sleep(pause)
    if comm.rank == 0:
        print(f"{len(rounds['ring'])} rounds of {x.nbytes} B on {comm.Get_size()} ranks, ms:")
        for name, times in rounds.items():
            slow = sum(t > 1.5 * r for t, r in zip(times, rounds["ring"]))
            print(
                f"{name:12s} median {statistics.median(times) * 1e3:6.1f}  mean {statistics.mean(times) * 1e3:6.1f}  "
                f"least {min(times) * 1e3:6.1f}  most {max(times) * 1e3:6.1f}  over 1.5x the ring: {slow}"
            )


if __name__ == "__main__":
    main()
