#!/usr/bin/env python3
"""Heterogeneous clusters at 4-32 workers: algorithms x cluster sizes x heterogeneity, one table.

    jobs/emulate/cluster.py up --nodes 16 --rate 1gbit
    jobs/emulate/scale.py --out results/scale                          # the whole matrix (hours)
    jobs/emulate/scale.py --out results/s16 --clusters 8x2 --repeat 3  # 16 workers, medians of 3
    jobs/emulate/scale.py --out results/smoke --smoke                  # 8 workers, one slow, one short epoch (numpy)

Every worker's step is paced (``mpidl train --step-time``, :mod:`mpidl.stepclock`):
it computes its real gradient on its real batch, then waits out the rest of
a set step time (150 ms by default, as a GPU-bound step of a large model)
times its slowdown, so that 16-32 workers fit on a small machine and a slow
worker is slow the way a slow GPU is. The model is an MLP on
Fashion-MNIST (60,000 samples: at 32 workers an epoch still has 58 steps
per worker).

The matrix (each cell one ``mpidl train`` across the emulated nodes, with
``cluster.py run --nodes N -n R``):

* clusters: ``4x1``, ``8x1``, ``8x2``, ``16x2`` (nodes x ranks per node; the
  cluster must be up with at least as many nodes, links at ``--rate``);
* conditions (:data:`CONDITIONS`), identical for every algorithm: ``none``;
  ``straggler`` (the last worker 4x slow, ``--slow``); ``random`` (each
  worker, in each period of 10 of its steps, 4x slow with probability 0.1,
  ``--slowdown``, seeded); ``slowlink`` (the last node's link 10x slower
  than the others', ``cluster.py shape --node``);
* algorithms (:data:`ALGORITHMS`): AllReduce-SGD (``auto``), D-PSGD, AD-PSGD
  (random and aware partners), Prague (random, smart and aware groups),
  GR-SGD, LSGD, DDP, and Horovod where it is installed.

The table (``table.rst``, ``table.csv``; medians over ``--repeat`` runs):
time to the target accuracy (the averaged model's, evaluated after every
epoch) and that time over AllReduce-SGD's in the same cell (``speedup``);
how many times sooner than AllReduce-SGD the run first reached
AllReduce-SGD's final accuracy (``to AR final``); steps per second of all
workers together; the bytes the links carried per step; the share of the
workers' time spent waiting in communication; the consensus distance at
the end; and the slowest worker's mean step over the median worker's. The
plot (``--plot``, ``plots/speedup.png``): how many times sooner than
AllReduce-SGD each algorithm reached AllReduce-SGD's final accuracy, against
workers, a panel per condition.

Runs whose JSON exists are not run again; ``--report-only`` makes the table
from what is there. Each run is ended, on every node, after ``--timeout``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import re
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # this folder's sweep: the cluster runs, link counters, tables


@dataclass(frozen=True)
class Shape:
    """A cluster of the matrix: ``nodes`` nodes of ``ranks`` ranks each."""

    nodes: int
    ranks: int

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.ranks}"

    @property
    def workers(self) -> int:
        return self.nodes * self.ranks

    @classmethod
    def parse(cls, text: str) -> Shape:
        nodes, _, ranks = text.partition("x")
        if not (nodes.isdigit() and ranks.isdigit() and int(nodes) >= 2 and int(ranks) >= 1):
            raise argparse.ArgumentTypeError(f"cluster {text!r}: NODESxRANKS, e.g. 8x2")
        return cls(int(nodes), int(ranks))


CLUSTERS = ("4x1", "8x1", "8x2", "16x2")
CONDITIONS = ("none", "straggler", "random", "slowlink")
#: The slow worker's and the slow link's factor, and the random slowdowns.
SLOW_FACTOR, RANDOM = 4, "p=0.1,F=4,P=10"
#: The slow link: ``--rate`` divided by this.
SLOW_LINK = 10

#: name -> mpidl train options.
ALGORITHMS = {
    "allreduce": ("--algorithm", "allreduce"),
    "dpsgd": ("--algorithm", "dpsgd"),
    "adpsgd": ("--algorithm", "adpsgd"),
    "adpsgd:aware": ("--algorithm", "adpsgd", "--partner", "aware"),
    "prague:random": ("--algorithm", "prague", "--policy", "random"),
    "prague:smart": ("--algorithm", "prague", "--policy", "smart"),
    "prague:aware": ("--algorithm", "prague", "--policy", "aware"),
    "grsgd": ("--algorithm", "grsgd"),
    "lsgd": ("--algorithm", "lsgd"),
    "ddp": ("--algorithm", "ddp"),
    "horovod": ("--algorithm", "horovod"),
}
BASELINE = "allreduce"
#: The algorithms whose workers step at their own speeds: an epoch of theirs is n x steps
#: of all workers together, so a slow worker's shard is seen less; they run
#: ``Setup.async_epochs`` so that they can reach the baseline's final accuracy.
UNEVEN = ("adpsgd", "adpsgd:aware", "prague:random", "prague:smart", "prague:aware")


@dataclass(frozen=True)
class Setup:
    """What every run shares: the model, the pace, the links."""

    hidden: str = "512,512"
    epochs: int = 6
    step_time: str = "150ms"
    target: float = 0.85
    rate: str = "1gbit"
    batch_size: int = 32
    lr: float = 0.05
    async_epochs: int | None = None  # None: 2 x epochs
    train_samples: int | None = None  # None: the whole training set
    backend: str | None = None  # None: mpidl train's default (torch where installed)

    def train_args(self, algo: str = BASELINE) -> list[str]:
        """``mpidl train``'s options for ``algo`` (the epochs: :data:`UNEVEN`)."""
        epochs = self.epochs
        if algo in UNEVEN:
            epochs = self.async_epochs if self.async_epochs is not None else 2 * self.epochs
        return [
            "--dataset",
            "fashion-mnist",
            "--model",
            "mlp",
            "--hidden",
            self.hidden,
            "--epochs",
            str(epochs),
            "--batch-size",
            str(self.batch_size),
            "--lr",
            str(self.lr),
            "--step-time",
            self.step_time,
            *(["--train-samples", str(self.train_samples)] if self.train_samples else []),
            *(["--backend", self.backend] if self.backend else []),
        ]


def condition_args(condition: str, shape: Shape) -> list[str]:
    """The ``mpidl train`` options of a condition (the slow link is the cluster's, not the run's)."""
    if condition == "straggler":
        return ["--slow", f"{shape.workers - 1}:{SLOW_FACTOR}"]
    if condition == "random":
        return ["--slowdown", RANDOM]
    return []


def shape_links(setup: Setup, shape: Shape, condition: str) -> None:
    """Shape every link at the rate; under ``slowlink`` the last node's 10x slower."""
    nodes = []
    if condition == "slowlink":
        number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", setup.rate).groups()  # type: ignore[union-attr]
        nodes = ["--node", f"node{shape.nodes}={float(number) / SLOW_LINK:g}{unit}"]
    sweep.cluster("shape", "--rate", setup.rate, *nodes)


def run_path(out: Path, shape: Shape, condition: str, algo: str, k: int) -> Path:
    """Where a cell's ``k``-th run keeps its JSON."""
    return out / shape.name / condition / (f"{algo}.json" if k == 0 else f"{algo}.r{k}.json")


def run(out: Path, setup: Setup, shape: Shape, condition: str, algo: str, k: int, timeout: float) -> Path:
    """One cell's ``k``-th run; its JSON (nothing to do if it exists)."""
    path = run_path(out, shape, condition, algo, k)
    argv = ["python", "-m", "mpidl", "train", *ALGORITHMS[algo], *setup.train_args(algo)]
    argv += condition_args(condition, shape)
    argv += ["--seed", str(k)]
    cluster_args = ["--nodes", str(shape.nodes), "-n", str(shape.ranks)]
    label = f"{shape.name:>5} {condition:<9} {algo:<14}"
    sweep.train_on_cluster(path, argv, cluster_args, label, timeout, {"cluster": shape.name, "condition": condition})
    return path


def summarize(run: dict[str, Any], target: float) -> dict[str, Any]:
    """A run's numbers for the table."""
    epochs, last = run["epochs"], run["epochs"][-1]
    steps = sum(e["steps"] for e in epochs)
    workers = last["workers"]
    peer = run["meta"]["algorithm"] in sweep.PEERS
    own = run.get("workers", {}).get("mean_s", {}).get("own", [])  # each worker's step, waits excluded
    return {
        "to_target_s": sweep.time_to(epochs, target),
        "final_acc": last["test_acc"],
        "steps_per_s": steps / max(last["time_s"], 1e-9),
        "link_per_step": run["sweep"]["link_bytes"] / max(steps, 1),
        "wait": None if peer else sum(workers["comm_wait_s"]) / max(sum(workers["time_s"]), 1e-9),
        "consensus": last["consensus"],
        "slowest": max(own) / statistics.median(own) if own and statistics.median(own) > 0 else None,
    }


COLUMNS = (
    "cluster",
    "condition",
    "algorithm",
    "to target s",
    "speedup",
    "to AR final",
    "final acc %",
    "steps/s",
    "link KiB/step",
    "wait %",
    "consensus",
    "slowest/median",
)


Key = tuple[str, str, str]  # (cluster, condition, algorithm)


def rows(results: dict[Key, dict[str, Any]], runs: dict[Key, list]) -> list[list[str]]:
    """The table's formatted rows."""
    out = []
    for (cluster, condition, algo), r in results.items():
        base = results.get((cluster, condition, BASELINE), {}).get("to_target_s")
        speedup = base / r["to_target_s"] if base and r["to_target_s"] else None
        out.append(
            [
                cluster,
                condition,
                algo,
                sweep._fmt(r["to_target_s"], ".1f"),
                sweep._fmt(speedup, ".2f"),
                sweep._fmt(sweep.to_baseline_final(runs, (cluster, condition, algo)), ".2f"),
                sweep._fmt(r["final_acc"], ".2f", 100),
                sweep._fmt(r["steps_per_s"], ".1f"),
                sweep._fmt(r["link_per_step"], ".0f", 1 / 1024),
                sweep._fmt(r["wait"], ".0f", 100),
                sweep._fmt(r["consensus"], ".1e"),
                sweep._fmt(r["slowest"], ".2f"),
            ]
        )
    return out


def plot(out: Path, runs: dict[Key, list], conditions: Sequence[str]) -> Path:
    """How many times sooner than AllReduce-SGD each algorithm reached AllReduce-SGD's final
    accuracy, against workers, a panel per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(ALGORITHMS, plt.get_cmap("tab20").colors))
    fig, axes = plt.subplots(1, len(conditions), figsize=(4 * len(conditions) + 2, 3.8), sharey=True, squeeze=False)
    for ax, condition in zip(axes[0], conditions):
        for algo in ALGORITHMS:
            points = []
            for cluster, cond, name in runs:
                sooner = sweep.to_baseline_final(runs, (cluster, cond, name))
                if cond == condition and name == algo and sooner:
                    points.append((Shape.parse(cluster).workers, sooner))
            if points:
                xs, ys = zip(*sorted(points))
                style = "-" if algo.startswith("allreduce") else "--"
                ax.plot(xs, ys, marker="o", label=algo, linestyle=style, color=colors[algo])
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.set_title(condition)
        ax.set_xlabel("workers")
        ax.set_xscale("log", base=2)
    axes[0][0].set_ylabel("AllReduce-SGD's final accuracy: x sooner")
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 2 / fig.get_figwidth(), 1))
    path = out / "plots" / "speedup.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs' JSON and the table")
    p.add_argument("--clusters", default=",".join(CLUSTERS), help=f"NODESxRANKS list (default {','.join(CLUSTERS)})")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"(default {','.join(CONDITIONS)})")
    p.add_argument("--algorithms", default="all", help="comma-separated names of ALGORITHMS, or all")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell, seeds 0..K-1; medians (default 1)")
    p.add_argument("--epochs", type=int, default=Setup.epochs, help=f"(default {Setup.epochs})")
    p.add_argument("--async-epochs", type=int, help="epochs of the algorithms of uneven steps (default 2 x --epochs)")
    p.add_argument("--step-time", default=Setup.step_time, help=f"paced step (default {Setup.step_time})")
    p.add_argument("--hidden", default=Setup.hidden, help=f"the MLP's hidden layers (default {Setup.hidden})")
    p.add_argument("--target", type=float, default=Setup.target, help=f"accuracy (default {Setup.target})")
    p.add_argument("--rate", default=Setup.rate, help=f"link rate (default {Setup.rate})")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    p.add_argument(
        "--smoke", action="store_true", help="CI: 8x1, straggler, allreduce and adpsgd, one short epoch, numpy"
    )
    p.add_argument("--plot", action="store_true", help="draw plots/speedup.png")
    p.add_argument("--report-only", action="store_true", help="make the table from the runs there; run nothing")
    args = p.parse_args(argv)
    setup = Setup(args.hidden, args.epochs, args.step_time, args.target, args.rate, async_epochs=args.async_epochs)
    shapes = [Shape.parse(c) for c in args.clusters.split(",")]
    conditions = args.conditions.split(",")
    algos = list(ALGORITHMS) if args.algorithms == "all" else args.algorithms.split(",")
    if args.algorithms == "all" and importlib.util.find_spec("horovod") is None:
        algos.remove("horovod")
        print("scale: the horovod rows left out: Horovod is not installed (jobs/peers/horovod.sh)", flush=True)
    if args.smoke:
        shapes, conditions, algos = [Shape(8, 1)], ["straggler"], ["allreduce", "adpsgd"]
        # numpy: the pace, not the backend, is what the smoke test checks (8 imports of torch
        # on a small machine cost more than the training)
        setup = Setup(setup.hidden, 1, "60ms", 0.0, setup.rate, async_epochs=1, train_samples=10000, backend="numpy")
    unknown = [a for a in algos if a not in ALGORITHMS] + [c for c in conditions if c not in CONDITIONS]
    if unknown:
        p.error(f"unknown algorithm(s) or condition(s): {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    started = time.monotonic()
    try:
        for condition in conditions:
            for shape in shapes:
                if not args.report_only:
                    shape_links(setup, shape, condition)
                for algo in algos:
                    ks = range(args.repeat)
                    if args.report_only:
                        paths = [run_path(args.out, shape, condition, algo, k) for k in ks]
                    else:
                        paths = [run(args.out, setup, shape, condition, algo, k, args.timeout) for k in ks]
                    loaded = [json.loads(q.read_text()) for q in paths if q.exists()]
                    if loaded:
                        key = (shape.name, condition, algo)
                        runs[key] = loaded
                        results[key] = sweep.median_of([summarize(r, setup.target) for r in loaded])
    finally:
        if not args.report_only:
            sweep.cluster("shape", "--rate", setup.rate, "--no-check")  # the links as they were; the next shape checks
    text = sweep.rst_table(COLUMNS, rows(results, runs))
    (args.out / "table.rst").write_text(text)
    with open(args.out / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([COLUMNS, *rows(results, runs)])
    print(
        f"# {setup}; medians of {args.repeat} run(s); {time.monotonic() - started:.0f} s; "
        f"command: {shlex.join(['jobs/emulate/scale.py', *(argv or sys.argv[1:])])}"
    )
    print(text, end="")
    if args.plot and results:
        print(f"plot: {plot(args.out, runs, conditions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
