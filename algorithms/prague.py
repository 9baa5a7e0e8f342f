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

Compressed gossip (``compression="NAME[:PARAM]"``, ``gamma``): a group
exchanges compressed differences to public copies kept per edge instead of
averaging the models (CHOCO-SGD's copies, :func:`algorithms.pair_gossip.group_exchange`):
each member sends each other member the payload C(x_i - x^_i) of their edge
(P bytes, the compressor's ``payload_nbytes`` of the state; in a pair P
against the model's m each way) and moves by gamma / k towards each of their
copies, so every pair's sum, and so the group's and all workers' sum, is
kept. A worker makes an edge's two copies of the model when it first meets
the partner: up to 2 (n - 1) copies, plus one: where a new edge's copies
start (the initial model with ``broadcast_init``, else 0), and one work
buffer. Not with ``on_failure="continue"``: the exchange moves the copies of
the edges too, which P-Reduce's recovery does not take back (refused at
construction).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

from collectives import ArgumentError, PReduce, PReduceStats
from collectives.errors import renamed_keyword
from collectives.partial.group_comm import GroupComm
from collectives.partial.preduce import check_options
from collectives.transport import p2p

from .base import Algorithm
from .compressed import Gossip, gossip, host_copy, load_into, require
from .error_feedback import zeros_like
from .pair_gossip import PairCopies, edge_seed, group_exchange, load_copies, save_copies


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
        compression: None (or "none"): groups average their models; a compressor spec
            "NAME[:PARAM]" of :data:`collectives.COMPRESSORS`: compressed gossip with
            CHOCO-SGD's public copies kept per edge (module docstring). Not with
            ``on_failure="continue"``.
        gamma: the compressed gossip's consensus step size in (0, 1] (None: the
            compressor's, :func:`algorithms.compressed.consensus_step`).

    Attributes:
        preduce: the :class:`collectives.PReduce` on the flat parameters.
        compressor: the compressed gossip's compressor (its spec; each edge has its own), or None.
        gamma: the compressed gossip's consensus step size, or None.
        edges: compressed gossip: per partner met so far (rank), this end's copies of the
            edge (:class:`~algorithms.pair_gossip.PairCopies`); else empty.
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
        compression: str | None = None,
        gamma: float | None = None,
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
        self.compression_arg, self.gamma_arg = compression, gamma
        self._gossip: Gossip | None = None
        self.compressor: Any = None
        self.gamma: float | None = None
        self.edges: dict[int, PairCopies] = {}
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if self.options["group_size"] is None:
            self.options["group_size"] = min(2, self.size)
        check_options(self.size, service_rank=0, **self.options)
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ArgumentError(f"local_steps must be an integer >= 1, got {self.local_steps!r}")
        self.uneven_steps = self.options["policy"] != "static"
        self._gossip = gossip(self.compression_arg, self.gamma_arg, self.flat, self.options["seed"])
        if self._gossip is not None:
            if self.options["on_failure"] == "continue":
                raise ArgumentError(
                    "Prague's compressed gossip cannot go on after a death (the recovery does not take "
                    "back the copies of the edges): use on_failure='abort' with a compression"
                )
            self.compressor, self.gamma = self._gossip.compressor, self._gossip.gamma
        compression = (self.compressor and self.compressor.spec, self.gamma)
        return (tuple(sorted(self.options.items())), self.local_steps, *compression)

    preduce: PReduce  #: the P-Reduce of the flat parameters (made in _start)

    def _start(self) -> None:
        # The options were checked in _configure and across ranks by the set-up check.
        exchange = None
        if self._gossip is not None:
            self._work = zeros_like(self.flat.state)
            self._origin = zeros_like(self.flat.state)  # where a new edge's copies start
            if self.broadcast_init:
                self._origin[...] = self.flat.state
            self._world = p2p.world_ranks(self.comm)
            exchange = self._gossip_in
        self.preduce = PReduce(self.flat.state, self.comm, validate=False, exchange=exchange, **self.options)

    def _gossip_in(self, members: tuple[int, ...], group: GroupComm) -> None:
        """The compressed gossip of a group of ``members`` (P-Reduce's exchange)."""
        assert self._gossip is not None  # set as the exchange only then
        edges = [self._edge(m) for m in members if m != self.rank]
        group_exchange(edges, group, self.flat.state, self._work, self._gossip.gamma, self._gossip.shrink)

    def _edge(self, peer: int) -> PairCopies:
        """This end's copies of the edge with ``peer``, made at the first meeting."""
        edge = self.edges.get(peer)
        if edge is None:
            edge = self.edges[peer] = self._new_edge(peer)
        return edge

    def _new_edge(self, peer: int) -> PairCopies:
        """A new edge with ``peer``: its compressor, and its copies at the origin."""
        assert self._gossip is not None
        seed = edge_seed(self.options["seed"], self._world[self.rank], self._world[peer])
        return PairCopies(self._gossip.compressor.spec, self._gossip.layout, seed, self.flat.state, self._origin)

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
        :meth:`collectives.PReduce.state_dict`); compressed gossip: ``copies``, the edges'
        copies (mine, theirs per partner met, in the order of ``copy_peers``), and
        ``copy_origin``, where the copies of an edge not yet made start. The edges'
        compressors restart: random-k's draws and PowerSGD's warm start begin again alike
        on both ends."""
        state = {**super().state_dict(), "preduce": self.preduce.state_dict()}
        if self._gossip is not None:
            state.update(save_copies(self.edges, self.flat.state_data.shape[0]), copy_origin=host_copy(self._origin))
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        self.preduce.load_state_dict(state["preduce"])
        if self._gossip is not None:  # the edges and the origin change only once all of them load
            what = "the compressed gossip's copies; uncompressed Prague has none"
            require(state, ("copy_peers", "copies", "copy_origin"), what)
            strangers = [p for p in state["copy_peers"] if not 0 <= int(p) < self.size or int(p) == self.rank]
            if strangers:
                raise ValueError(f"the copies are of edges with ranks {strangers}, not partners among {self.size}")
            edges = {int(peer): self._new_edge(int(peer)) for peer in state["copy_peers"]}
            load_copies(edges, state, what)
            load_into(self._origin, state["copy_origin"], "the copies' origin")
            self.edges = edges

    def close(self) -> None:
        """Serve the remaining drafts and stop the group generator (collective)."""
        if self.closed:
            return
        with self._communicating():
            self.preduce.close()
        self._follow()
        super().close()
