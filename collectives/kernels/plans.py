"""Plans: each all-reduce algorithm bound to the communicators it runs on.

A *kernel* (``ring.allreduce(x, comm, red)``, ...) reduces a flat array across
one communicator. A *planner* turns a :class:`Request` (the caller's
communicator and topology options) into a *plan*, a callable ``run(x, red)``
that holds whatever the algorithm needs beyond the communicator: node and
leader communicators (hierarchical ring), row and column communicators
(2D-torus), a shared-memory segment (shm); "mpi" is the MPI library's own
all-reduce (:mod:`collectives.kernels.native`). Planning is collective (it may
create sub-communicators or map shared memory); :mod:`collectives.api` plans
once per (communicator, algorithm, layout, grid) and caches the plan, and
:mod:`collectives.tuning` times the plans (to fit the cost model, and to
measure what ``auto`` chooses from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import ArgumentError
from ..topology import hierarchy
from ..topology.layout import RanksPerNode
from ..topology.layout import layout as node_layout
from ..transport import gpu
from ..transport.context import Context
from ..transport.ops import Reduction, reduction
from . import butterfly, halving_doubling, hierarchical_ring, native, reduce_broadcast, ring, shm, torus2d

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
    grid: tuple[int, int] | None


Planner = Callable[[Request], Run]


def flat(kernel: Kernel) -> Planner:
    """The planner of an algorithm that needs nothing but the communicator."""

    def plan(req: Request) -> Run:
        comm = req.ctx.comm
        return lambda x, red: kernel(x, comm, red)

    return plan


def plan_hierarchical_ring(req: Request) -> Run:
    """Node and leader communicators from the layout."""
    node, leaders = hierarchy.node_comms(req.ctx, node_layout(req.comm, req.layout))
    return lambda x, red: hierarchical_ring.allreduce(x, node, leaders, red)


def plan_torus2d(req: Request) -> Run:
    """Row and column communicators of the grid (default: ranks per node x nodes)."""
    lay = node_layout(req.comm, req.layout)
    grid = hierarchy.check_grid(req.grid, req.ctx.size) if req.grid is not None else hierarchy.default_grid(lay)
    row, col = hierarchy.grid_comms(req.ctx, grid, lay)
    return lambda x, red: torus2d.allreduce(x, row, col, red)


class Shm:
    """The "shm" plan: one node's ranks reduce in shared memory; several nodes add a
    ring among the node leaders (:func:`collectives.kernels.shm.hierarchical`). Device
    arrays are staged through host memory."""

    def __init__(self, req: Request) -> None:
        lay = node_layout(req.comm, req.layout)
        if not shm.capable(req.ctx, lay):
            raise ArgumentError(f"algorithm 'shm': the layout {lay} groups ranks that share no memory")
        self.seg = shm.node_segment(req.ctx, lay)
        self.leaders = hierarchy.node_comms(req.ctx, lay)[1] if lay.nodes > 1 else None
        self.node_of = lay.node_of

    def __call__(self, x: Any, red: Reduction) -> None:
        if type(x) is not np.ndarray:
            gpu.on_host(x, lambda host: self(host, reduction(red.op, red.dtype)))
        elif self.leaders is not None:
            shm.hierarchical(x, self.seg, self.leaders, red)
        elif self.seg is not None:
            shm.allreduce(x, self.seg, red)

    def carrier(self, ctx: Context) -> shm.Segment | None:
        """The segment in which host arrays can be reduced with the check riding
        along: on one node of all of ``ctx``'s ranks, the segment the check uses."""
        return self.seg if self.leaders is None and self.seg is shm.shared(ctx) else None


class Native:
    """The "mpi" plan: the MPI library's own all-reduce (:mod:`collectives.kernels.native`)
    on the private communicator. Device arrays go to the library as they are where it
    is GPU-aware (:mod:`collectives.transport.gpu`'s direct path), else through a host copy."""

    def __init__(self, req: Request) -> None:
        self.comm = req.ctx.comm
        self.others = native.peers(self.comm)

    def __call__(self, x: Any, red: Reduction) -> None:
        if type(x) is np.ndarray:
            native.allreduce(x, self.comm, red, self.others)
        elif gpu.PATH.mode == "direct":
            gpu.synchronize()
            native.allreduce(x, self.comm, red, self.others)
        else:
            gpu.on_host(x, lambda host: native.allreduce(host, self.comm, red, self.others))


#: The algorithms' planners by name (``auto`` is :mod:`collectives.api`'s, on top of these).
PLANNERS: dict[str, Planner] = {
    "ring": flat(ring.allreduce),
    "halving_doubling": flat(halving_doubling.allreduce),
    "butterfly": flat(butterfly.allreduce),
    "reduce_broadcast": flat(reduce_broadcast.allreduce),
    "hierarchical_ring": plan_hierarchical_ring,
    "torus2d": plan_torus2d,
    "shm": Shm,
    "mpi": Native,
}
