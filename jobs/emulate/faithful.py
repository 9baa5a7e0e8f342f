#!/usr/bin/env python3
"""Is paced compute faithful? AllReduce-SGD's paced step against C + T, in one MPI job.

    mpiexec -n 16 python jobs/emulate/faithful.py --step-time 150ms --hidden 1024,1024
    jobs/emulate/cluster.py run -n 2 -- python jobs/emulate/faithful.py --step-time 150ms --hidden 1024,1024

With paced compute (``mpidl train --step-time C``, :mod:`mpidl.stepclock`)
a step of AllReduce-SGD without overlap computes for C and then all-reduces
the gradient, so it should take C + T, T being the all-reduce alone of the
model's gradient on the same cluster. This job measures both on the same
ranks:

1. T: the model of the run is built, and its gradient's buckets are
   all-reduced (average) with the algorithm AllReduce-SGD chose for each,
   ``--repeat`` times after a warm-up, each time after a barrier; T is the
   median of the slowest rank's times. Once with MPI's blocking waits (as
   ``mpidl bench`` times it), once with polled waits (as paced workers
   wait; :func:`collectives.transport.p2p.poll_waits`). Where ranks share
   cores the two differ: a blocking wait spins, and takes the CPU from the
   ranks that move data and from the kernel's TCP work (on 4 emulated nodes
   x 2 ranks of a loaded 2-core machine, 4.3 MiB: 165-214 ms blocking,
   97-106 ms polled); the check compares the step with T measured waiting
   as the steps wait, and prints the other too.
2. S: ``mpidl train --algorithm allreduce --no-overlap`` with the options
   given (every ``mpidl train`` option applies: ``--step-time``, ``--slow``,
   ``--slowdown``, ``--no-polled-waits``, ``--collective``, the model, ...);
   S is the median over the workers of their mean step time
   (:mod:`mpidl.stragglers`: from the start of the gradient to the end of
   ``step()``).
3. T again, both ways, after the run (the machine's load may have changed).

Rank 0 prints the numbers, S / (C + T) for the median T (the check holds
when it is within 15 % of 1), the workers' CPU use during the run and the
share of the machine's cores that were busy, and with ``--json FILE`` also
writes them there, beside ``mpidl train``'s own JSON (``FILE.train.json``).
Under a fixed slowdown the step waits for the slowest worker:
compare S with the slowest worker's own time per step (its step less its
communication: f C when paced) + T instead (printed too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import algorithms
import collectives
from collectives.transport import p2p
from mpidl import data, models, train
from mpidl.runtime import init


def allreduce_times(comm: MPI.Comm, config: train.TrainConfig, repeat: int, polled: bool) -> list[float]:
    """The slowest rank's seconds for the buckets of the run's model, each of ``repeat``
    times (collective)."""
    dataset = data.load(config.dataset, config.data_dir, comm).subset(config.train_samples, config.test_samples)
    net = models.make(config.model, dataset.shape, dataset.classes, hidden=config.hidden, backend=config.backend)
    net.make_optimizer(config.lr, config.momentum)
    with algorithms.AllReduceSGD(net.model, net.optimizer, comm, **config.options) as algo:
        grad = np.zeros(algo.flat.size, np.float32)
        buckets = [(grad[b.start : b.stop], alg) for b, alg in zip(algo.buckets, algo.bucket_collectives)]
        layout = algo.layout
    blocking = p2p.poll_waits(polled)
    try:
        times = []
        for i in range(repeat + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for piece, alg in buckets:
                collectives.allreduce(piece, comm, "avg", alg, validate=False, layout=layout)
            if i:  # the first is the warm-up
                times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    finally:
        p2p.poll_waits(blocking)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    train.add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=10, help="timed all-reduces of T, each way (default 10)")
    parser.set_defaults(algorithm="allreduce", no_progress=True, epochs=2)
    args = parser.parse_args()
    if args.algorithm != "allreduce" or args.overlap:
        parser.error("the check is of AllReduce-SGD without overlap: leave --algorithm and --overlap out")
    args.overlap = False
    comm = init()
    config = train.config_from_args(args)
    rank0 = comm.Get_rank() == 0
    ways = ("blocking", "polled")
    times = {way: allreduce_times(comm, config, args.repeat, polled=way == "polled") for way in ways}
    result = train.train(config, comm)
    for way in ways:
        times[way] += allreduce_times(comm, config, args.repeat, polled=way == "polled")
    if not rank0:
        return 0
    workers = result.workers
    step = workers["mean_s"]["step"]
    s_median = statistics.median(step)
    t_block, t_polled = statistics.median(times["blocking"]), statistics.median(times["polled"])
    t_same = t_polled if result.meta["polled_waits"] else t_block  # waiting as the run's steps wait
    own = workers["mean_s"]["own"]  # each worker's step less its communication: f C when paced
    c = config.step_time or statistics.median(own)
    slowest = max(own)
    cpu = workers["cpu"]
    out = {
        "workers": comm.Get_size(),
        "model_bytes": result.meta["model_bytes"],
        "step_time_s": config.step_time,
        "polled_waits": result.meta["polled_waits"],
        "allreduce_s": times,
        "T_blocking_s": t_block,
        "T_polled_s": t_polled,
        "S_s": s_median,
        "S_max_s": max(step),
        "ratio": s_median / (c + t_same),
        "ratio_blocking_T": s_median / (c + t_block),
        "ratio_slowest": s_median / (slowest + t_same),
        "cpu": cpu,
    }
    print(
        f"faithful: {comm.Get_size()} workers, model {result.meta['model_bytes'] / 2**20:.2f} MiB, "
        f"C = {1e3 * c:.1f} ms{'' if config.step_time else ' (unpaced: the median own time per step)'}\n"
        + "".join(
            f"all-reduce alone, {way} waits: {1e3 * statistics.median(t):.1f} ms (median of {len(t)}: "
            f"{1e3 * statistics.median(t[: args.repeat]):.1f} before, "
            f"{1e3 * statistics.median(t[args.repeat :]):.1f} after the run)\n"
            for way, t in times.items()
        )
        + f"AllReduce-SGD step S = {1e3 * s_median:.1f} ms "
        f"(median over workers of their mean; max {1e3 * max(step):.1f})\n"
        f"S / (C + T) = {out['ratio']:.3f} with T = {1e3 * t_same:.1f} ms, the all-reduce waiting as the steps "
        f"did ({out['ratio_blocking_T']:.3f} with T blocking); with the slowest worker's own time per step "
        f"{1e3 * slowest:.1f} ms: S / (C_slowest + T) = {out['ratio_slowest']:.3f}\n"
        f"cpu: the workers used {cpu['workers_cores']:.2f} cores on average over {cpu['wall_s']:.1f} s; "
        f"the machine's {cpu['machine_cores']} cores were "
        + ("?" if cpu["machine_busy"] is None else f"{100 * cpu['machine_busy']:.0f} %")
        + f" busy; waits {'polled' if result.meta['polled_waits'] else 'blocking (MPI)'}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        train.write_json(result, args.json.removesuffix(".json") + ".train.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
