#!/usr/bin/env python3
"""auto against every other candidate, in several fresh processes: auto's acceptance check.

    python jobs/auto_check.py --ranks 2 --runs 5
    python jobs/auto_check.py --launch "jobs/emulate/cluster.py run -n 2 --" --runs 5   # 2 emulated nodes x 2

Runs ``mpidl bench`` ``--runs`` times, each a new job (mpidl's algorithms,
"mpi", ``auto`` and native ``MPI_Allreduce`` in and out of place, interleaved,
medians of ``--repeat``; by default 4 KiB to 64 MiB with sizes between auto's
grid sizes: 192 KiB, 3, 24 and 48 MiB). The runs share one new cache
directory (``MPIDL_CACHE_DIR``): the first calibrates and tunes, the others
use what it saved, as a user's programs on one machine do; with
``--fresh-cache`` each run has its own, so each measures anew. Then, per
size: auto's time over the fastest of the other candidates in each run, the
worst of those, in how many runs it stayed within ``--limit``, and what auto
ran in each run (with where its choice came from: calibration, online
tuning, cached), and in runs where auto was over the limit, the fastest
other candidate and its time. Exit status 0 if auto stayed within the limit
at every size of every run and ran the same algorithm in every run, 1
otherwise.

``--no-validate`` times mpidl's calls, auto's included, without the
cross-rank argument check, which native ``MPI_Allreduce`` does not make:
what auto's choice costs, apart from what the check costs.

``--launch`` is the command that starts a job (default ``mpiexec -n RANKS``);
``mpidl bench ...`` is appended to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from mpidl.bench import human

SIZES = "4K,16K,64K,192K,256K,1M,3M,4M,16M,24M,48M,64M"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of each job (with the default launcher)")
    parser.add_argument("--launch", help="the command that starts a job (default: mpiexec -n RANKS)")
    parser.add_argument("--runs", type=int, default=5, help="fresh jobs (default 5)")
    parser.add_argument("--sizes", default=SIZES, help=f"mpidl bench --sizes (default {SIZES})")
    parser.add_argument("--repeat", type=int, default=5, help="mpidl bench --repeat (default 5)")
    parser.add_argument("--limit", type=float, default=1.10, help="most auto/fastest allowed (default 1.10)")
    parser.add_argument("--fresh-cache", action="store_true", help="a new cache directory for every run")
    parser.add_argument(
        "--no-validate", action="store_true", help="mpidl bench --no-validate: time mpidl without the argument check"
    )
    parser.add_argument("--out", type=Path, help="keep each run's JSON here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one run may take")
    args = parser.parse_args()
    launch = shlex.split(args.launch) if args.launch else ["mpiexec", "-n", str(args.ranks)]
    with tempfile.TemporaryDirectory(prefix="mpidl-auto-check-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        runs = []
        for k in range(args.runs):
            cache = Path(tmp) / ("cache" if not args.fresh_cache else f"cache{k}")
            path = out / f"run{k}.json"
            bench = ["mpidl", "bench", "--sizes", args.sizes, "--repeat", str(args.repeat), "--json", str(path)]
            bench += ["--no-validate"] if args.no_validate else []
            env = {**os.environ, "MPIDL_CACHE_DIR": str(cache)}
            print(f"# run {k + 1} of {args.runs}: {shlex.join(launch + bench)}", flush=True)
            proc = subprocess.run(launch + bench, env=env, timeout=args.timeout, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(path.read_text()))
    return report(runs, args.limit)


def report(runs: list[dict], limit: float) -> int:
    """Print the per-size table (module docstring); 0 if every run kept within ``limit``
    and auto ran the same in every run, else 1."""
    meta = runs[0]["meta"]
    print(f"# {len(runs)} runs, {meta['ranks']} ranks, {meta['layout']}, {meta['mpi']}")
    print(f"{'size':>9}  {'auto/fastest per run':<40} {'worst':>6} {'within':>7}  auto ran (chosen by)")
    ok = True
    for size in sorted({r["size"] for r in runs[0]["results"]}):
        ratios, ran, over = [], [], []
        for k, run in enumerate(runs, 1):
            rows = [r for r in run["results"] if r["size"] == size]
            auto = next(r for r in rows if r["algorithm"] == "auto")
            fastest = min((r for r in rows if r["algorithm"] != "auto"), key=lambda r: r["time"])
            ratios.append(auto["time"] / fastest["time"])
            ran.append(f"{auto['chosen']} ({auto.get('source') or 'model'})")
            if ratios[-1] > limit:
                over.append(f"run {k}: {fastest['algorithm']} {fastest['time'] * 1e6:.0f} us")
        within = sum(x <= limit for x in ratios)
        same = len({r.split(" (")[0] for r in ran}) == 1
        ok &= within == len(runs) and same
        shown = " ".join(f"{x:.2f}" for x in ratios)
        choices = ran[0].split(" (")[0] + " in all" if same else ", ".join(ran)
        print(f"{human(size):>9}  {shown:<40} {max(ratios):6.2f} {within:>3}/{len(runs):<3}  {choices}")
        if same:
            print(f"{'':>9}  {'':<40} {'':>6} {'':>7}  chosen by: {', '.join(r.split(' (')[1][:-1] for r in ran)}")
        if over:
            print(f"{'':>9}  {'':<40} {'':>6} {'':>7}  fastest where over: {'; '.join(over)}")
    print("auto kept within the limit and chose alike in every run" if ok else "NOT within the limit or not alike")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
