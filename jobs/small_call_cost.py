#!/usr/bin/env python3
"""Where a small all-reduce's time goes, layer by layer, against native MPI.

    mpiexec -n 2 python jobs/small_call_cost.py [--size 4KiB] [--calls 3000] [--repeat 7]
    mpiexec -launcher fork -hosts a:1,b:1 -n 2 python jobs/small_call_cost.py --collective mpi

Float32 sums of ``--size`` bytes, with the argument check on, timed per call
(barrier-aligned batches of ``--calls``, median and least of ``--repeat``
batches, rank 0's clock), interleaved. Where every way goes through
``native``: ``MPI_Allreduce(MPI_IN_PLACE)`` through mpi4py (no check), and

* ``api``: ``collectives.allreduce(x, comm, "sum", COLLECTIVE)``;
* ``persistent``: ``collectives.allreduce_init(x, comm, "sum", COLLECTIVE)``'s
  handle called (its arguments resolved once, the check still on every call);
* ``call``: the call the entry point resolved and kept, called directly
  (what the entry point's look-ups cost is ``api`` less this).

``--collective shm`` (the default), on the ranks of one node (sharing memory; 2
or more):

* ``carried``: the call's :class:`collectives.kernels.shm.Carried` (what the call runs:
  the check's header posted, then the reduction, resolved once);
* ``kernel``: the check's header posted, then :func:`collectives.kernels.shm.allreduce`;
* ``floor``: the same work written out in one loop: post the header, copy
  into the segment, one barrier, compare the headers, add the peers' slots
  (what the layers above add is ``kernel`` less this);
* ``barrier``: the segment's barrier alone.

``--collective mpi``, on ranks that span nodes, where the check rides in the
library's call (:class:`collectives.validation.Expected`):

* ``unchecked``: ``api`` with ``validate=False``;
* ``plan``: the "mpi" plan the call runs, without the check;
* ``kernel``: :func:`collectives.kernels.native.allreduce` (the library's call,
  then the NaN scan);
* ``library``: :func:`collectives.kernels.native.library` (the library's call
  on the plan's communicator, the stall inspector told).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives.kernels import native, shm
from collectives.transport.context import Context, context
from mpidl.bench import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4KiB", help="bytes of the vector (default 4KiB)")
    parser.add_argument("--collective", choices=("shm", "mpi"), default="shm", help="the algorithm (default shm)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per timed batch")
    parser.add_argument("--repeat", type=int, default=7, help="batches per way")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.zeros(parse_size(args.size) // 4, np.float32)
    for _ in range(4):  # the plan built, and (across nodes) the call expected
        collectives.allreduce(x, comm, "sum", args.collective)
    ctx = context(comm)
    call = next(c for c in ctx.calls.values() if c.run is not None)
    ways: dict[str, Callable[[], object]] = {
        "native": lambda: comm.Allreduce(MPI.IN_PLACE, x),
        "api": lambda: collectives.allreduce(x, comm, "sum", args.collective),
        "persistent": collectives.allreduce_init(x, comm, "sum", args.collective),
        "call": lambda: call(x),
    }
    ways.update(shm_ways(ctx, call, x) if args.collective == "shm" else library_ways(comm, ctx, call, x))
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
        print(f"{x.nbytes} B float32 sum, {comm.Get_size()} ranks, {args.calls} calls x {args.repeat}; us per call")
        base = statistics.median(times["native"])
        for name, t in times.items():
            print(
                f"{name:8s} median {statistics.median(t) * 1e6:6.2f}  least {min(t) * 1e6:6.2f}  "
                f"median / native {statistics.median(t) / base:5.2f}"
            )


def shm_ways(ctx: Context, call: Any, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """The shared-memory algorithm's layers on one node (module docstring)."""
    seg = shm.shared(ctx)
    if seg is None or call.carrier is None:
        raise SystemExit("small_call_cost.py: run --collective shm on 2 or more ranks of one node")
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

    return {"carried": lambda: call.carrier(x), "kernel": kernel, "floor": floor, "barrier": seg.barrier}


def library_ways(comm: MPI.Comm, ctx: Context, call: Any, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """The MPI library's all-reduce's layers across nodes (module docstring)."""
    if shm.shared(ctx) is not None or not call.native:
        raise SystemExit("small_call_cost.py: run --collective mpi on ranks that span nodes, up to 64 KiB")
    plan, red = call.run, call.red
    return {
        "unchecked": lambda: collectives.allreduce(x, comm, "sum", "mpi", validate=False),
        "plan": lambda: plan(x, red),
        "kernel": lambda: native.allreduce(x, plan.comm, red, plan.others),
        "library": lambda: native.library(x, plan.comm, red, plan.others),
    }


if __name__ == "__main__":
    main()
