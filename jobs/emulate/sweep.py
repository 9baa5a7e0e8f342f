#!/usr/bin/env python3
"""The measurement on the emulated cluster: algorithms x link rates x models, one table.

    jobs/emulate/sweep.py --out results/sweep                 # the whole matrix (about an hour)
    jobs/emulate/sweep.py --out results/quick --quick          # a few minutes: small models, two rates

For every link rate, the cluster's links are shaped (``cluster.py shape``,
which checks the rate with a ping-pong; 10gbit unchecked, since TCP over the
veths does not reach it on a small CPU), then for every model and every
algorithm ``mpidl train`` runs across the nodes (``cluster.py run``, 2 ranks
per node by default) and writes its JSON; the byte counters of every node's
link are read before and after each run. ``auto``'s cost model is calibrated
once per rate, before the runs (``RATE/costmodel.json``, handed to every run
as ``MPIDL_COSTMODEL``). The cluster must be up
(``cluster.py up --nodes 2``); the sweep leaves it unshaped.

Runs whose JSON exists are not run again (delete them to re-measure), so an
interrupted sweep continues where it stopped. A run past ``--timeout`` (or
interrupted) is ended on every node, nothing of it left to run on into the
next (``cluster.py run --timeout``), and the sweep stops there. ``--repeat
K`` runs each cell K times (files ``ALGO.rK.json``) and the table reports
medians.

The table (``table.rst``, ``table.csv`` and on stdout), one row per model,
rate and algorithm:

* ``epoch s``: median training time of an epoch (the slowest worker's);
* ``to target s``: training time until the averaged model first reached the
  model's target accuracy (evaluated after every epoch), and ``vs allreduce``
  the time AllReduce-SGD with ``auto`` took divided by it (above 1: sooner);
* ``to AR final``: how many times sooner than AllReduce-SGD (``auto``) the
  run's averaged model first reached AllReduce-SGD's final accuracy (below
  1: later; ``-``: never);
* ``final acc``: the averaged model's final test accuracy;
* ``B/step``: payload bytes each worker sent per step (mpidl's transport, exact;
  the peers DDP and Horovod: their ring payload, an estimate); ``across/step``:
  the part sent to the other node, counted by destination (peers: not
  counted, ``-``);
* ``link/step``: the bytes the nodes sent over their links (interface
  counters: all traffic of the run, TCP/IP headers, the set-up and the
  evaluations included) per step of one worker — what the links really
  carried, the peers' included;
* ``wait``: the share of the workers' training time their steps spent
  communicating or waiting (mpidl's algorithms; the peers' communication
  hides in the backward pass and is not measured).

Plots (``--plot``): for each model, test accuracy against training time, one
panel per link rate, one curve per algorithm (``plots/MODEL.png``).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster.py"


@dataclass(frozen=True)
class Model:
    """A model of the sweep: the ``mpidl train`` options that make it, and its target accuracy."""

    name: str
    args: tuple[str, ...]
    target: float
    slow_links: bool  # also measured at the slowest rate (100mbit)


MODELS = {
    m.name: m
    for m in (
        Model("mlp-64", ("--model", "mlp", "--hidden", "64", "--epochs", "20"), 0.95, True),
        Model("mlp-2048", ("--model", "mlp", "--hidden", "2048,2048", "--epochs", "8"), 0.94, False),
        Model(
            "lenet",
            (
                "--model",
                "lenet",
                "--dataset",
                "fashion-mnist",
                "--train-samples",
                "12000",
                "--test-samples",
                "2000",
                "--epochs",
                "6",
            ),
            0.85,
            True,
        ),
        Model(
            "resnet",
            (
                "--model",
                "resnet",
                "--dataset",
                "fashion-mnist",
                "--train-samples",
                "6000",
                "--test-samples",
                "1000",
                "--epochs",
                "4",
            ),
            0.83,
            False,
        ),
    )
}

#: The peers' ``--algorithm`` names: their traffic is not mpidl's transport's to count.
PEERS = ("ddp", "horovod")

#: The algorithms: name in the table -> mpidl train options.
ALGORITHMS = {
    "allreduce": ("--algorithm", "allreduce"),
    "allreduce:ring": ("--algorithm", "allreduce", "--collective", "ring"),
    "allreduce:hierarchical_ring": ("--algorithm", "allreduce", "--collective", "hierarchical_ring"),
    "allreduce:torus2d": ("--algorithm", "allreduce", "--collective", "torus2d"),
    "allreduce:halving_doubling": ("--algorithm", "allreduce", "--collective", "halving_doubling"),
    "allreduce:reduce_broadcast": ("--algorithm", "allreduce", "--collective", "reduce_broadcast"),
    "lsgd": ("--algorithm", "lsgd"),
    "dpsgd": ("--algorithm", "dpsgd"),
    "adpsgd": ("--algorithm", "adpsgd"),
    "prague": ("--algorithm", "prague"),
    "ddp": ("--algorithm", "ddp"),
    "horovod": ("--algorithm", "horovod"),
    "allreduce+fp16": ("--algorithm", "allreduce", "--compression", "fp16"),
    "allreduce+qsgd:127": ("--algorithm", "allreduce", "--compression", "qsgd:127"),
    "allreduce+sign": ("--algorithm", "allreduce", "--compression", "sign"),
    "allreduce+sign-noef": (
        "--algorithm",
        "allreduce",
        "--compression",
        "sign",
        "--no-error-feedback",
        "--local-momentum",
    ),
    "allreduce+topk:0.01": ("--algorithm", "allreduce", "--compression", "topk:0.01"),
    "allreduce+powersgd:4": ("--algorithm", "allreduce", "--compression", "powersgd:4"),
    "dpsgd+qsgd:127": ("--algorithm", "dpsgd", "--compression", "qsgd:127"),
    "ddp+powersgd:4": ("--algorithm", "ddp", "--compression", "powersgd:4"),
    "horovod+fp16": ("--algorithm", "horovod", "--compression", "fp16"),
    "allreduce+fp16@hierarchical": ("--algorithm", "allreduce", "--compression", "fp16@hierarchical"),
    "allreduce+qsgd:127@hierarchical": ("--algorithm", "allreduce", "--compression", "qsgd:127@hierarchical"),
}

RATES = ("unshaped", "10gbit", "1gbit", "100mbit")
SLOW_RATE = "100mbit"
#: Rates TCP over veth does not reach on a small CPU: shaped without the check (jobs/emulate/README.rst).
CPU_BOUND = ("10gbit",)
BASELINE = "allreduce"


def cluster(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``cluster.py ARGS``; raise on failure."""
    cmd = [sys.executable, str(CLUSTER), *args]
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sweep: {shlex.join(cmd)} failed ({proc.returncode}){': ' + proc.stderr if capture else ''}")
    return proc


def on_cluster(args: Sequence[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``cluster.py run --timeout TIMEOUT ARGS``, its output captured. cluster.py ends the job
    on every node when it runs past the timeout or is interrupted; when this sweep is
    interrupted (Ctrl-C reaches both), it is waited for while it does."""
    cmd = [sys.executable, str(CLUSTER), "run", "--timeout", f"{timeout:g}", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            out, err = proc.communicate()
        except BaseException:
            proc.terminate()  # in case the interrupt did not reach it
            proc.wait()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def link_bytes() -> int:
    """Bytes the nodes have sent over their links: what the root-side end of each node's veth
    received (a byte from node 1 to node 2 leaves node 1's link and enters node 2's; counted
    once, as it leaves)."""
    return sum(int((dev / "statistics" / "rx_bytes").read_text()) for dev in Path("/sys/class/net").glob("veth-node*"))


def cell_path(out: Path, rate: str, model: Model, algo: str, k: int) -> Path:
    """Where the ``k``-th run of a cell keeps its JSON."""
    return out / rate / model.name / (f"{algo}.json" if k == 0 else f"{algo}.r{k}.json")


def calibrate(out: Path, rate: str, ranks: int, timeout: float) -> dict[str, str]:
    """The environment of the runs at ``rate``: the cost model of ``auto`` calibrated once
    for the rate's links (``MPIDL_COSTMODEL``), so that no run pays for it (nor carries its
    messages over the links) and every run chooses alike."""
    path = out / rate / "costmodel.json"
    env = {**os.environ, "MPIDL_COSTMODEL": str(path)}
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        code = "import collectives, mpidl; mpidl.init(); collectives.cost_params()"
        proc = on_cluster(["-n", str(ranks), "--", "python", "-c", code], timeout, env)
        if proc.returncode != 0 or not path.exists():
            raise SystemExit(f"sweep: calibration at {rate} failed: {proc.stdout}{proc.stderr}")
    return env


def run_cell(
    path: Path,
    rate: str,
    model: Model,
    algo: str,
    ranks: int,
    extra: Sequence[str],
    timeout: float,
    env: dict[str, str],
) -> None:
    """One ``mpidl train`` across the nodes; its JSON, with the link bytes added, at ``path``
    (nothing to do if it exists)."""
    argv = ["python", "-m", "mpidl", "train", *ALGORITHMS[algo], *model.args, *extra]
    label = f"{rate:>8} {model.name:<8} {algo:<28}"
    train_on_cluster(path, argv, ["-n", str(ranks)], label, timeout, {"rate": rate, "model": model.name}, env)


def train_on_cluster(
    path: Path,
    argv: Sequence[str],
    cluster_args: Sequence[str],
    label: str,
    timeout: float,
    meta: dict[str, Any],
    env: dict[str, str] | None = None,
) -> None:
    """Run the ``mpidl train`` command ``argv`` with ``cluster.py run CLUSTER_ARGS``, ended after
    ``timeout``; write its JSON, with ``meta``, the algorithm, the bytes the links carried and the
    command under ``sweep``, at ``path`` (nothing to do if it exists). A failed run stops the
    sweep (its output in ``path``.err)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    argv = [*argv, "--no-progress", "--json", str(partial)]
    before, t0 = link_bytes(), time.monotonic()
    print(f"sweep: {label} ", end="", flush=True)
    proc = on_cluster([*cluster_args, "--", *argv], timeout, dict(os.environ) if env is None else env)
    wall, carried = time.monotonic() - t0, link_bytes() - before
    if proc.returncode != 0:
        print(f"failed ({proc.returncode})")
        (path.with_suffix(".err")).write_text(proc.stdout + proc.stderr)
        raise SystemExit(f"sweep: {shlex.join(proc.args)} failed; see {path.with_suffix('.err')}")
    run = json.loads(partial.read_text())
    run["sweep"] = {**meta, "algorithm": path.stem.split(".")[0], "link_bytes": carried, "wall_s": wall}
    run["sweep"]["command"] = shlex.join(["jobs/emulate/cluster.py", "run", *cluster_args, "--", *argv[:-2]])
    path.write_text(json.dumps(run, indent=1))
    partial.unlink()
    last = run["epochs"][-1]
    print(f"{last['time_s']:8.1f} s  acc {100 * last['test_acc']:6.2f}%  ({wall:.0f} s wall)", flush=True)


def time_to(epochs: Sequence[dict[str, Any]], target: float) -> float | None:
    """Training time at the end of the first epoch whose averaged model reached ``target``."""
    return next((e["time_s"] for e in epochs if e["test_acc"] >= target), None)


def summarize(run: dict[str, Any], target: float) -> dict[str, Any]:
    """The table's numbers of one run."""
    epochs, last = run["epochs"], run["epochs"][-1]
    steps = sum(e["steps"] for e in epochs)
    workers = last["workers"]
    wait = sum(workers["comm_wait_s"]) / max(sum(workers["time_s"]), 1e-9)
    peer = run["meta"]["algorithm"] in PEERS
    return {
        "epoch_s": statistics.median(e["epoch_s"] for e in epochs),
        "to_target_s": time_to(epochs, target),
        "final_acc": last["test_acc"],
        "bytes_per_step": last["bytes_per_step_mean"],
        "across_per_step": None if peer else last["internode_bytes_per_step_mean"],
        "link_per_step": run["sweep"]["link_bytes"] / max(steps, 1),
        "wait": None if peer else wait,
        "time_s": last["time_s"],
    }


def median_of(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of repeated runs' numbers (a key missing in any run stays missing)."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        out[key] = None if any(v is None for v in values) else statistics.median(values)
    return out


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


COLUMNS = (
    ("model", "{}"),
    ("rate", "{}"),
    ("algorithm", "{}"),
    ("epoch s", ".2f"),
    ("to target s", ".1f"),
    ("vs allreduce", ".2f"),
    ("to AR final", ".2f"),
    ("final acc %", ".2f"),
    ("KiB/step", ".0f"),
    ("across KiB/step", ".0f"),
    ("link KiB/step", ".0f"),
    ("wait %", ".0f"),
)


def to_baseline_final(
    runs: dict[tuple[str, str, str], list[dict[str, Any]]], key: tuple[str, str, str]
) -> float | None:
    """How many times sooner than the baseline the runs of ``key`` first reached the
    baseline's final accuracy (medians over the repeats; None where a run never did)."""
    model, rate, _ = key
    base = runs.get((model, rate, BASELINE))
    if not base:
        return None
    final = statistics.median(r["epochs"][-1]["test_acc"] for r in base)
    base_s = [time_to(r["epochs"], final) for r in base]
    own_s = [time_to(r["epochs"], final) for r in runs[key]]
    if None in own_s or None in base_s:
        return None
    return statistics.median(base_s) / statistics.median(own_s)  # type: ignore[type-var]


def table_rows(
    results: dict[tuple[str, str, str], dict[str, Any]], runs: dict[tuple[str, str, str], list[dict[str, Any]]]
) -> list[list[str]]:
    """Formatted rows, in the order model, rate, algorithm."""
    rows = []
    for (model, rate, algo), r in results.items():
        base = results.get((model, rate, BASELINE), {}).get("to_target_s")
        speedup = base / r["to_target_s"] if base and r["to_target_s"] else None
        sooner = to_baseline_final(runs, (model, rate, algo))
        rows.append(
            [
                model,
                rate,
                algo,
                _fmt(r["epoch_s"], ".2f"),
                _fmt(r["to_target_s"], ".1f"),
                _fmt(speedup, ".2f"),
                _fmt(sooner, ".2f"),
                _fmt(r["final_acc"], ".2f", 100),
                _fmt(r["bytes_per_step"], ".0f", 1 / 1024),
                _fmt(r["across_per_step"], ".0f", 1 / 1024),
                _fmt(r["link_per_step"], ".0f", 1 / 1024),
                _fmt(r["wait"], ".0f", 100),
            ]
        )
    return rows


def rst_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An RST simple table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = " ".join("=" * w for w in widths)

    def line(cells: Sequence[str]) -> str:
        return " ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([rule, line(header), rule, *(line(r) for r in rows), rule]) + "\n"


def plot(out: Path, runs: dict[tuple[str, str, str], list[dict[str, Any]]], rates: Sequence[str]) -> list[Path]:
    """One figure per model: accuracy against training time, a panel per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in dict.fromkeys(m for m, _, _ in runs):
        shown = [r for r in rates if any((model, r, a) in runs for a in ALGORITHMS)]
        fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown) + 2.2, 4), sharey=True, squeeze=False)
        colors = dict(zip(ALGORITHMS, plt.get_cmap("tab20").colors))
        for ax, rate in zip(axes[0], shown):
            for algo in ALGORITHMS:
                if (model, rate, algo) not in runs:
                    continue
                run = runs[(model, rate, algo)][0]
                t = [e["time_s"] for e in run["epochs"]]
                acc = [100 * e["test_acc"] for e in run["epochs"]]
                style = "-" if algo.startswith(("allreduce", *PEERS)) else "--"
                ax.plot(t, acc, style, marker=".", color=colors.get(algo), label=algo)
            ax.axhline(100 * MODELS[model].target, color="grey", linewidth=0.6)
            ax.set_title(f"{model}, {rate}")
            ax.set_xlabel("training time (s)")
            ax.set_xscale("log")
        axes[0][0].set_ylabel("test accuracy (%), averaged model")
        legend = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=7)
        fig.tight_layout(rect=(0, 0, 1 - 2.2 / fig.get_figwidth(), 1))
        path = out / "plots" / f"{model}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1])
    p.add_argument("--out", type=Path, required=True, help="folder of the runs' JSON and the table")
    p.add_argument("--rates", default=",".join(RATES), help=f"link rates (default {','.join(RATES)})")
    p.add_argument("--models", default=",".join(MODELS), help=f"models (default {','.join(MODELS)})")
    p.add_argument(
        "--algorithms",
        default="uncompressed",
        help="comma-separated names, or 'uncompressed' (the default: every row without '+'), "
        "'compressed' (the rows with '+' and their baselines allreduce, dpsgd, ddp) or 'all'",
    )
    p.add_argument("--ranks-per-node", type=int, default=2, help="(default 2)")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell; the table gives medians (default 1)")
    p.add_argument("--quick", action="store_true", help="only the small models, unshaped and 1gbit, 2 epochs")
    p.add_argument("--plot", action="store_true", help="draw plots/MODEL.png (needs matplotlib)")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds per run; then it is ended on every node (default 1800)"
    )
    p.add_argument("--report-only", action="store_true", help="make the table from the runs there; run nothing")
    args = p.parse_args(argv)
    rates, models = args.rates.split(","), [MODELS[m] for m in args.models.split(",")]
    groups = {
        "all": list(ALGORITHMS),
        "uncompressed": [a for a in ALGORITHMS if "+" not in a],
        "compressed": ["allreduce", "dpsgd", "ddp", *(a for a in ALGORITHMS if "+" in a)],
    }
    algos = groups.get(args.algorithms) or args.algorithms.split(",")
    if args.algorithms in groups and importlib.util.find_spec("horovod") is None:
        algos = [a for a in algos if not a.startswith("horovod")]
        print("sweep: the horovod rows left out: Horovod is not installed (jobs/peers/horovod.sh)", flush=True)
    extra: list[str] = []
    if args.quick:
        rates, extra = ["unshaped", "1gbit"], ["--epochs", "2"]
        models = [m for m in models if m.name in ("mlp-64", "lenet")]
    unknown = [a for a in algos if a not in ALGORITHMS] + [r for r in rates if r not in RATES]
    if unknown:
        p.error(f"unknown algorithm(s) or rate(s): {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    try:
        for rate in rates:
            cells = [(m, a) for m in models for a in algos if rate != SLOW_RATE or m.slow_links]
            if not args.report_only and cells:
                rate_args = [] if rate == "unshaped" else ["--rate", rate]
                cluster("shape", *rate_args, *(["--no-check"] if rate in CPU_BOUND else []))
                env = calibrate(args.out, rate, args.ranks_per_node, args.timeout)
            for model, algo in cells:
                paths = [cell_path(args.out, rate, model, algo, k) for k in range(args.repeat)]
                if not args.report_only:
                    for path in paths:
                        run_cell(path, rate, model, algo, args.ranks_per_node, extra, args.timeout, env)
                paths = [q for q in paths if q.exists()]
                if paths:
                    loaded = [json.loads(q.read_text()) for q in paths]
                    runs[(model.name, rate, algo)] = loaded
                    results[(model.name, rate, algo)] = median_of([summarize(r, model.target) for r in loaded])
    finally:
        if not args.report_only:
            cluster("shape")  # leave the links unshaped
    header = [c for c, _ in COLUMNS]
    rows = table_rows(results, runs)
    text = rst_table(header, rows)
    (args.out / "table.rst").write_text(text)
    with open(args.out / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    targets = ", ".join(f"{m.name} {100 * m.target:.0f}%" for m in models)
    print(f"# targets: {targets}; {args.ranks_per_node} ranks per node; medians of {args.repeat} run(s)")
    print(text, end="")
    if args.plot:
        for path in plot(args.out, runs, rates):
            print(f"sweep: wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
