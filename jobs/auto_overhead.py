#!/usr/bin/env python3
"""What online tuning costs: a 100-call run of ``auto`` with and without it.

    mpiexec -n 2 python jobs/auto_overhead.py --sizes 3M,24M --calls 100 --repeat 5 [--all-close] [--deterministic]

For each size and repetition, on new communicators (auto's cache off, so
every one starts untuned): the candidates are measured first (``explain``,
not timed), then ``--calls`` all-reduces with ``auto`` are timed (barrier
before, slowest rank) three ways, in turn: online tuning on; online tuning
off (the calibration's choice); and the algorithm tuning settled on, named
(no choice to make). It prints the medians, "tuned/untuned" (what tuning
gained or lost against the calibration's choice) and "tuned/settled" (what
the tuning calls cost against running their winner from the start: the
extra cost the issue bounds at 5 %). ``--all-close`` makes online tuning
tune the three fastest candidates wherever the calibration found them,
however far apart (the worst case for its cost). ``--deterministic`` tunes
as ``mpidl train`` and ``mpidl bench`` do: the candidates' batches (or,
where nothing is tuned, the watch's window) rehearsed on a copy before the
first call, which then runs the winner, so "tuned/settled" is what the rehearsal's extra calls cost a
run of ``--calls``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives
import mpidl
from collectives.tuning import online
from mpidl.bench import human, parse_size


def timed(comm: MPI.Comm, x: np.ndarray, calls: int, algorithm: str) -> float:
    """Seconds of ``calls`` all-reduces of ``x`` (barrier-aligned, the slowest rank's)."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        collectives.allreduce(x, comm, collective=algorithm)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def one(world: MPI.Comm, nbytes: int, calls: int, tune: bool) -> tuple[float, str]:
    """A 100-call run on a new communicator with online tuning ``tune``: seconds, and what auto ran."""
    collectives.set_tuning(online=tune)
    comm = world.Dup()
    try:
        x = np.ones(nbytes // 4, np.float32)
        collectives.explain(nbytes, comm)  # the calibration, not timed
        seconds = timed(comm, x, calls, "auto")
        return seconds, collectives.explain(nbytes, comm).algorithm
    finally:
        comm.Free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="3M,24M")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--all-close", action="store_true", help="tune the three fastest candidates everywhere")
    parser.add_argument("--deterministic", action="store_true", help="rehearse the tuning before the first call")
    args = parser.parse_args()
    world = mpidl.init()
    if args.all_close:
        online.CLOSE, online.SHORTEST = float("inf"), 0.0
    collectives.set_tuning(cache=False, deterministic=args.deterministic)
    if world.rank == 0:
        how = "tuning rehearsed" if args.deterministic else "tuning on real calls"
        print(f"# {world.size} ranks, {args.calls} calls a run, medians of {args.repeat}, CLOSE {online.CLOSE}, {how}")
        head = f"{'tuned s':>9} {'untuned s':>9} {'settled s':>9}  {'tuned/untuned':>13} {'tuned/settled':>13}"
        print(f"{'size':>9}  {head}  ran")
    for nbytes in map(parse_size, args.sizes.split(",")):
        runs: dict[str, list[float]] = {"tuned": [], "untuned": [], "settled": []}
        ran = set()
        for _ in range(args.repeat):
            seconds, winner = one(world, nbytes, args.calls, True)
            runs["tuned"].append(seconds)
            ran.add(winner)
            runs["untuned"].append(one(world, nbytes, args.calls, False)[0])
            comm = world.Dup()
            collectives.allreduce(np.ones(1, np.float32), comm, collective=winner)  # its plan, built untimed
            runs["settled"].append(timed(comm, np.ones(nbytes // 4, np.float32), args.calls, winner))
            comm.Free()
        t = {k: statistics.median(v) for k, v in runs.items()}
        if world.rank == 0:
            print(
                f"{human(nbytes):>9}  {t['tuned']:9.4f} {t['untuned']:9.4f} {t['settled']:9.4f}  "
                f"{t['tuned'] / t['untuned']:13.3f} {t['tuned'] / t['settled']:13.3f}  {', '.join(sorted(ran))}"
            )


if __name__ == "__main__":
    main()
