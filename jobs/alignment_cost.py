#!/usr/bin/env python3
"""What the caller's buffer alignment does to each algorithm's time.

    mpiexec -n 2 python jobs/alignment_cost.py [--sizes 256KiB,1MiB] [--collectives shm,ring,halving_doubling]

numpy allocates small arrays 16-byte aligned and large ones on fresh pages,
unless the process's heap already holds freed memory of that size; torch
aligns its storage to 64 bytes. The same all-reduce can then meet its
operands at different offsets from one process to the next (and ``auto``'s
calibration buffers at other offsets than the program's). For each size
and collective, float32 sums on a view of a page-aligned array starting
0, 16 and 64 bytes in, in barrier-aligned batches of ``--calls`` (the
slowest rank's time per call), the median of ``--repeat`` batches, with
the argument check on.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
from mpi4py import MPI

import collectives
from mpidl.bench import parse_size, time_batch

OFFSETS = (0, 16, 64)


def at_offset(nbytes: int, offset: int) -> np.ndarray:
    """``nbytes`` of float32 zeros starting ``offset`` bytes past a page boundary."""
    base = np.zeros(nbytes // 4 + 2048, np.float32)
    start = (-base.ctypes.data % 4096 + offset) // 4
    return base[start : start + nbytes // 4]


def seconds(x: np.ndarray, collective: str, calls: int, repeat: int, comm: MPI.Comm) -> float:
    """Median over ``repeat`` batches of ``calls`` of the slowest rank's seconds a call."""
    fn = functools.partial(collectives.allreduce, comm=comm, collective=collective)
    fn(x)
    return statistics.median(time_batch(comm, fn, x, calls) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256KiB,1MiB", help="bytes per vector, comma-separated")
    parser.add_argument("--collectives", default="shm,ring,halving_doubling", help="comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    parser.add_argument("--repeat", type=int, default=9, help="batches per case")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    names = args.collectives.split(",")
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} ranks, us a call at buffer offsets of {', '.join(map(str, OFFSETS))} bytes")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for name in names:
            times = [seconds(at_offset(size, off), name, args.calls, args.repeat, comm) for off in OFFSETS]
            if comm.Get_rank() == 0:
                print(f"{size >> 10:>8} KiB  {name:<18} " + "  ".join(f"{t * 1e6:9.1f}" for t in times))


if __name__ == "__main__":
    main()
