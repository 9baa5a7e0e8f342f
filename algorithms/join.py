"""Uneven inputs: workers that run out of data keep answering the others' collectives.

In a synchronous algorithm every step of every worker takes part in the same
collectives, so a worker with fewer batches than the others would leave them
waiting at their next step. Inside ``with algo.join():`` (as inside DDP's
``Join`` context manager; Horovod's ``hvd.join()``) a worker that leaves the
block — out of data — *joins*: until every worker has joined, it answers each
step of the workers still in with the same collectives, contributing zeros,
and the gradients of a step are averaged over the workers still in. When the
last worker has left, every worker takes the model, the optimizer's state and
the step count of the last to join, so that all are identical again (as
DDP's join hook broadcasts the final model; here the optimizer's state too,
so that momentum agrees in the next epoch).

Phases, per step of the workers still in (k of them, n in all): an all-reduce
(sum) of a vector of n 32-bit flags, each worker's 1 if it is still in (so
every worker learns k and who is in); then the step's all-reduces, the
joined workers contributing zeros (no update: they hold no step of their
own), and the sum divided by k. At the end: one more round of flags (all 0),
then broadcasts from the lowest-ranked of the last workers still in: the flat
state (parameters and float buffers), the optimizer's state
(:func:`algorithms.broadcast.broadcast_optimizer_state`, pickled) and the step
count.

Cost: one all-reduce of 4n bytes per step beyond the step's own (latency-bound;
why a step counts only inside ``join()``, as with DDP), and the broadcasts
once, at the end. Every worker must enter ``join()`` at the same step and
before that step's backward pass.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

import collectives
from collectives.topology.layout import RanksPerNode

from .broadcast import broadcast_optimizer_state
from .flat import FlatParams


class Joining(Protocol):
    """What :class:`Join` needs of the algorithm (AllReduce-SGD's)."""

    comm: MPI.Comm
    rank: int
    size: int
    iterations: int
    optimizer: Any
    flat: FlatParams
    collective: str
    layout: RanksPerNode

    def _communicating(self) -> AbstractContextManager[None]: ...
    def _join_starts(self, join: Join) -> None: ...
    def _shadow(self) -> None: ...
    def _joined(self) -> None: ...


class Join:
    """``algo.join()`` (module docstring): the context in which workers may run out of data.

    Attributes:
        rounds: steps of the workers still in that this worker took part in since
            it entered, its own and those it answered.
        last: the lowest-ranked of the last workers still in, whose state every
            worker took at the end (None: no step was taken inside).
    """

    def __init__(self, algo: Joining) -> None:
        self.algo = algo
        self.rounds = 0
        self.last: int | None = None
        self._flags = np.zeros(algo.size, np.int32)

    def count(self, active: bool) -> int:
        """The workers still in at this step (collective: every worker counts once per step
        of the workers still in); ``active``: whether this one is."""
        flags = self._flags
        flags.fill(0)
        flags[self.algo.rank] = active
        algo = self.algo
        collectives.allreduce(flags, algo.comm, "sum", algo.collective, validate=False, layout=algo.layout)
        k = int(flags.sum())
        if k:
            self.rounds += 1
            self.last = int(np.flatnonzero(flags)[0])
        return k

    def __enter__(self) -> Join:
        self.algo._join_starts(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        """This worker joins: answer the others' steps until every worker has joined, then
        take the state of the last one in. An exception leaving the block ends the join
        at once (the other workers' steps are left unanswered: the job is failing)."""
        algo = self.algo
        try:
            if kind is not None:
                return
            with algo._communicating():
                while self.count(active=False):
                    algo._shadow()
                if self.last is not None:
                    collectives.broadcast(algo.flat.state, algo.comm, root=self.last, validate=False)
                    broadcast_optimizer_state(algo.optimizer, algo.comm, root=self.last)
                    algo.iterations = algo.comm.bcast(algo.iterations, root=self.last)
        finally:
            algo._joined()
