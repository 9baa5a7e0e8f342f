#!/usr/bin/env python3
"""What a caller's pause between native all-reduces costs each call: the machine's price of per-call work.

    mpiexec -n 2 python jobs/pause_cost.py [--size 4KiB] [--pauses 1,2,5,10] [--calls 200] [--repeat 11]
    python jobs/emulate/cluster.py run --nodes 2 -n 2 -- python jobs/pause_cost.py

Every collective written in Python does some work of its own on every call
(the entry point, the argument check, the kernel's bookkeeping) that native
``MPI_Allreduce`` called in a loop does not. This prices that work on the
machine at hand: native ``MPI_Allreduce(MPI_IN_PLACE)`` of ``--size``
float32 in barrier-aligned batches of ``--calls``, each call followed by a
busy pause of ``--pauses`` microseconds on every rank (the clock read in a
loop: CPU work, no system call), the pauses taking turns from batch to
batch, ``--repeat`` batches each, the slowest rank's time per batch, the
median. It prints what each pause added to a call. Where every rank has a
core of its own a pause of d adds about d; where ranks share cores (the
emulated cluster's 4 ranks on a 2-core machine), the ranks waiting in the
library take the cores the pausing rank needs, and a pause adds more than
itself (docs/performance.rst, "What per-call work costs on a shared core").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
from mpi4py import MPI

from collectives.tuning.sweep import rotated
from mpidl.bench import parse_size, time_batch


def pause(seconds: float) -> None:
    """Keep this core busy for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def call_and_pause(comm: MPI.Comm, x: np.ndarray, seconds: float) -> None:
    """One native in-place all-reduce of ``x``, then ``seconds`` of CPU work."""
    comm.Allreduce(MPI.IN_PLACE, x)
    if seconds:
        pause(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4KiB", help="bytes of the vector (default 4KiB)")
    parser.add_argument("--pauses", default="1,2,5,10", help="microseconds of CPU work after each call")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--repeat", type=int, default=11, help="batches per pause")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.zeros(parse_size(args.size) // 4, np.float32)
    pauses = [0.0] + [float(p) * 1e-6 for p in args.pauses.split(",")]
    samples: dict[float, list[float]] = {p: [] for p in pauses}
    for r in range(args.repeat):
        for p in rotated(pauses, r):
            samples[p].append(time_batch(comm, functools.partial(call_and_pause, comm, seconds=p), x, args.calls))
    if comm.Get_rank() == 0:
        base = statistics.median(samples[0.0])
        print(f"# {comm.Get_size()} ranks, native MPI_Allreduce of {args.size}: {base * 1e6:.1f} us a call")
        print(f"{'pause (us)':>10} {'added a call (us)':>18} {'added / pause':>14}")
        for p in pauses[1:]:
            added = statistics.median(samples[p]) - base
            print(f"{p * 1e6:10.1f} {added * 1e6:18.1f} {added / p:14.1f}")


if __name__ == "__main__":
    main()
