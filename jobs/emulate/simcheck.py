#!/usr/bin/env python3
"""The simulator against the emulated cluster: ``mpidl simulate`` on the cells of a ``scale.py`` folder.

    jobs/emulate/simcheck.py --emulated results/s24 --out results/s24-sim --cells 8x2/straggler,16x2/straggler

For every run JSON of the chosen cells (``CLUSTER/CONDITION/ALGORITHM.json``,
written by ``scale.py``), the same set-up is simulated: the workers, ranks
per node, model, epochs, batch size, learning rate, momentum, seed, paced
step time, slow workers and random slowdowns are read from the run's
``meta``, the link rate is ``--rate`` (the cluster's, which the JSON does not
hold); nothing is fitted per cell. The table gives, per run, the median
epoch time and the time to ``--target`` (the averaged model's, evaluated
after every epoch), emulated and simulated, and the simulation's error in
per cent of the emulated value. The simulated runs' JSON go to ``--out``
(a run whose JSON is there is not simulated again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # this folder's sweep: time_to, tables


def simulate_args(run: dict[str, Any], cluster: str, rate: str) -> list[str]:
    """``mpidl simulate``'s options for the set-up of an emulated ``run`` on ``cluster`` (NxR)."""
    meta = run["meta"]
    algorithm, options = meta["algorithm"], meta.get("options", {})
    argv = ["--algorithm", algorithm, "--workers", str(meta["workers"]), "--ranks-per-node", cluster.split("x")[1]]
    if algorithm == "prague":
        argv += ["--policy", options.get("policy", "smart")]
    argv += ["--hidden", ",".join(map(str, meta["model_spec"]["layers"][1:-1])), "--dataset", meta["dataset"]]
    argv += ["--epochs", str(meta["epochs"]), "--batch-size", str(meta["batch_size"]), "--lr", str(meta["lr"])]
    argv += ["--momentum", str(meta["momentum"]), "--seed", str(meta["seed"]), "--rate", rate]
    argv += ["--step-time", f"{1e3 * meta['step_time_s']:g}ms"]
    for rank, factor in meta["slow"].items():
        argv += ["--slow", f"{rank}:{factor:g}"]
    if meta["slowdown"]:
        s = meta["slowdown"]
        argv += ["--slowdown", f"p={s['p']:g},F={s['F']:g},P={s['P']}" + (f",seed={s['seed']}" if s["seed"] else "")]
    return argv


def error(simulated: float | None, emulated: float | None) -> str:
    """The simulation's error in per cent of the emulated value."""
    return "-" if simulated is None or not emulated else f"{100 * (simulated - emulated) / emulated:+.0f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulated", type=Path, required=True, help="a scale.py --out folder")
    p.add_argument("--out", type=Path, required=True, help="folder of the simulated runs' JSON")
    p.add_argument("--cells", required=True, help="CLUSTER/CONDITION list, e.g. 8x2/straggler,16x2/straggler")
    p.add_argument("--rate", default="1gbit", help="the emulated links' rate (default 1gbit)")
    p.add_argument("--target", type=float, default=0.85, help="accuracy of the time to target (default 0.85)")
    args = p.parse_args()
    rows = []
    for cell in args.cells.split(","):
        for path in sorted((args.emulated / cell).glob("*.json")):
            emulated = json.loads(path.read_text())
            if emulated["meta"]["algorithm"] not in ("allreduce", "adpsgd", "prague"):
                continue
            out = args.out / cell / path.name
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                argv = [
                    "mpidl",
                    "simulate",
                    *simulate_args(emulated, cell.split("/")[0], args.rate),
                    "--json",
                    str(out),
                ]
                print("$", " ".join(argv), flush=True)
                subprocess.run(argv, check=True)
            simulated = json.loads(out.read_text())
            e_epoch = statistics.median(e["epoch_s"] for e in emulated["epochs"])
            s_epoch = statistics.median(e["epoch_s"] for e in simulated["epochs"])
            e_to = sweep.time_to(emulated["epochs"], args.target)
            s_to = sweep.time_to(simulated["epochs"], args.target)
            rows.append(
                [
                    *cell.split("/"),
                    path.stem,
                    f"{e_epoch:.1f}",
                    f"{s_epoch:.1f}",
                    error(s_epoch, e_epoch),
                    sweep._fmt(e_to, ".1f"),
                    sweep._fmt(s_to, ".1f"),
                    error(s_to, e_to),
                    f"{100 * emulated['epochs'][-1]['test_acc']:.2f}",
                    f"{100 * simulated['epochs'][-1]['test_acc']:.2f}",
                    f"{simulated['meta']['simulated']['wall_s']:.0f}",
                ]
            )
    columns = (
        "cluster",
        "condition",
        "algorithm",
        "epoch s emulated",
        "simulated",
        "error %",
        f"to {100 * args.target:g} % s emulated",
        "simulated",
        "error %",
        "final acc % emulated",
        "simulated",
        "simulation s",
    )
    print(sweep.rst_table(columns, rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
