"""``mpidl compare``: runs of ``mpidl train`` side by side, by the time they took to a target accuracy.

    mpidl compare allreduce.json adpsgd.json prague.json

The first file is the baseline. The target is its final test accuracy (of
the averaged model), or ``--target``. For every run the table gives the
algorithm and its options, the slowed ranks, the final accuracy, the
training time (evaluations excluded) at the end of the first epoch whose
accuracy reached the target, and the baseline's time to the target divided
by the run's: above 1 the run got there sooner. A run that never reached the
target shows "-". Accuracy is measured once per epoch, so times to the
target are resolved to an epoch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl compare`` options."""
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="--json files of mpidl train; the first is the baseline")
    p.add_argument(
        "--target",
        type=float,
        metavar="ACC",
        help="test accuracy to reach, as a fraction (default: the baseline's final accuracy)",
    )


def time_to(epochs: Sequence[dict[str, Any]], target: float) -> float | None:
    """Training time at the end of the first epoch whose test accuracy reached ``target``, or None."""
    return next((e["time_s"] for e in epochs if e["test_acc"] >= target), None)


def table(runs: Sequence[tuple[str, dict[str, Any]]], target: float | None = None) -> str:
    """The comparison of ``runs`` ((name, parsed JSON) pairs, the baseline first) as text."""
    if target is None:
        target = runs[0][1]["epochs"][-1]["test_acc"]
    base = time_to(runs[0][1]["epochs"], target)
    lines = [
        f"# target: test accuracy {100 * target:.2f}% (averaged model); baseline {runs[0][0]}",
        f"{'run':<24} {'algorithm':<28} {'slowed':<10} {'final acc':>9} {'to target':>10} {'speedup':>8} {'total':>8}",
    ]
    for name, run in runs:
        meta, last = run["meta"], run["epochs"][-1]
        what = meta["algorithm"] + "".join(f" --{k} {v}" for k, v in meta["options"].items())
        slow = ",".join(f"{r}:x{f:g}" for r, f in meta["slow"].items()) or "-"
        reached = time_to(run["epochs"], target)
        speedup = f"{base / reached:8.2f}" if reached and base else f"{'-':>8}"
        lines.append(
            f"{name:<24} {what:<28} {slow:<10} {100 * last['test_acc']:8.2f}% "
            + (f"{reached:9.2f}s" if reached is not None else f"{'-':>10}")
            + f" {speedup} {last['time_s']:7.2f}s"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Print the comparison of ``args.runs`` (on rank 0, if run under a launcher)."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append((path, json.load(f)))
    print(table(runs, args.target))
    return 0
