"""Hierarchical ring all-reduce: inside nodes by trees, across nodes by a ring.

Phases (q ranks on the largest node, m nodes; the leader is each node's
lowest rank):

1. intra-node binomial reduce to the leader
   (:func:`collectives.kernels.reduce_broadcast.reduce` on the node communicator);
2. ring all-reduce among the m leaders (:mod:`collectives.kernels.ring`);
3. intra-node binomial broadcast from the leader.

Cost: 2 ceil(lg q) (alpha_intra + n beta_intra) + ceil(lg q) n gamma
+ 2 (m-1) alpha_inter + 2 n (m-1)/m beta_inter + n (m-1)/m gamma.
Only one rank per node drives the slow links, and it sends 2n(m-1)/m bytes
over them instead of the flat ring's 2n(p-1)/p spread over every rank.
Reference: Jia et al., "Highly Scalable Deep Learning
Training System with Mixed-Precision" (2018) for the hierarchical scheme.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport.ops import Reduction
from . import reduce_broadcast, ring


def allreduce(x: Any, node: MPI.Comm, leaders: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place over all nodes' ranks.

    Args:
        node: this rank's node communicator (leader = its rank 0).
        leaders: the leaders' communicator on leaders, COMM_NULL elsewhere.
    """
    reduce_broadcast.reduce(x, node, red)
    if leaders != MPI.COMM_NULL:
        ring.allreduce(x, leaders, red)
    reduce_broadcast.broadcast(x, node)
