"""D-PSGD: decentralized parallel SGD over a communication graph.

Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?
A Case Study for Decentralized Parallel Stochastic Gradient Descent",
NeurIPS 2017; seed 001, section 4.3. With W a symmetric doubly stochastic
mixing matrix over the graph (:mod:`algorithms.topology`), each step on worker i:

1. g_i = grad f_i(x_i), the local gradient at the worker's *current* model
   (computed by the caller before :meth:`~algorithms.base.Algorithm.step`);
2. x_i <- sum_j W_ij x_j: neighbor averaging of the models, in place
   (:func:`collectives.neighbor_allreduce`; the flat parameter buffer is
   sent to every neighbor and the neighbors' buffers are mixed in);
3. x_i <- x_i - lr * d(g_i): the local optimizer's step on the averaged model.

So x_i(t+1) = sum_j W_ij x_j(t) - lr g_i(x_i(t)): averaging and the gradient
use the same x(t). With momentum the direction d is the optimizer's (its
buffer stays local); weight decay, which reads the parameters, sees the
averaged model.

Properties: the mean over workers of x evolves as plain SGD driven by the
mean gradient (1^T W = 1^T), so averaging alone never moves the mean; with
zero learning rate the disagreement ||x_i - mean|| shrinks by |lambda_2(W)|
per step. With a constant learning rate the workers settle within O(lr / gap)
of each other; a decaying one drives them to consensus.

Cost per step on worker i with degree d (m model bytes): alpha + d m beta +
d m gamma, and d m bytes sent (2 m on a ring) — independent of n, where an
all-reduce costs 2 m (n-1)/n per worker but latency growing with n.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any
from zlib import crc32

from mpi4py import MPI

from collectives import ArgumentError, neighbor_allreduce

from .base import Algorithm
from .topology import Topology, build


class DPSGD(Algorithm):
    """Average models with the graph neighbors, then step the local optimizer.

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        topology: a :class:`~algorithms.topology.Topology` on ``comm``'s size,
            or the name of one in :data:`algorithms.topology.TOPOLOGIES`
            built for that size.
        weights: "uniform" or "metropolis" mixing weights for a named topology.

    Attributes:
        topology: the resolved topology (every rank holds the whole W).
    """

    name = "dpsgd"

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        topology: str | Topology = "ring",
        weights: str = "uniform",
        **common: Any,
    ) -> None:
        self.topology_arg, self.weights = topology, weights
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        topo = self.topology_arg
        if isinstance(topo, str):
            topo = build(topo, self.size, self.weights)
        elif not isinstance(topo, Topology):
            raise ArgumentError(
                f"topology must be a name or an algorithms.topology.Topology, got {type(topo).__name__}"
            )
        if topo.size != self.size:
            raise ArgumentError(f"topology {topo.name} has {topo.size} ranks, the communicator {self.size}")
        self.topology = topo
        self._row = topo.neighbor_weights(self.rank)
        return (topo.name, crc32(topo.W.tobytes()))

    def _step(self) -> None:
        with self._communicating():
            neighbor_allreduce(self.flat.state, self._row, self.comm, validate=False)
        self.optimizer.step()
