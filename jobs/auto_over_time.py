#!/usr/bin/env python3
"""auto over minutes of calls, against the algorithms it chooses between, on a machine that changes.

    mpiexec -n 2 python jobs/auto_over_time.py [--size 48MiB] [--minutes 6] [--calls 200] [--sample 8] [--ways shm,ring]

A program's all-reduces, one after another for ``--minutes``: in each round
``auto`` runs ``--calls`` back-to-back calls of a float32 sum of ``--size``
bytes, as a program gets it (online tuning and the watch on,
:mod:`collectives.tuning.watch`), then every other way runs ``--sample``
calls: each algorithm of ``--ways`` by name, and ``auto`` without the watch
(its first choice kept, as ``mpidl train`` runs it), each on a communicator
of its own. Each way's calls are timed from a barrier (the slowest rank's
time). One line per round; at the end, per way, the mean time a call took
over the rounds, and how often it was within 1.10x of its round's fastest
way. ``auto`` gets most of the calls, as the one all-reduce of a program;
the other ways' samples say what they would have taken at that moment.

Where one algorithm's speed comes and goes (docs/performance.rst, "A machine
that changes"), a choice made once is right in some rounds and wrong in
others; the watch's probes of its rivals follow the faster.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import collectives
from mpidl.bench import parse_size


def block(comm: MPI.Comm, call: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` calls from a barrier, the slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="48MiB", help="bytes of the vector (default 48MiB)")
    parser.add_argument("--minutes", type=float, default=6.0, help="how long to keep calling (default 6)")
    parser.add_argument("--calls", type=int, default=200, help="auto's calls per round (default 200)")
    parser.add_argument("--sample", type=int, default=8, help="calls of each other way per round (default 8)")
    parser.add_argument("--ways", default="shm,ring", help="algorithms called by name (default shm,ring)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    x = np.zeros(parse_size(args.size) // 4, np.float32)  # sums of zeros stay zeros however many calls run
    watched, fixed = world.Dup(), world.Dup()
    collectives.allreduce(x, watched)  # auto measures and chooses on its first call, as any program's
    previous = collectives.set_tuning(watch=False)
    collectives.allreduce(x, fixed)  # chooses without a watch: kept for the whole run
    collectives.set_tuning(watch=previous.watch)
    ways: dict[str, Callable[[], object]] = {"auto": functools.partial(collectives.allreduce, x, watched)}
    for name in args.ways.split(","):
        ways[name] = functools.partial(collectives.allreduce, x, world.Dup(), collective=name)
    ways["auto, no watch"] = functools.partial(collectives.allreduce, x, fixed)
    for way in ways.values():
        way()  # pages and scratch
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    end = time.monotonic() + 60 * args.minutes
    while world.bcast(time.monotonic() < end):
        for name, way in ways.items():
            rounds[name].append(block(world, way, args.calls if name == "auto" else args.sample))
        ran = collectives.explain(x.nbytes, watched).algorithm  # collective: it may measure after a drift
        kept = collectives.explain(x.nbytes, fixed).algorithm
        if world.rank == 0:
            line = "  ".join(f"{name} {times[-1] * 1e3:7.3f}" for name, times in rounds.items())
            print(time.strftime("%H:%M:%S"), line, f"(auto ran {ran}; without the watch {kept})", flush=True)
    if world.rank == 0:
        fastest = [min(times) for times in zip(*rounds.values())]
        print(f"{len(fastest)} rounds of {x.nbytes} B on {world.size} ranks, ms a call:")
        for name, times in rounds.items():
            within = sum(t <= 1.10 * f for t, f in zip(times, fastest))
            print(
                f"{name:15s} mean {statistics.mean(times) * 1e3:8.3f}  median {statistics.median(times) * 1e3:8.3f}"
                f"  over the round's fastest: mean {statistics.mean(t / f for t, f in zip(times, fastest)):5.2f},"
                f" within 1.10 in {within} of {len(fastest)} rounds"
            )
        print(f"{'fastest':15s} mean {statistics.mean(fastest) * 1e3:8.3f}  (each round's fastest way)")


if __name__ == "__main__":
    main()
