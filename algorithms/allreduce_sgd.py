"""AllReduce-SGD: the synchronous (bulk-synchronous parallel) baseline.

Each step, on every worker i of n:

1. g_i = the local gradient at x (computed by the caller);
2. g = (1/n) sum_j g_j by an all-reduce (average) of the flat gradient buffer,
   in place, with any algorithm of :data:`collectives.ALGORITHMS`;
3. x <- optimizer step with g (e.g. SGD with momentum).

Every worker applies the same averaged gradient to the same model, so the
models stay bitwise identical (the all-reduce gives every rank the same bits)
and the algorithm is mini-batch SGD with an n times larger batch.

Cost per step: one all-reduce of the model's size m bytes; with the ring,
2(n-1) alpha + 2 m (n-1)/n beta + m (n-1)/n gamma, and each worker sends
2 m (n-1)/n bytes, the bandwidth lower bound. Reference: seed 001, section
4.3 (BSP); Goyal et al., "Accurate, Large Minibatch SGD", 2017.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

import collectives
from collectives import ArgumentError
from collectives.topology.layout import RanksPerNode
from collectives.topology.layout import layout as node_layout

from .base import Algorithm


class AllReduceSGD(Algorithm):
    """Average the gradients with an all-reduce, then step the local optimizer.

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        algorithm: the all-reduce algorithm (a key of
            :data:`collectives.ALGORITHMS`; "auto" chooses by the cost model,
            resolved — and, on first use, calibrated — at construction).
        layout: ranks per node for the topology-aware all-reduce algorithms
            (one number or node sizes such as "3,1"); None detects it or
            reads ``MPIDL_RANKS_PER_NODE``.

    Attributes:
        choice: for "auto", the cost model's choice for this model's size
            (:func:`collectives.explain`), else None.
    """

    name = "allreduce"

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        algorithm: str = collectives.DEFAULT_ALGORITHM,
        layout: RanksPerNode = None,
        **common: Any,
    ) -> None:
        self.algorithm = algorithm
        self.layout = layout
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if self.algorithm not in collectives.ALGORITHMS:
            raise ArgumentError(
                f"unknown all-reduce algorithm {self.algorithm!r}; "
                f"valid algorithms: {', '.join(collectives.ALGORITHMS)}"
            )
        if self.layout is not None:
            node_layout(self.comm, self.layout)  # parses the override: local
        return (self.algorithm, self.layout)

    def _start(self) -> None:
        self.choice = (
            collectives.explain(self.flat.nbytes, self.comm, layout=self.layout) if self.algorithm == "auto" else None
        )

    def _step(self) -> None:
        with self._communicating():
            collectives.allreduce(self.flat.grads, self.comm, "avg", self.algorithm, validate=False, layout=self.layout)
        self.optimizer.step()
