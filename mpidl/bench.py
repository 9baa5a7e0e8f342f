"""``mpidl bench``: all-reduce algorithms against native ``MPI_Allreduce``, in one run.

For every size and every candidate — native ``MPI_Allreduce`` out of place and
with ``MPI_IN_PLACE``, and each of mpidl's algorithms — the sweep times
batches of calls after a warm-up. A batch starts at a barrier and its time is
the slowest rank's; candidates take turns within each repetition (so slow
drift of a noisy machine hits all of them alike), in an order that rotates
from one repetition to the next (so no candidate always follows the same
one), and each reports the median over repetitions. "vs native" is native's
time (the faster native variant) divided by the candidate's: above 1 the
candidate is faster. "vs bound" is the bandwidth lower bound
2(n-1)/n * size * beta (Patarasuk & Yuan; beta calibrated for the slowest
link in use) divided by the time: 1 would be a perfect bandwidth-optimal
algorithm with free reductions. "model" is the cost
model's prediction (:mod:`collectives.tuning.costmodel`, with the argument check as
the run has it); ``auto`` is listed with the algorithm it chose and, in that
column, the time its choice was based on. After the table a summary gives,
per size, what auto ran and what chose it (the calibration, online tuning,
either of them from the persisted cache, or the model), auto's time over the
fastest of every other candidate (mpidl's fixed algorithms, "mpi" and the
native variants) and native's over auto's, and at the smallest and largest
sizes the cost model's order of the algorithms against the measured one.
``auto`` calibrates during its warm-up like any program's first calls, and
tunes there in full (deterministic tuning, as ``mpidl train`` has it: every
tuning call on a copy of the first call's buffer,
:mod:`collectives.tuning.settings`), so the timed calls measure what auto
runs from then on, and the tuning is finished and saved however few calls a
size gets. ``MPIDL_TUNING_CACHE=0`` keeps it from using or leaving
measurements of earlier runs.

On ``--device cuda`` the run also measures the device reduction that every
algorithm's combine step runs (CuPy's ufunc into its first operand) at the
largest size, against a device-to-device copy of the same size: bytes moved
(two reads and a write; a read and a write) over the time CUDA events give.

Native MPICH allocates a temporary buffer per large call, so its time depends
on malloc: the run reports ``GLIBC_TUNABLES`` as found, and ``--tuned-malloc``
also times native after ``mallopt`` keeps freed memory mapped
(M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

import collectives
from collectives.topology.layout import layout
from collectives.transport import gpu, ops
from collectives.tuning import costmodel, sweep

from . import plotting

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


@dataclass
class Result:
    """One candidate at one size (times in seconds, bandwidths in bytes/s)."""

    size: int
    algorithm: str
    time: float
    algbw: float
    busbw: float
    vs_native: float
    vs_bound: float = 0.0
    predicted: float = 0.0
    chosen: str = ""
    source: str = ""


def parse_size(text: str) -> int:
    """Parse "4K", "16MiB", "1048576" into bytes."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4K, 16M, 1G or a byte count")
    return int(digits) * _UNITS[unit]


def human(nbytes: int) -> str:
    """4096 -> '4 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl bench`` options."""
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--collectives", default="all", help="comma-separated all-reduce algorithms (collectives), or 'all'")
    p.add_argument("--algorithms", help=argparse.SUPPRESS)  # the old name of --collectives (deprecated)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: CuPy buffers in GPU memory (needs the cupy extra and a GPU)",
    )
    p.add_argument("--repeat", type=int, default=11, help="timed repetitions per size (median reported)")
    p.add_argument(
        "--batch-time",
        type=float,
        default=0.01,
        help="seconds each timed batch aims for; small messages run many calls per batch",
    )
    p.add_argument("--no-validate", action="store_true", help="time mpidl without the cross-rank argument check")
    p.add_argument(
        "--tuned-malloc",
        action="store_true",
        help="also time native MPI_Allreduce with mallopt keeping freed memory (see above)",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the results as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="plot time vs size, one line per algorithm (needs matplotlib)")


def candidates(
    names: Sequence[str], validate: bool, device: str = "cpu", comm: Any = None
) -> dict[str, Callable[[Any], object]]:
    """Callables that all-reduce a buffer in place over ``comm`` (default
    ``MPI_COMM_WORLD``; native out-of-place: into a second buffer), by candidate
    name. On "cuda" each call is bracketed by stream synchronisations, and native
    MPI gets device pointers only if the MPI library is GPU-aware
    (:mod:`collectives.transport.gpu`); otherwise it is timed with the same staging
    through pinned host memory ("native_staged")."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    out: dict[str, Callable[[Any], object]] = {}
    spare: dict[Any, Any] = {}

    def other(x: Any) -> Any:
        if x.nbytes not in spare:
            spare[x.nbytes] = x.copy()
        return spare[x.nbytes]

    out["native"] = lambda x: comm.Allreduce(x, other(x))
    out["native_inplace"] = lambda x: comm.Allreduce(MPI.IN_PLACE, x)
    for name in names:
        out[name] = _entry(comm, name, validate)
    if device != "cuda":
        return out
    import cupy

    if gpu.configure(comm).mode != "direct":  # the MPI library cannot read device memory: native stages it

        def staged(x: Any) -> None:
            key = ("host", x.nbytes)
            if key not in spare:
                spare[key] = cupy.cuda.alloc_pinned_memory(x.nbytes)
            h = np.frombuffer(spare[key], x.dtype, x.size)
            x.get(out=h)
            comm.Allreduce(MPI.IN_PLACE, h)
            x.set(h)

        del out["native"], out["native_inplace"]
        out["native_staged"] = staged
    sync = cupy.cuda.get_current_stream().synchronize
    return {name: _synchronized(fn, sync) for name, fn in out.items()}


def _entry(comm: Any, name: str, validate: bool) -> Callable[[Any], object]:
    """``collectives.allreduce`` of collective ``name``, called as a program calls it
    (positional arguments; a partial with keywords would add its own cost per call)."""
    allreduce = collectives.allreduce
    return lambda x: allreduce(x, comm, "sum", name, validate=validate)


def _synchronized(fn: Callable[[Any], object], sync: Callable[[], None]) -> Callable[[Any], None]:
    """``fn`` between two waits for the device's queued work (so host clocks time it)."""

    def run(x: Any) -> None:
        sync()
        fn(x)
        sync()

    return run


def run(
    sizes: Sequence[int],
    names: Sequence[str],
    dtype: str = "float32",
    repeat: int = 11,
    batch_time: float = 0.01,
    validate: bool = True,
    tuned_malloc: bool = False,
    progress: bool = True,
    device: str = "cpu",
    comm: Any = None,
) -> list[Result]:
    """Run the sweep (collective over ``comm``, default COMM_WORLD) and return every
    rank the results.

    Each result also carries the cost model's prediction (mpidl's algorithms)
    and the fraction of the bandwidth bound 2(n-1)/n * size * beta it reaches,
    beta being the calibrated per-byte time of the slowest link in use.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    n = comm.Get_size()
    lay = layout(comm)
    xp = np if device == "cpu" else importlib.import_module("cupy")
    prm = collectives.cost_params(comm, device=device)
    fns = candidates(names, validate, device, comm)
    tuning = collectives.set_tuning(deterministic=True)  # auto tunes in full at its first call (docstring)
    try:
        results = _sweep(comm, sizes, fns, dtype, xp, repeat, batch_time, tuned_malloc, progress)
    finally:
        collectives.set_tuning(**dataclasses.asdict(tuning))
    beta = prm.beta_inter if lay.nodes > 1 else prm.beta_intra
    for r in results:
        native = min(q.time for q in results if q.size == r.size and q.algorithm.startswith("native"))
        r.vs_native = native / r.time
        r.vs_bound = costmodel.model_bound(r.size, n, beta) / r.time
        if r.algorithm == "auto":
            choice = collectives.explain(r.size, comm, device=device, validate=validate, dtype=dtype)
            r.chosen, r.source = choice.algorithm, choice.source
            r.predicted = choice.predictions.get(choice.algorithm, 0.0)
        elif r.algorithm in costmodel.MODELS:
            r.predicted = costmodel.predict(r.algorithm, r.size, lay, prm, validate=validate)
    return results


def _sweep(
    comm: Any,
    sizes: Sequence[int],
    fns: dict[str, Callable[[Any], object]],
    dtype: str,
    xp: Any,
    repeat: int,
    batch_time: float,
    tuned_malloc: bool,
    progress: bool,
) -> list[Result]:
    """Time every candidate at every size (see :func:`run`); vs_native, vs_bound and
    predicted are left at 0."""
    n = comm.Get_size()
    results: list[Result] = []
    steps = [(size, phase) for size in sizes for phase in (["default", "tuned"] if tuned_malloc else ["default"])]
    bar = _progress(len(steps), progress and comm.Get_rank() == 0)
    for size, phase in steps:
        _mallopt(phase == "tuned")
        todo = {k: v for k, v in fns.items() if phase == "default" or k.startswith("native")}
        label = (lambda k: k) if phase == "default" else (lambda k: f"{k}+mallopt")
        x = xp.zeros(size // np.dtype(dtype).itemsize, dtype=dtype)
        iters = {k: _calibrate(comm, fn, x, batch_time) for k, fn in todo.items()}
        samples: dict[str, list[float]] = {k: [] for k in todo}
        for r in range(repeat):  # in turn, the order rotating: what runs before a candidate changes
            for k in sweep.rotated(list(todo), r):
                samples[k].append(time_batch(comm, todo[k], x, iters[k]))
        for k, s in samples.items():
            t = statistics.median(s)
            results.append(Result(size, label(k), t, size / t, size / t * 2 * (n - 1) / n if n > 1 else 0.0, 0.0))
        bar.update(1)
    bar.close()
    _mallopt(False)
    return results


def device_bandwidth(nbytes: int, dtype: str = "float32", repeat: int = 21) -> tuple[float, float]:
    """(reduction, copy), in bytes moved per second on the current CUDA device:
    mpidl's device sum ``dst <- dst + src`` (:func:`collectives.transport.ops.reduction`;
    ``3 * nbytes`` moved) and a device-to-device copy (``2 * nbytes``), each the median
    of ``repeat`` runs timed with CUDA events after one warm-up, on random operands."""
    import cupy

    n = nbytes // np.dtype(dtype).itemsize
    rng = cupy.random.default_rng(0)
    dst, src = ((rng.random(n, dtype=np.float64) * 1000).astype(dtype) for _ in range(2))
    copy = cupy.empty_like(dst)
    add = ops.reduction("sum", dtype, cupy)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def seconds(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(times)

    reduce_s = seconds(lambda: add.combine(dst, src))
    copy_s = seconds(lambda: cupy.copyto(copy, src))
    return 3 * n * dst.itemsize / reduce_s, 2 * n * dst.itemsize / copy_s


def _calibrate(comm: Any, fn: Callable[[np.ndarray], object], x: np.ndarray, batch_time: float) -> int:
    """Warm up, then choose (on every rank alike) how many calls make one batch."""
    fn(x)
    fn(x)
    t = time_batch(comm, fn, x, 1)
    return max(1, min(10000, int(batch_time / max(t, 1e-7))))


def time_batch(comm: Any, fn: Callable[[np.ndarray], object], x: np.ndarray, iters: int) -> float:
    """Seconds per call over a barrier-aligned batch, the slowest rank's."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def _mallopt(tuned: bool) -> None:
    """Set glibc's mmap/trim thresholds (tuned) or put back its defaults."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, (32 << 20) if tuned else (128 << 10))
    libc.mallopt(m_trim_threshold, (1 << 30) if tuned else (128 << 10))


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, show: bool) -> Any:
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="size", file=sys.stderr, leave=False)


def table(results: Sequence[Result], nranks: int) -> str:
    """The results as a text table, one block per size."""
    lines = [
        f"{'size':>9}  {'algorithm':<22} {'time (us)':>11} {'algbw GB/s':>10} {'busbw GB/s':>10} "
        f"{'vs native':>9} {'vs bound':>8} {'model (us)':>10}"
    ]
    for size in sorted({r.size for r in results}):
        for r in (q for q in results if q.size == size):
            model = f"{r.predicted * 1e6:10.1f}" if r.predicted else f"{'-':>10}"
            name = f"auto ({r.chosen})" if r.chosen else r.algorithm
            lines.append(
                f"{human(size):>9}  {name:<22} {r.time * 1e6:11.1f} {r.algbw / 1e9:10.3f} "
                f"{r.busbw / 1e9:10.3f} {r.vs_native:9.2f} {r.vs_bound:8.2f} {model}"
            )
    return "\n".join(lines)


def summary(results: Sequence[Result], tie: float = 0.1) -> str:
    """Per size: what auto ran and what chose it (:attr:`collectives.tuning.costmodel.Choice.source`),
    the fastest of every other candidate (fixed algorithms and native variants) and
    auto's time over its, and the best native variant's time over auto's; at the
    smallest and largest sizes, the cost model's order of the algorithms against
    the measured one (a pair measured within ``tie`` of each other is a tie and
    cannot be out of order)."""
    lines = [
        f"{'size':>9}  {'auto ran':<18} {'chosen by':<24} {'fastest':<24} {'auto/fastest':>12} "
        f"{'best native':<24} {'native/auto':>11}"
    ]
    sizes = sorted({r.size for r in results})
    for size in sizes:
        rows = [r for r in results if r.size == size]
        auto = next((r for r in rows if r.algorithm == "auto"), None)
        others = [r for r in rows if r.algorithm != "auto"]
        native = min((r for r in rows if r.algorithm.startswith("native")), key=lambda r: r.time)
        if auto is None or len(others) < 2:
            continue
        best = min(others, key=lambda r: r.time)
        lines.append(
            f"{human(size):>9}  {auto.chosen:<18} {auto.source:<24} {best.algorithm:<24} "
            f"{auto.time / best.time:12.2f} {native.algorithm:<24} {native.time / auto.time:11.2f}"
        )
    for size in dict.fromkeys((sizes[0], sizes[-1])):
        by_name = {r.algorithm: r for r in results if r.size == size and r.algorithm in costmodel.MODELS}
        if len(by_name) < 2:
            continue
        model = sorted(by_name, key=lambda a: by_name[a].predicted)
        measured = sorted(by_name, key=lambda a: by_name[a].time)
        wrong = [
            (a, b) for i, a in enumerate(model) for b in model[i + 1 :] if by_name[a].time > by_name[b].time * (1 + tie)
        ]
        lines.append(f"{human(size)}: model order {' < '.join(model)}")
        lines.append(f"{human(size)}: measured    {' < '.join(measured)}")
        lines.append(
            f"{human(size)}: pairs the model orders wrongly (beyond a {tie:.0%} tie): "
            + (", ".join(f"{a} before {b}" for a, b in wrong) or "none")
            + f" ({len(wrong)} of {len(model) * (len(model) - 1) // 2})"
        )
    return "\n".join(lines)


def write_outputs(results: Sequence[Result], args: argparse.Namespace, meta: dict) -> None:
    """Write --json, --csv and --plot files."""
    rows = [asdict(r) for r in results]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        plot(results, args.plot, meta)


def plot(results: Sequence[Result], path: str, meta: dict) -> None:
    """Time vs size on log-log axes, one line per algorithm."""
    fig, ax = plotting.pyplot().subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.algorithm for r in results):
        pts = sorted((r.size, r.time) for r in results if r.algorithm == name)
        ax.plot(
            [p[0] for p in pts],
            [p[1] * 1e6 for p in pts],
            marker="o",
            label=name,
            linestyle="--" if name.startswith("native") else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per all-reduce (us)")
    ax.set_title(f"all-reduce, {meta['ranks']} ranks, {meta['dtype']}")
    plotting.finish(fig, [ax], path)


def main(args: argparse.Namespace) -> int:
    """Run ``mpidl bench`` with parsed ``args``; rank 0 prints and writes files."""
    from mpi4py import MPI

    from .runtime import USAGE_EXIT_CODE, init

    comm = init()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    chosen = args.collectives
    if args.algorithms is not None:
        if comm.Get_rank() == 0:
            print(
                "mpidl bench: --algorithms is deprecated and will be removed in the next release; use --collectives",
                file=sys.stderr,
            )
        chosen = args.algorithms
    names = list(collectives.COLLECTIVES) if chosen == "all" else chosen.split(",")
    unknown = [a for a in names if a not in collectives.COLLECTIVES]
    if unknown:
        if comm.Get_rank() == 0:
            print(
                f"mpidl bench: unknown collective(s) {unknown}; valid: {', '.join(collectives.COLLECTIVES)}",
                file=sys.stderr,
            )
        return USAGE_EXIT_CODE
    results = run(
        sizes,
        names,
        args.dtype,
        args.repeat,
        args.batch_time,
        not args.no_validate,
        args.tuned_malloc,
        device=args.device,
    )
    if comm.Get_rank() == 0:
        prm = collectives.cost_params(comm, device=args.device)
        meta = {
            "ranks": comm.Get_size(),
            "dtype": args.dtype,
            "validate": not args.no_validate,
            "device": args.device if args.device == "cpu" else f"cuda, transport {gpu.PATH}",
            "layout": str(layout(comm)),
            "costmodel": str(prm),
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
            "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        }
        print(
            f"# mpidl bench: {meta['ranks']} ranks, {meta['dtype']} on {meta['device']}, {meta['mpi']}, validation "
            f"{'on' if meta['validate'] else 'off'}, GLIBC_TUNABLES={meta['GLIBC_TUNABLES'] or '(unset)'}"
        )
        print(f"# {meta['layout']}; cost model: {meta['costmodel']}")
        print(table(results, comm.Get_size()))
        print("# auto against the fastest of every other candidate, and native; the cost model's order")
        print(summary(results))
        if args.device == "cuda":
            size = max(sizes)
            reduce_bw, copy_bw = device_bandwidth(size, args.dtype)
            meta["device_bandwidth"] = {"bytes": size, "reduction": reduce_bw, "copy": copy_bw}
            print(
                f"# device reduction (sum into the first operand, {args.dtype}) at {human(size)}: "
                f"{reduce_bw / 1e9:.0f} GB/s (2 reads + 1 write), {reduce_bw / copy_bw:.0%} of a device copy's "
                f"{copy_bw / 1e9:.0f} GB/s (read + write)"
            )
        write_outputs(results, args, meta)
    return 0
