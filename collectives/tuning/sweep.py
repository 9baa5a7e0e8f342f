"""Timing every candidate at one grid size, as ``auto``'s calibration (collective).

:func:`point` times each candidate plan on a float32 sum of the grid size:

1. a warm-up call each (scratch buffers, pages, the plan's first use),
   barrier-aligned and timed, the slowest rank's;
2. a first batch each, of as many calls as that time fits in about
   :data:`BATCH_TIME` (one call at large sizes), its time per call the slowest
   rank's. A candidate over :data:`PRUNE` times the fastest there is not timed
   further (that time is kept), so that hopeless candidates cost one batch.
   A batch, not a single call: at a few microseconds a single call's time is
   mostly the ranks' skew leaving the barrier and the machine's jitter, which
   pruned the fastest candidate at 4 KiB on a 2-core machine
   (docs/performance.rst, "auto in fresh processes");
3. :data:`ROUNDS` rounds in which the remaining candidates take turns (the
   order rotating from round to round, so that slow drift of a busy machine
   and one candidate's cache footprint hit all alike), each a barrier-aligned
   batch of calls lasting about :data:`BATCH_TIME`; every batch's time per
   call is the slowest rank's (one ``MPI_Allreduce`` of all of them at the
   end), and a candidate's time is its median batch.

Every rank gets the same numbers, so every rank decides alike. It also
checks that the MPI library's own all-reduce ("mpi") gives every rank the
same bits on that size (:func:`identical`). :func:`check_time` times the
cross-rank argument check (:mod:`collectives.validation`) the same way.
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from ..kernels.plans import Run
from ..transport import gpu
from ..transport.context import Context
from ..transport.ops import reduction
from ..validation import check
from .waits import barrier, waiting

T = TypeVar("T")

#: Rounds of interleaved batches per grid size.
ROUNDS = 5
#: Seconds one timed batch aims for (small sizes run several calls per batch).
BATCH_TIME = 1e-3
#: Most calls in one batch.
MAX_CALLS = 100
#: A candidate slower than this many times the fastest in its first timed call is not timed further.
PRUNE = 2.0
#: What the stall inspector says a rank waits in.
DURING = "auto's calibration"


def point(ctx: Context, runs: Mapping[str, Run], nbytes: int, xp: Any = np) -> dict[str, float]:
    """Every candidate's seconds for an all-reduce of ``nbytes`` of ``xp`` memory on
    ``ctx``'s communicator (module docstring; collective)."""
    comm = ctx.comm
    x = xp.zeros(max(nbytes // 4, 1), np.float32)
    add = reduction("sum", "float32", xp)
    names = list(runs)

    def batch(name: str, calls: int) -> float:
        run = runs[name]
        barrier(comm, DURING)
        t0 = time.perf_counter()
        for _ in range(calls):
            run(x, add)
        if xp is not np:
            gpu.synchronize()
        return (time.perf_counter() - t0) / calls

    warm = dict(zip(names, _slowest(comm, [batch(name, 1) for name in names])))
    first = dict(zip(names, _slowest(comm, [batch(name, _calls(warm[name])) for name in names])))
    fastest = min(first.values())
    kept = [name for name in names if first[name] <= PRUNE * fastest]
    calls = {name: _calls(first[name]) for name in kept}
    samples: list[float] = []
    for r in range(ROUNDS):
        times = {name: batch(name, calls[name]) for name in rotated(kept, r)}
        samples.extend(times[name] for name in kept)
    agreed = np.reshape(_slowest(comm, samples), (ROUNDS, len(kept)))
    medians = {name: statistics.median(agreed[:, j].tolist()) for j, name in enumerate(kept)}
    return {name: medians.get(name, first[name]) for name in names}


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` starting at position ``turn`` (modulo their number): the order of round
    ``turn`` where candidates take turns, so that none always runs after the same one."""
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def zeroed(x: Any) -> Any:
    """A copy of ``x`` (its memory kind, dtype and length) holding zeros: a buffer that a
    rehearsal sums again and again without overflowing, at the cost of any finite values."""
    copy = x.copy()
    copy.fill(0)
    return copy


def _calls(seconds: float) -> int:
    """Calls of ``seconds`` each that make one batch of about :data:`BATCH_TIME`."""
    return max(1, min(MAX_CALLS, round(BATCH_TIME / max(seconds, 1e-9))))


def identical(ctx: Context, run: Run, nbytes: int, xp: Any = np) -> bool:
    """Whether ``run`` (the MPI library's all-reduce) gives every rank the same bits for
    a float32 sum of ``nbytes`` whose result depends on the order of the operands:
    values of many magnitudes, a NaN of a different payload on each rank every
    97 elements (collective)."""
    n = max(nbytes // 4, 1)
    rng = np.random.default_rng(ctx.rank)
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(np.float32)
    values.view(np.uint32)[::97] = 0x7FC00001 + ctx.rank
    x = xp.array(values)
    run(x, reduction("sum", "float32", xp))
    digest = zlib.crc32(x if xp is np else x.get())
    with waiting(ctx.comm, "comparing the MPI library's results", DURING):
        return len(set(ctx.comm.allgather(digest))) == 1


def check_time(ctx: Context, calls: int = 20) -> float:
    """Seconds of one argument check (:func:`collectives.validation.check`) on ``ctx``'s
    communicator: the median of 5 barrier-aligned batches, the slowest rank's."""
    signature = (0, 0, 0, 0, 0)
    samples = []
    for _ in range(5):
        barrier(ctx.comm, DURING)
        t0 = time.perf_counter()
        for _ in range(calls):
            check(ctx, "auto's calibration", None, signature)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(_slowest(ctx.comm, samples).tolist())


def _slowest(comm: MPI.Comm, seconds: list[float]) -> np.ndarray:
    """Element-wise the largest of every rank's ``seconds`` (collective)."""
    t = np.array(seconds, np.float64)
    with waiting(comm, "Allreduce of the timings", DURING):
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return t
