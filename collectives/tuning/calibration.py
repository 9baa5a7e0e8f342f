"""Calibration: the cost model's parameters measured on the running job.

:func:`calibrate` times what the algorithms are made of on the actual
layout — exchanges inside and across nodes, a reducing exchange, the
shared-memory algorithm, every message-passing plan on 8 bytes — and fits
:class:`~collectives.tuning.costmodel.Params` to it.
:func:`params_for` is what ``collective="auto"`` asks: the parameters loaded
from ``MPIDL_COSTMODEL`` if that file exists (rank 0 reads it for all), else
measured once per communicator (collective), cached, and written to that
file. Every collective wait of the calibration is shown to the stall
inspector, named as such.

It sits above the pure model (:mod:`collectives.tuning.costmodel`) and the
plans it times (:mod:`collectives.kernels.plans`); the entry point
(:mod:`collectives.api`) asks it for parameters and hands it the one thing it
cannot reach from below, a call of the entry point itself, to time the
per-call overhead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, TypeVar

import numpy as np
from mpi4py import MPI

from ..errors import ArgumentError
from ..kernels import shm as _shm
from ..kernels.plans import PLANNERS, Request
from ..topology.layout import Layout
from ..transport import gpu
from ..transport.context import context
from ..transport.exchange import sendrecv_combine
from ..transport.ops import reduction
from ..transport.p2p import sendrecv
from .costmodel import MODELS, Params, shm_barriers
from .waits import barrier, slowest, waiting

log = logging.getLogger("collectives.auto")

_SMALL, _LARGE = 8, 16 << 20
_T = TypeVar("_T")


def calibrate(
    comm: MPI.Comm, lay: Layout, repeat: int = 15, xp: Any = np, entry: Callable[[], None] | None = None
) -> Params:
    """Measure the parameters on ``comm`` (collective; about a second).

    Every timing is repeated and the least kept: on a busy machine the least
    is the one that other processes disturbed least.

    alpha, beta and gamma come from timed exchanges (both ranks send at once,
    as the algorithms do) between two ranks of one node and between the first
    ranks of two nodes: alpha is one 8-byte step as the algorithms take it
    (send, receive and combine, the Python around the message included, as
    alpha_shm includes it), beta the slope between plain 8 B and 16 MiB
    exchanges, gamma what a 16 MiB reducing step (received in segments and
    combined, :func:`collectives.transport.exchange.sendrecv_combine`) costs per byte
    beyond a plain exchange (inside a node if it has two ranks); overhead
    from an unchecked all-reduce of an empty buffer; alpha_shm and beta_shm
    from the shared-memory algorithm on 8 B and 16 MiB, every node at once
    (host buffers only: it does not run on device buffers); ``offset`` from
    each message-passing algorithm run on 8 B of the same memory, what it
    takes minus its model's prediction. Parameters
    that the layout cannot measure (no two ranks on one node, or one node)
    are taken from the other link class, or the defaults. ``xp`` = cupy
    measures device buffers (through the device transport in use), whose
    costs differ from host memory's by orders of magnitude.

    ``entry`` is one unchecked call of the all-reduce entry point on an empty
    buffer (what :mod:`collectives.api` passes): its least time, the slowest
    rank's, is ``overhead``; without it the overhead is 0.
    """
    user, ctx = comm, context(comm)
    comm = ctx.comm
    if xp is not np:
        gpu.configure(comm)  # the device transport the algorithms will use (collective)
    rank = comm.Get_rank()
    intra = next(((m[0], m[1]) for m in map(lay.members, range(lay.nodes)) if len(m) > 1), None)
    inter = (lay.members(0)[0], lay.members(1)[0]) if lay.nodes > 1 else None
    a = xp.zeros(_LARGE, np.uint8)
    b = xp.zeros(_LARGE, np.uint8)
    floats = a.view(np.float32)
    add = reduction("sum", "float32", xp)

    def combining(n: int) -> Callable[[int], None]:
        return lambda peer: sendrecv_combine(comm, floats[:n], peer, floats[:n], peer, add, peer < rank, n)

    def exchange(pair: tuple[int, int] | None) -> tuple[float, float, float] | None:
        kinds = {
            "step": combining(_SMALL // 4),
            "reduce": combining(_LARGE // 4),
            "small": lambda peer: sendrecv(comm, a[:_SMALL], peer, b[:_SMALL], peer),
            "large": lambda peer: sendrecv(comm, a, peer, b, peer),
        }
        times = {}
        for kind, run in kinds.items():
            samples = []
            for _ in range(repeat):
                barrier(comm)
                if pair is not None and rank in pair:
                    t0 = time.perf_counter()
                    run(pair[1] if rank == pair[0] else pair[0])
                    samples.append(time.perf_counter() - t0)
            times[kind] = min(samples) if samples else 0.0
        if pair is None:
            return None
        with waiting(comm, "Bcast of the timings"):
            t = comm.bcast(times if rank == pair[0] else None, root=pair[0])
        moved = t["large"] - t["small"]
        return (
            t["step"],
            max(moved / (_LARGE - _SMALL), 1e-13),
            max((t["reduce"] - t["step"] - moved) / (_LARGE - _SMALL), 1e-13),
        )

    def shared_memory() -> tuple[float, float] | None:
        seg = _shm.node_segment(ctx, lay) if xp is np and _shm.capable(ctx, lay) else None
        red = reduction("sum", "float32")
        times = []
        for nbytes in (_SMALL, _LARGE):
            v = np.zeros(nbytes // 4, np.float32)
            if seg is not None:
                _shm.allreduce(v, seg, red)  # warm-up: the segment's pages are touched
            samples = []
            for _ in range(repeat):
                barrier(comm)
                t0 = time.perf_counter()
                if seg is not None:
                    _shm.allreduce(v, seg, red)
                samples.append(time.perf_counter() - t0)
            times.append(slowest(comm, min(samples) if seg is not None else 0.0))
        if not times[0]:
            return None
        q = max(lay.ranks_per_node)
        alpha = times[0] / shm_barriers(q, _SMALL)[1]
        return alpha, max((times[1] - shm_barriers(q, _LARGE)[1] * alpha) / _LARGE, 1e-13)

    measured_intra = exchange(intra)
    measured_inter = exchange(inter)
    measured_shm = shared_memory()
    overhead = 0.0
    if entry is not None:
        samples = []
        for _ in range(repeat):
            barrier(comm)
            t0 = time.perf_counter()
            entry()
            samples.append(slowest(comm, time.perf_counter() - t0))
        overhead = min(samples)
    defaults = Params()
    ai, bi, gamma = measured_intra or measured_inter or (defaults.alpha_intra, defaults.beta_intra, defaults.gamma)
    ae, be, _ = measured_inter or (ai, bi, gamma)
    a_shm, b_shm = measured_shm or (defaults.alpha_shm, defaults.beta_shm)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    memory = "host" if xp is np else "device"
    prm = Params(
        ai,
        bi,
        ae,
        be,
        gamma,
        overhead,
        a_shm,
        b_shm,
        source=f"calibrated {stamp} on {comm.Get_size()} ranks, {lay}, {memory} buffers",
    )
    if comm.Get_size() > 1:
        # On the device a message's latency is the transport's (staging copies, or a
        # GPU-aware library's handling of device pointers) and differs between one-way
        # steps and exchanges by hundreds of microseconds: fewer calls measure it.
        prm.offset = _offsets(user, lay, prm, xp, calls=40 if xp is np else 8)
    return prm


def _offsets(
    comm: MPI.Comm, lay: Layout, prm: Params, xp: Any = np, batches: int = 7, calls: int = 40
) -> dict[str, float]:
    """Each message-passing algorithm's time per call on 8 B of ``xp``'s memory (unchecked,
    the least of ``batches`` barrier-aligned batches of ``calls`` calls, the slowest
    rank's) minus what its model predicts with ``prm`` (collective: plans are built)."""
    x, add = xp.zeros(_SMALL // 4, np.float32), reduction("sum", "float32", xp)
    ctx = context(comm)
    offsets = {}
    for name in MODELS:
        if name == "shm":  # its parameters are fitted to its own runs
            continue
        with waiting(ctx.comm, f"building the {name} plan"):  # it may split communicators
            run = PLANNERS[name](Request(comm, ctx, lay, None))
        run(x, add)
        samples = []
        for _ in range(batches):
            barrier(ctx.comm)
            t0 = time.perf_counter()
            for _ in range(calls):
                run(x, add)
            samples.append(slowest(ctx.comm, (time.perf_counter() - t0) / calls))
        offsets[name] = min(samples) - MODELS[name](prm, lay, float(_SMALL), None)
    return offsets


def params_for(
    comm: MPI.Comm, lay: Layout, cache: dict, xp: Any = np, entry: Callable[[], None] | None = None
) -> Params:
    """The parameters ``auto`` uses on ``comm`` for buffers of array module ``xp``
    (collective on first use per memory; cached in ``cache``).

    For host buffers, rank 0 looks at the file named by its ``MPIDL_COSTMODEL``
    and every rank uses what it found, so a path that exists on some nodes
    only still gives every rank the same parameters. Where rank 0 finds no
    such file the parameters are measured (:func:`calibrate`) and rank 0
    writes them to it, atomically. A file that cannot be read, holds no valid
    parameters or cannot be written raises ArgumentError on every rank,
    naming the file and what is wrong. Device buffers are always measured
    (``entry``: see :func:`calibrate`).
    """
    key = ("costmodel", xp.__name__)
    prm = cache.get(key)
    if prm is None:
        private = context(comm).comm
        path, prm = _on_rank0(private, _from_file) if xp is np else (None, None)
        if prm is None:
            prm = calibrate(comm, lay, xp=xp, entry=entry)
            log.debug("calibrated cost model: %s", prm)
            if path:
                _on_rank0(private, lambda: _to_file(prm, path))
        cache[key] = prm
    return prm


def _from_file() -> tuple[str | None, Params | None]:
    """The path named by ``MPIDL_COSTMODEL`` (None if unset) and the parameters in that
    file (None if it does not exist)."""
    path = os.environ.get("MPIDL_COSTMODEL") or None
    if path is None:
        return None, None
    try:
        return path, Params.load(path)
    except FileNotFoundError:
        return path, None
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"MPIDL_COSTMODEL={path}: cannot use this cost-model file: {exc}") from None


def _to_file(prm: Params, path: str) -> None:
    try:
        prm.save(path)
    except OSError as exc:
        raise ArgumentError(f"MPIDL_COSTMODEL={path}: cannot write the calibrated cost model: {exc}") from None


def _on_rank0(comm: MPI.Comm, fn: Callable[[], _T]) -> _T:
    """What ``fn`` returns on rank 0 of ``comm``, on every rank (collective); if it
    raises ArgumentError there, every rank raises it."""
    result: tuple[Any, ArgumentError | None] = (None, None)
    if comm.Get_rank() == 0:
        try:
            result = (fn(), None)
        except ArgumentError as exc:
            result = (None, exc)
    with waiting(comm, "the cost-model file"):
        value, error = comm.bcast(result, root=0)
    if error is not None:
        raise error
    return value
