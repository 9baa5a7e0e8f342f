#!/usr/bin/env python3
"""Past the emulated cluster: each algorithm's speedup over AllReduce-SGD and its scaling efficiency, simulated.

    jobs/emulate/simscale.py --out results/simscale --plot docs/img/sim_scaling.png

For every link rate, heterogeneity model and number of workers, every
algorithm is simulated (``mpidl simulate``'s :func:`mpidl.simulate.simulate`,
one process) for one epoch of ``--steps`` steps per worker (default 10) on a GPU-like
cluster: a step computes ``--step-time`` (default 150 ms: ResNet-50 at a
batch of 64 on a V100-class GPU, about 430 images/s) and communication is
charged for ``--cost-params`` float32 parameters (default 25.6M,
ResNet-50's: 102.4 MB per model), ``--ranks-per-node`` GPUs per node
(default 4) on a fabric of ``--intra-rate`` (default 400gbit, NVLink-class),
the nodes' NICs at each ``--rates``. The numerics (real gradients and
averages) run on a small MLP (784-16-10 on Fashion-MNIST): the times are
the large model's, the accuracies would be the MLP's, so none are reported.

The heterogeneity models are ``mpidl train``'s: ``none``; ``straggler``, the
last worker 4x slow (``--slow N-1:4``); ``random``, each worker, in each
period of 10 of its steps, 4x slow with probability 0.1 (``--slowdown
p=0.1,F=4,P=10``). A cell's throughput is the steps of all workers per
virtual second over its epoch (which for the algorithms whose workers step at
their own speeds includes the settling at its end); ``speedup`` is it over
AllReduce-SGD's (hierarchical ring) in the same cell, ``efficiency`` over the
ideal n / C (every worker computing without pause at the base step time).

The runs' JSON go to ``--out`` (``RATE/CONDITION/ALGORITHM-N.json``; a run
whose JSON is there is not simulated again); the tables go to stdout and
``--out``/table.rst, the plot to ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # this folder's sweep: rst_table

from mpidl import data, plotting
from mpidl.simulate import SimConfig, parse_rate, simulate
from mpidl.simulate.cli import parse_count
from mpidl.slowdowns import RandomSlowdown
from mpidl.stepclock import parse_duration

#: The heterogeneity models, as ``mpidl train``'s options set them for n workers.
CONDITIONS = {
    "none": lambda n: {},
    "straggler": lambda n: {"slow": {n - 1: 4.0}},
    "random": lambda n: {"slowdown": RandomSlowdown(0.1, 4.0, 10)},
}
#: The algorithms, with the options they are simulated with.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "lsgd": {},
    "dpsgd": {},
    "grsgd": {},
    "adpsgd": {},
    "prague": {"policy": "smart"},
}


def run_cell(args: argparse.Namespace, dataset: data.Dataset, rate: str, condition: str, algo: str, n: int) -> dict:
    """The run of one cell, from ``--out`` if it is there."""
    path = args.out / rate / condition / f"{algo}-{n}.json"
    if path.exists():
        return json.loads(path.read_text())
    batch = 2  # the batch costs nothing here (the step time is charged): the smallest that shards evenly
    config = SimConfig(
        algo,
        dict(ALGORITHMS[algo]),
        workers=n,
        ranks_per_node=args.ranks_per_node,
        hidden=(16,),
        epochs=1,
        batch_size=batch,
        train_samples=n * batch * args.steps,
        test_samples=200,
        step_time=args.step_time,
        rate=parse_rate(rate),
        intra_rate=args.intra_rate,
        cost_params=args.cost_params,
        **CONDITIONS[condition](n),
    )
    started = time.perf_counter()
    run = simulate(config, dataset).json()
    print(
        f"{rate} {condition} {algo} n={n}: {run['epochs'][0]['epoch_s']:.2f} s virtual, "
        f"{time.perf_counter() - started:.1f} s wall",
        flush=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))
    return run


def throughput(run: dict) -> float:
    """Steps of all workers per virtual second over the run's epochs."""
    return sum(e["steps"] for e in run["epochs"]) / run["epochs"][-1]["time_s"]


def plot(path: str, results: dict, rates: list[str], conditions: list[str], algos: list[str], step_s: float) -> None:
    """Speedup over AllReduce-SGD (top) and scaling efficiency (bottom) against workers: a
    column per condition, a line style per rate."""
    plt = plotting.pyplot()
    fig, axes = plt.subplots(2, len(conditions), figsize=(4.6 * len(conditions), 8), sharex=True, squeeze=False)
    styles = {rate: style for rate, style in zip(rates, ("-", "--", ":"))}
    colors = dict(zip(ALGORITHMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for c, condition in enumerate(conditions):
        for rate in rates:
            for algo in algos:
                cells = results[rate][condition]
                ns = sorted(n for (a, n) in cells if a == algo)
                speed = [throughput(cells[algo, n]) / throughput(cells["allreduce", n]) for n in ns]
                eff = [100 * throughput(cells[algo, n]) * step_s / n for n in ns]
                label = f"{algo} {rate}"
                for row, y in ((0, speed), (1, eff)):
                    axes[row][c].plot(ns, y, styles[rate], marker=".", color=colors[algo], label=label)
        axes[0][c].set_title(condition)
        axes[1][c].set_xlabel("workers")
        for row in (0, 1):
            axes[row][c].set_xscale("log", base=2)
        axes[1][c].set_ylim(0, 105)
    axes[0][0].set_ylabel("speedup over AllReduce-SGD")
    axes[1][0].set_ylabel("scaling efficiency (%)")
    for ax in axes.flat[1:]:
        ax.grid(True, which="both", alpha=0.3)
    plotting.finish(fig, [axes[0][0]], path)  # the legend on the first panel only


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs' JSON and the table")
    p.add_argument("--workers", default="16,32,64,128,256,512,1024", help="(default 16 to 1024)")
    p.add_argument("--rates", default="10gbit,100gbit", help="the nodes' links (default 10gbit,100gbit)")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help="(default none,straggler,random)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="(default all simulated)")
    p.add_argument("--steps", type=int, default=10, help="steps per worker in a cell (default 10)")
    p.add_argument("--step-time", type=parse_duration, default="150ms", help="(default 150ms)")
    p.add_argument("--cost-params", type=parse_count, default="25.6M", help="(default 25.6M, ResNet-50's)")
    p.add_argument("--ranks-per-node", type=int, default=4, help="(default 4)")
    p.add_argument("--intra-rate", type=parse_rate, default="400gbit", help="(default 400gbit)")
    p.add_argument("--plot", help="write the figure here (needs matplotlib)")
    args = p.parse_args()
    if args.plot:
        plotting.require()
    rates, conditions = args.rates.split(","), args.conditions.split(",")
    algos = ["allreduce", *[a for a in args.algorithms.split(",") if a != "allreduce"]]
    sizes = [int(n) for n in args.workers.split(",")]
    from mpi4py import MPI

    dataset = data.load("fashion-mnist", None, MPI.COMM_SELF)
    results: dict[str, dict[str, dict[tuple[str, int], dict]]] = {}
    rows = []
    for rate in rates:
        for condition in conditions:
            cells = results.setdefault(rate, {}).setdefault(condition, {})
            for n in sizes:
                for algo in algos:
                    cells[algo, n] = run_cell(args, dataset, rate, condition, algo, n)
                base = throughput(cells["allreduce", n])
                row = [rate, condition, str(n)]
                for algo in algos:
                    mine = throughput(cells[algo, n])
                    row.append(f"{mine / base:.2f} ({100 * mine * args.step_time / n:.0f})")
                rows.append(row)
    table = sweep.rst_table(["rate", "condition", "workers", *algos], rows)
    print(table, end="")
    (args.out / "table.rst").write_text(table)
    if args.plot:
        plot(args.plot, results, rates, conditions, algos, args.step_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
