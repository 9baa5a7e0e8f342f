"""Prague: local SGD steps, then a partial all-reduce (P-Reduce) with a group from the group generator.

Luo, He, Zhuo & Qian, "Prague: High-Performance Heterogeneity-Aware
Asynchronous Decentralized Training", ASPLOS 2020. A
step of worker i:

1. apply the local optimizer with the caller's gradient;
2. every ``local_steps``-th step, average the parameters with a group of
   ``group_size`` workers handed out by the group generator
   (:class:`collectives.PReduce`; its module says how groups form, how the
   lock service keeps them from overlapping and why it cannot deadlock).

Averaging within a group preserves the sum of the workers' parameters, so with
learning rate 0 the sum stays constant and the workers reach consensus. There
is no global barrier: a worker waits only for its group to form and run.

Policies (``policy``): ``smart`` (the default) groups only workers that are
waiting for a group, oldest request first, so fast workers average with fast
ones and a slow worker never holds a fast one up — Prague's answer to
heterogeneity; ``aware`` is ``smart`` that also knows places and speeds
(inside a node first, across nodes regularly and over the cheapest links,
waiting for a node mate only while that is cheaper than crossing:
:mod:`collectives.partial.placement`); ``random`` draws the requester's
partners at random (a slow worker drafted into a group makes its partners
wait for it); ``static`` runs a fixed conflict-free schedule that rotates
every ``period`` averagings with no service round trip, but every worker
must then average the same number of times between two
:meth:`Prague.settle` calls, as in a synchronous algorithm
(:attr:`Prague.uneven_steps` is false; it is true for the other policies).

Where the service runs: a thread on rank 0 of the workers (no extra rank).

Cost of an averaging among k workers of an m-byte model: two control
messages (request, notification) plus a ring all-reduce among the group,
2 (k-1) alpha + 2 m (k-1)/k beta + m (k-1)/k gamma; each member sends
2 m (k-1)/k bytes. Between averagings nothing is in flight;
:meth:`Prague.settle` pauses the service until every worker is there
(:meth:`collectives.PReduce.settle`), serving the groups still queued.
Settled, a worker's state beyond its model and optimizer is its counters
(the step count says when it next averages), the static schedule's
position and, on rank 0, the group generator's state
(:meth:`Prague.state_dict`).

A worker that dies (``on_failure="continue"``, where the MPI library has
ULFM, :mod:`collectives.transport.faults`; elsewhere, and by default, it
ends the job): P-Reduce's survivors recover in their next :meth:`Prague.step`,
:meth:`Prague.settle` or :meth:`Prague.close` (collective over them), the
group average in flight kept by all of its surviving members or taken back
by all, and go on with a new group generator over the survivors
(:mod:`collectives.partial.preduce` says how and what it costs);
:attr:`Prague.comm` is then the survivors' communicator and
:attr:`Prague.lost` names the dead. The static schedule cannot go on (its
groups need every worker in step): ``continue`` needs random, smart or
aware groups.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

from collectives import ArgumentError, PReduce, PReduceStats
from collectives.errors import renamed_keyword
from collectives.partial.preduce import check_options

from .base import Algorithm


class Prague(Algorithm):
    """Local steps, then P-Reduce in groups from the group generator (module docstring).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        group_size: workers per group (default: pairs; 1 on a single rank).
        policy: "smart", "aware", "random" or "static" (:data:`collectives.POLICIES`).
        local_steps: optimizer steps between averagings (>= 1).
        period: static only: averagings a partition is kept before it rotates.
        cross_every: aware only: every how many averagings a worker crosses nodes.
        seed: seed of the group generator's draws / the static schedule.
        collective: the all-reduce run within a group (:data:`collectives.GROUP_KERNELS`).
        algorithm: the old name of ``collective`` (deprecated).
        on_failure: "abort" (a worker's death ends the job) or "continue" (the
            survivors go on, where the MPI library has ULFM; elsewhere a warning
            says that it has not, and a death ends the job; module docstring).

    Attributes:
        preduce: the :class:`collectives.PReduce` on the flat parameters.
    """

    name = "prague"

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        group_size: int | None = None,
        policy: str = "smart",
        local_steps: int = 1,
        period: int = 1,
        cross_every: int = 2,
        seed: int = 0,
        collective: str = "ring",
        algorithm: str | None = None,
        on_failure: str = "abort",
        **common: Any,
    ) -> None:
        self.options: dict[str, Any] = {
            "group_size": group_size,
            "policy": policy,
            "period": period,
            "cross_every": cross_every,
            "seed": seed,
            "collective": renamed_keyword("Prague", "algorithm", "collective", algorithm, collective, "ring"),
            "on_failure": on_failure,
        }
        self.local_steps = local_steps
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if self.options["group_size"] is None:
            self.options["group_size"] = min(2, self.size)
        check_options(self.size, service_rank=0, **self.options)
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ArgumentError(f"local_steps must be an integer >= 1, got {self.local_steps!r}")
        self.uneven_steps = self.options["policy"] != "static"
        return (tuple(sorted(self.options.items())), self.local_steps)

    preduce: PReduce  #: the P-Reduce of the flat parameters (made in _start)

    def _start(self) -> None:
        # The options were checked in _configure and across ranks by the set-up check.
        self.preduce = PReduce(self.flat.state, self.comm, validate=False, **self.options)

    @property
    def survives(self) -> bool:
        """Whether a worker's death leaves the others training (on_failure="continue" and ULFM available)."""
        return self.preduce.survives

    @property
    def lost(self) -> list[int]:
        """The ``MPI_COMM_WORLD`` ranks of the workers that died (on_failure="continue")."""
        return self.preduce.lost

    def _follow(self) -> None:
        """Take the survivors' communicator, rank and size where P-Reduce recovered from a death."""
        if self.preduce.comm is not self.comm:
            self.comm, self.rank, self.size = self.preduce.comm, self.preduce.rank, self.preduce.size

    @property
    def stats(self) -> PReduceStats:
        """What this worker's averagings cost it (calls, groups, drafts, wait and reduce time)."""
        return self.preduce.stats

    def _step(self) -> None:
        self.optimizer.step()
        if (self.iterations + 1) % self.local_steps == 0:
            with self._communicating():
                self.preduce.average()
            self._follow()

    def settle(self) -> None:
        """Pause until every worker settles, serving the groups still queued (collective)."""
        super().settle()
        with self._communicating():
            self.preduce.settle()
        self._follow()

    def state_dict(self) -> dict[str, Any]:
        """The counters and ``preduce``, the P-Reduce's state (after settle();
        :meth:`collectives.PReduce.state_dict`)."""
        return {**super().state_dict(), "preduce": self.preduce.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        self.preduce.load_state_dict(state["preduce"])

    def close(self) -> None:
        """Serve the remaining drafts and stop the group generator (collective)."""
        if self.closed:
            return
        with self._communicating():
            self.preduce.close()
        self._follow()
        super().close()
