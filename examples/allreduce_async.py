"""How much of a nonblocking all-reduce computation hides: ``mpidl.allreduce_async``.

Each rank starts an all-reduce of ``--mib`` MiB of float32, computes for about
``--compute-ms`` milliseconds, then waits for the all-reduce; against the two
alone. The computation is a fixed amount of work, measured alone at the start:
``matmul`` (numpy matrix products on this thread, the CPU busy) or ``sleep``
(the CPU free, as while a GPU computes). Rank 0 prints the medians of
``--repeat`` rounds (each timed on the slowest rank) and the time hidden::

    mpiexec -n 2 python examples/allreduce_async.py --compute matmul
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

import mpidl


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time a nonblocking all-reduce with and without computation.")
    p.add_argument("--mib", type=float, default=16, help="the all-reduce's size in MiB (default 16)")
    p.add_argument("--compute-ms", type=float, default=10, help="the computation's time alone (default 10)")
    p.add_argument("--compute", choices=["matmul", "sleep"], default="matmul")
    p.add_argument("--collective", default="auto", help="the all-reduce algorithm (default auto)")
    p.add_argument("--repeat", type=int, default=21, help="rounds; medians are reported (default 21)")
    return p.parse_args()


def computation(kind: str, ms: float) -> Callable[[], None]:
    """A fixed amount of work that takes about ``ms`` milliseconds alone."""
    if kind == "sleep":
        return lambda: time.sleep(ms / 1e3)
    a = np.random.default_rng(0).standard_normal((128, 128))
    each = []  # seconds per product, in batches of 10; the least is the least disturbed
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        each.append((time.perf_counter() - t0) / 10)
    products = max(1, round(ms / 1e3 / min(each)))

    def matmul() -> None:
        for _ in range(products):
            a @ a

    return matmul


def main() -> None:
    args = arguments()
    comm = mpidl.init()
    x = np.ones(int(args.mib * 2**20) // 4, np.float32)
    compute = computation(args.compute, args.compute_ms)

    def allreduce() -> None:
        mpidl.allreduce_async(x, collective=args.collective).wait()

    def both() -> None:
        handle = mpidl.allreduce_async(x, collective=args.collective)
        compute()
        handle.wait()

    def seconds(fn: Callable[[], None]) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=max)

    allreduce()  # the service thread, the plans, auto's calibration
    times: dict[str, list[float]] = {"allreduce": [], "compute": [], "both": []}
    for _ in range(args.repeat):
        for name, fn in (("allreduce", allreduce), ("compute", compute), ("both", both)):
            times[name].append(seconds(fn))
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    hidden = ms["allreduce"] + ms["compute"] - ms["both"]
    if comm.rank == 0:
        print(
            f"{comm.size} ranks, {args.mib:g} MiB ({args.collective}), {args.compute}: "
            f"all-reduce {ms['allreduce']:.1f} ms, computation {ms['compute']:.1f} ms, both {ms['both']:.1f} ms: "
            f"{hidden:.1f} ms hidden, "
            f"{hidden / ms['allreduce']:.0%} of the all-reduce, {hidden / min(ms['allreduce'], ms['compute']):.0%} "
            "of what could be"
        )


if __name__ == "__main__":
    main()
