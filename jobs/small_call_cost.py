#!/usr/bin/env python3
"""Where a small shared-memory all-reduce's time goes, layer by layer, against native MPI.

    mpiexec -n 2 python jobs/small_call_cost.py [--size 4KiB] [--calls 3000] [--repeat 7]

On the ranks of one node (sharing memory; 2 or more), float32 sums of ``--size`` bytes, with
the argument check on, timed per call (barrier-aligned batches of
``--calls``, median and least of ``--repeat`` batches, rank 0's clock),
interleaved:

* ``native``: ``MPI_Allreduce(MPI_IN_PLACE)`` through mpi4py (no check);
* ``api``: ``collectives.allreduce(x, comm, "sum", "shm")``;
* ``persistent``: ``collectives.allreduce_init(x, comm, "sum", "shm")``'s
  handle called (its arguments resolved once, the check still on every call);
* ``call``: the call the entry point resolved and kept, called directly
  (what the entry point's look-ups cost is ``api`` less this);
* ``carried``: the call's :class:`collectives.kernels.shm.Carried` (what the call runs:
  the check's header posted, then the reduction, resolved once);
* ``kernel``: the check's header posted, then :func:`collectives.kernels.shm.allreduce`;
* ``floor``: the same work written out in one loop: post the header, copy
  into the segment, one barrier, compare the headers, add the peers' slots
  (what the layers above add is ``kernel`` less this);
* ``barrier``: the segment's barrier alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives.kernels import shm
from collectives.transport.context import context
from mpidl.bench import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4KiB", help="bytes of the vector (default 4KiB)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per timed batch")
    parser.add_argument("--repeat", type=int, default=7, help="batches per way")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.zeros(parse_size(args.size) // 4, np.float32)
    collectives.allreduce(x, comm, "sum", "shm")
    ctx = context(comm)
    seg = shm.shared(ctx)
    if seg is None:
        raise SystemExit("small_call_cost.py: run it on 2 or more ranks of one node")
    call = next(c for c in ctx.calls.values() if c.carrier is not None)
    header, agreed, red = call.header, call.agreed, call.red
    peers = [r for r in range(seg.size) if r != seg.rank]

    def floor() -> None:
        seg.post(header)
        v = seg.views(x.shape[0], x.dtype)
        v.mine[:] = x
        seg.barrier()
        if seg.headers() != agreed:
            raise RuntimeError("the headers disagree")
        for peer in peers:
            np.add(x, v.inputs[peer], out=x)

    def kernel() -> None:
        seg.post(header)
        shm.allreduce(x, seg, red, call.verify)

    ways: dict[str, Callable[[], object]] = {
        "native": lambda: comm.Allreduce(MPI.IN_PLACE, x),
        "api": lambda: collectives.allreduce(x, comm, "sum", "shm"),
        "persistent": collectives.allreduce_init(x, comm, "sum", "shm"),
        "call": lambda: call(x),
        "carried": lambda: call.carrier(x),
        "kernel": kernel,
        "floor": floor,
        "barrier": seg.barrier,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.repeat + 1):  # the first round warms up
        for name, way in ways.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                way()
            if rep:
                times[name].append((time.perf_counter() - start) / args.calls)
    if comm.Get_rank() == 0:
        print(f"{x.nbytes} B float32 sum, {seg.size} ranks, {args.calls} calls x {args.repeat}; us per call")
        base = statistics.median(times["native"])
        for name, t in times.items():
            print(
                f"{name:8s} median {statistics.median(t) * 1e6:6.2f}  least {min(t) * 1e6:6.2f}  "
                f"median / native {statistics.median(t) / base:5.2f}"
            )


if __name__ == "__main__":
    main()
