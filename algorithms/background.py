"""Whether a service thread overlapping communication with computation has a core of its own.

The service thread itself is :class:`collectives.transport.background.Background`
(AllReduce-SGD's and D-PSGD's overlap, LSGD's inter-group all-reduce, AD-PSGD's
averagings). Where every core computes, its work only takes cores from the
computation: :func:`spare_cores` tells the algorithms whether to overlap.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from collectives.topology.layout import cores_per_rank
from collectives.transport.context import context


def spare_cores(comm: MPI.Comm, wanted: bool = True) -> bool:
    """Whether every rank of ``comm`` wants a service thread and has a core for it
    besides its computation (collective): on each machine, the cores its ranks may run
    on are at least its ranks times (torch's intra-op threads + 1). Where they are
    not, the thread's work takes cores from the computation, so overlapping it with the
    computation hides nothing."""
    ctx = context(comm)
    torch = sys.modules.get("torch")
    intra_op = torch.get_num_threads() if torch is not None else 1
    return bool(ctx.comm.allreduce(wanted and cores_per_rank(ctx) >= intra_op + 1, op=MPI.LAND))
