"""The all-reduce entry point, the registry of algorithms, and ``auto``.

A call resolves the caller's buffer, op and algorithm, checks them across
ranks (:mod:`collectives.validation`), then runs a *plan*: the algorithm bound
to the communicators it needs. Plans are built once per (communicator,
algorithm, layout, grid) and cached, so sub-communicators are never created
per call.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from . import (butterfly, costmodel, gpu, halving_doubling, hierarchical_ring, hierarchy, reduce_broadcast,
               p2p, ring, torus2d, validation)
from .buffers import DTYPE_CODES, FlatBuffer, array_module, as_flat, dtype_code
from .context import Context, context
from .errors import ArgumentError
from .layout import RanksPerNode
from .layout import layout as node_layout
from .ops import OPS, Reduction, reduction

log = logging.getLogger("collectives.auto")

#: A flat algorithm kernel: reduces a non-empty 1-D array in place across a
#: communicator (``avg`` is finished by the caller).
Kernel = Callable[[Any, MPI.Comm, Reduction], None]
#: A plan: an algorithm bound to its communicators; reduces (x, reduction).
Run = Callable[[Any, Reduction], None]


@dataclass(frozen=True)
class Request:
    """What a planner needs: the caller's communicator and the topology options."""

    comm: MPI.Comm
    ctx: Context
    layout: RanksPerNode
    grid: Optional[tuple[int, int]]


Planner = Callable[[Request], Run]


def _flat(kernel: Kernel) -> Planner:
    def plan(req: Request) -> Run:
        comm = req.ctx.comm
        return lambda x, red: kernel(x, comm, red)
    return plan


def _plan_hierarchical_ring(req: Request) -> Run:
    node, leaders = hierarchy.node_comms(req.ctx, node_layout(req.comm, req.layout))
    return lambda x, red: hierarchical_ring.allreduce(x, node, leaders, red)


def _plan_torus2d(req: Request) -> Run:
    lay = node_layout(req.comm, req.layout)
    grid = hierarchy.check_grid(req.grid, req.ctx.size) if req.grid is not None else hierarchy.default_grid(lay)
    row, col = hierarchy.grid_comms(req.ctx, grid, lay)
    return lambda x, red: torus2d.allreduce(x, row, col, red)


class _Auto:
    """The "auto" plan: per buffer size (and memory), the algorithm the cost model predicts fastest."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.layout = node_layout(req.comm, req.layout)
        self.runs = {name: ALGORITHMS[name](req) for name in costmodel.MODELS}
        self.chosen: dict[tuple[int, Any], str] = {}
        self.params(np)  # calibrate for host buffers now, while every rank is here

    def params(self, xp: Any) -> costmodel.Params:
        """The cost-model parameters for buffers of array module ``xp`` (collective on first use)."""
        return costmodel.params_for(self.req.comm, self.layout, self.req.ctx.cache, xp)

    def algorithm_for(self, nbytes: int, xp: Any = np) -> str:
        """The algorithm run for ``nbytes`` of ``xp`` memory (chosen once per size, logged at DEBUG)."""
        name = self.chosen.get((nbytes, xp))
        if name is None:
            choice = costmodel.choose(nbytes, self.layout, self.params(xp), self.req.grid)
            log.debug("%s", choice.reason)
            name = self.chosen[nbytes, xp] = choice.algorithm
        return name

    def __call__(self, x: Any, red: Reduction) -> None:
        xp = np if type(x) is np.ndarray else array_module(x)
        self.runs[self.algorithm_for(x.nbytes, xp)](x, red)


#: Registered all-reduce algorithms: name -> planner.
ALGORITHMS: dict[str, Planner] = {
    "ring": _flat(ring.allreduce),
    "halving_doubling": _flat(halving_doubling.allreduce),
    "butterfly": _flat(butterfly.allreduce),
    "reduce_broadcast": _flat(reduce_broadcast.allreduce),
    "hierarchical_ring": _plan_hierarchical_ring,
    "torus2d": _plan_torus2d,
    "auto": _Auto,
}

DEFAULT_ALGORITHM = "auto"
_OPERATION = {name: f"allreduce(algorithm={name!r})" for name in ALGORITHMS}


def allreduce(buf: Any, comm: Optional[MPI.Comm] = None, op: str = "sum",
              algorithm: str = DEFAULT_ALGORITHM, *, validate: Optional[bool] = None,
              layout: RanksPerNode = None, grid: Optional[tuple[int, int]] = None) -> Any:
    """Reduce ``buf`` element-wise across all ranks of ``comm``, in place, and return it.

    Args:
        buf: a C-contiguous, writable numpy array or torch tensor of any
            shape, dtype one of float16, bfloat16 (torch), float32, float64,
            int32, int64. Overwritten with the reduction over all ranks;
            every rank ends with bitwise-identical contents.
        comm: the communicator (default ``MPI.COMM_WORLD``). Every rank of it
            must call with the same length, dtype, op, algorithm and options.
        op: one of "sum", "avg", "min", "max", "prod" ("avg" needs floats).
        algorithm: a name in :data:`ALGORITHMS`; "auto" picks by the cost
            model (:func:`explain` says what and why).
        validate: check arguments for agreement across ranks first (one small
            all-gather). None uses the default (on unless ``MPIDL_VALIDATE=0``).
        layout: ranks per node, overriding detection, for the topology-aware
            algorithms and "auto": one number or node sizes ("3,1").
        grid: (X, Y) for "torus2d", X * Y == number of ranks; default from
            the layout (ranks per node x nodes).

    Returns:
        ``buf`` itself.

    Raises:
        ArgumentError: invalid or disagreeing arguments; with validation on,
            raised on every rank before any data moved (``buf`` untouched).
    """
    user = MPI.COMM_WORLD if comm is None else comm
    ctx = context(user)
    p2p.operation(_OPERATION.get(algorithm) or f"allreduce({algorithm!r})")
    flat, red, problem = _prepare(buf, op, algorithm, user, layout, grid)
    reduced = False
    if validation.enabled(validate):
        options = 0 if layout is None and grid is None else validation.code(repr((layout, grid)))
        signature = (0, 0, 0, 0, 0) if problem else (
            flat.size, dtype_code(flat), validation.code(op), validation.code(algorithm), options)
        fuse = problem is None and _fusable(ctx, flat, (algorithm, layout, grid))
        reduced = validation.check(ctx, "allreduce", problem, signature, _field_names,
                                   flat.data if fuse else None, red)
    elif problem:
        raise problem
    if type(flat.data) is not np.ndarray:
        gpu.ensure(ctx.comm, flat)
    if flat.size:
        if not reduced:
            key = (algorithm, layout, grid)
            run = ctx.cache.get(key)
            if run is None:
                run = ctx.cache[key] = ALGORITHMS[algorithm](Request(user, ctx, layout, grid))
            run(flat.data, red)
        red.finalize(flat.data, ctx.size)
    return buf


def broadcast(buf: Any, comm: Optional[MPI.Comm] = None, *, validate: Optional[bool] = None) -> Any:
    """Copy rank 0's ``buf`` into ``buf`` on every rank of ``comm``, in place, and return it.

    A binomial tree (:func:`collectives.reduce_broadcast.broadcast`):
    ceil(lg p) (alpha + n beta). Buffers and validation as for
    :func:`allreduce` (same length and dtype on every rank).
    """
    ctx = context(MPI.COMM_WORLD if comm is None else comm)
    p2p.operation("broadcast")
    try:
        flat, problem = as_flat(buf), None
    except ArgumentError as exc:
        flat, problem = None, exc
    if validation.enabled(validate):
        signature = (0,) * 5 if problem else (flat.size, dtype_code(flat), 0, validation.code("broadcast"), 0)
        validation.check(ctx, "broadcast", problem, signature, _field_names)
    elif problem:
        raise problem
    if type(flat.data) is not np.ndarray:
        gpu.ensure(ctx.comm, flat)
    if flat.size:
        reduce_broadcast.broadcast(flat.data, ctx.comm)
    return buf


def explain(nbytes: int, comm: Optional[MPI.Comm] = None, *, layout: RanksPerNode = None,
            grid: Optional[tuple[int, int]] = None, device: str = "cpu") -> costmodel.Choice:
    """What ``algorithm="auto"`` runs for a buffer of ``nbytes`` on ``comm`` (in
    host memory, or GPU memory with ``device="cuda"``), every candidate's
    predicted time, and the reason (collective on first use: it may calibrate
    the cost model)."""
    user = MPI.COMM_WORLD if comm is None else comm
    lay = node_layout(user, layout)
    xp = np if device == "cpu" else importlib.import_module("cupy")
    return costmodel.choose(nbytes, lay, costmodel.params_for(user, lay, context(user).cache, xp), grid)



def _fusable(ctx: Context, flat: FlatBuffer, key: tuple) -> bool:
    """Whether the argument check can carry this all-reduce (a small host buffer
    whose algorithm is the butterfly, directly or as auto's cached choice)."""
    if not 0 < flat.nbytes <= validation.FUSE_LIMIT or ctx.size == 1 or type(flat.data) is not np.ndarray:
        return False
    if key[0] == "butterfly":
        return True
    plan = ctx.cache.get(key) if key[0] == "auto" else None
    return plan is not None and plan.algorithm_for(flat.nbytes) == "butterfly"


def _field_names() -> tuple[dict[int, str], ...]:
    """Readable names of the signature codes, for error messages."""
    return ({}, DTYPE_CODES, {validation.code(op): op for op in OPS}, {validation.code(a): a for a in ALGORITHMS})


def _prepare(buf: Any, op: str, algorithm: str, comm: MPI.Comm, layout: RanksPerNode,
             grid: Optional[tuple[int, int]]) -> tuple[FlatBuffer, Reduction, Optional[ArgumentError]]:
    """Resolve the buffer, op, algorithm and options; a local problem is returned, not raised."""
    try:
        if algorithm not in ALGORITHMS:
            raise ArgumentError(f"unknown algorithm {algorithm!r}; valid algorithms: {', '.join(ALGORITHMS)}")
        flat = as_flat(buf)
        red = reduction(op, flat.dtype, array_module(flat.data))
        if layout is not None:
            node_layout(comm, layout)  # an override is parsed locally: no communication
        if grid is not None:
            hierarchy.check_grid(grid, comm.Get_size())
        return flat, red, None
    except ArgumentError as exc:
        return None, None, exc  # type: ignore[return-value]
