#!/usr/bin/env python3
"""How stable auto's calibration is at one size: the same measurement, repeated.

    mpiexec -n 4 python jobs/calibration_spread.py --size 4MiB --repeat 8 [--candidates shm,halving_doubling]

Runs :func:`collectives.tuning.sweep.point` (what ``auto``'s calibration runs at
a grid size: every candidate interleaved, medians, the slowest rank's time)
``--repeat`` times on ``MPI_COMM_WORLD`` and prints, per repetition, the
candidates fastest first with their milliseconds per call, then how often each
came first. Candidates that trade first place between repetitions are within
the calibration's noise at that size, and which of them a fresh process picks
is chance.
"""

from __future__ import annotations

import argparse
from collections import Counter

from mpi4py import MPI

from collectives.kernels.plans import PLANNERS, Request
from collectives.transport.context import context
from collectives.tuning import sweep
from mpidl.bench import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4MiB", help="bytes of the float32 vector (default 4MiB)")
    parser.add_argument("--repeat", type=int, default=8, help="calibrations of the size (default 8)")
    parser.add_argument("--candidates", help="comma-separated algorithms (default: every one that applies)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    ctx = context(comm)
    names = args.candidates.split(",") if args.candidates else list(PLANNERS)
    runs = {name: PLANNERS[name](Request(comm, ctx, None, None)) for name in names}
    first: Counter[str] = Counter()
    for _ in range(args.repeat):
        times = sorted(sweep.point(ctx, runs, parse_size(args.size)).items(), key=lambda kv: kv[1])
        first[times[0][0]] += 1
        if comm.Get_rank() == 0:
            print("  ".join(f"{name} {t * 1e3:.3f}" for name, t in times), flush=True)
    if comm.Get_rank() == 0:
        print("first: " + ", ".join(f"{name} {k}/{args.repeat}" for name, k in first.most_common()))


if __name__ == "__main__":
    main()
