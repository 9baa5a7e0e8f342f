"""GR-SGD: gossip on a ring without a global barrier, each worker's lead bounded.

After Zhou et al.'s Gossip Ring SGD (ring all-reduce
combined with gossip, the number of exchanges between neighbors controlled so
that a slow worker does not stall the ring). Workers sit on a ring; each
averages with its two ring neighbors by *exchanges* that need neither a
barrier nor the neighbor's attention at the same moment, and a worker may run
at most ``max_lead`` steps ahead of the exchanges it has completed with each
neighbor.

An exchange on the edge (i, j): both workers post, whenever each gets to it,
a nonblocking send of a snapshot of its parameters and a receive of the
other's; once both messages have arrived, each worker adds

    x_i <- x_i + w (s_j - s_i),        x_j <- x_j + w (s_i - s_j),

s_i and s_j being the two snapshots. The two increments are exact negatives
(IEEE subtraction and scaling are antisymmetric), so every exchange preserves
the sum of the workers' parameters whatever else happened to x_i and x_j
since the snapshots; w = 1 / (d + 1) (d = 2 ring neighbors, 1 when n = 2) is
D-PSGD's uniform ring weight: when both of a worker's exchanges use the same
snapshot, its update is exactly one D-PSGD mixing step.

The exact rule (worker i, neighbors j, ``s`` = ``max_lead``): an edge has at
most one exchange in flight. At the end of step k, after the local optimizer
step, worker i, for each neighbor j,

1. if the exchange in flight with j has completed, applies it (``done_j`` += 1);
2. if none is in flight with j, starts one with a snapshot of x_i;
3. then waits, applying exchanges as they complete, until
   ``done_j >= k - s`` for every neighbor j.

With equal speeds an exchange started at step k completes by step k + 1, so
``done_j = k - 1`` and nobody waits for s >= 1. A slow neighbor completes an
exchange at most once per own step, so a worker blocks only when it is more
than s steps ahead of the exchanges it has done with that neighbor: a slow
worker delays only its neighbors, and each only by what exceeds the bound
(their own neighbors are slowed only if they in turn get s steps ahead).
``max_lead=0`` is the synchronous limit: every step waits for both
exchanges it started, and the update is a D-PSGD step on a ring.

Every worker must take the same number of steps between two ``settle()``
calls (as in a synchronous algorithm; :attr:`GRSGD.uneven_steps` is false): a
worker waiting for an exchange with a neighbor that has stopped stepping
would wait forever. With equal counts that cannot happen: the exchange a
worker waits for at step k is one its neighbor started by its own step k.

:meth:`GRSGD.settle` (collective): neighbors tell each other how many
exchanges they have started; the one behind starts the missing one (at most
one: a worker starts exchange e + 1 only after applying e, which needed its
neighbor's e); then both complete and apply every exchange in flight. After
it no exchange is in flight and the sum of all parameters is what it was,
up to rounding, and both ends of every edge have started and applied the
same number of exchanges: with the models, those counts are the whole state
(:meth:`GRSGD.state_dict`). Convergence: with a constant learning rate the workers stay
within O(lr / gap) of each other, as in D-PSGD; the staleness of an
exchange's snapshots is at most ``max_lead`` + 1 steps.

A worker that dies (``on_failure="continue"``, where the MPI library has
ULFM, :mod:`collectives.transport.faults`; elsewhere, and by default, it ends
the job): its neighbors' exchanges with it fail, and the one that sees it
first revokes the private communicator, so that every survivor's next test
or send fails too; each survivor recovers in the :meth:`GRSGD.step`,
:meth:`GRSGD.settle` or :meth:`GRSGD.close` where it sees it (collective over
the survivors, which wait for each other there): they agree and shrink the
communicator, settle the exchanges that the failure interrupted, and go on
on the ring of the survivors (the dead worker's two neighbors become
neighbors; 2 workers leave 1, which steps alone). An exchange between two
survivors is applied by both or by neither: each end applies its half only
once both transfers completed, so where one applied it and the other did
not, the one that did takes its half back (the increment stays in the
edge's receive buffer until the next exchange completes, which needs the
other end). An exchange with the dead worker stands for a survivor where
both of its transfers completed. With learning rate 0 the survivors' sum is
then what they held less the dead worker's model. Every edge of the new ring
restarts with no exchange in flight and both counts at the larger of its two
ends' step numbers, so the step in which a worker recovers never waits, and
the lead bound counts from there. The rule of equal steps stays, over the
survivors: each takes the same number of steps between two ``settle()``
calls (the death changes no survivor's count), or each calls ``settle()``
right after the step in which it recovered. :attr:`GRSGD.comm` is then the
survivors' communicator and :attr:`GRSGD.lost` names the dead. Cost of a
recovery: an agreement, a shrink and an all-gather of the survivors' counts
(O(log p) small messages each), 2 m bytes of buffers for a new neighbor, and
the exchanges in flight, redone; nothing while no one fails.

Cost per step and neighbor: one nonblocking exchange of m bytes each way
(alpha + m beta, overlapped with the next computation) and 2 m gamma to
apply; a worker sends 2 m bytes per step on a ring when no one waits. No
service thread: the exchanges progress whenever the worker enters MPI (each
step tests them), so a large model's exchange may take a step longer.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives import ArgumentError
from collectives.transport import faults, p2p
from collectives.transport.buffers import array_module
from collectives.transport.ops import narrow, widen

from .base import Algorithm

#: Tag of the settle messages (exchanges use the point-to-point layer's tag).
_SETTLE_TAG = 0x6753

_HALF = frozenset({"float16", "bfloat16"})


class GRSGD(Algorithm):
    """Ring gossip with a bounded lead (module docstring for the exact rule).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        max_lead: steps a worker may run ahead of the exchanges it completed
            with a neighbor (>= 0; 0 is synchronous).
        on_failure: "abort" (a worker's death ends the job) or "continue" (the
            survivors go on, where the MPI library has ULFM; elsewhere a warning
            says that it has not, and a death ends the job; module docstring).

    Attributes:
        peers: the ring neighbors (two, one for n = 2, none for n = 1).
        weight: w, the weight of a neighbor's snapshot.
        exchanges: exchanges applied, per neighbor.
        lost: the ``MPI_COMM_WORLD`` ranks of the workers that died (on_failure="continue").
        survives: whether a worker's death leaves the others training (on_failure="continue"
            and ULFM available).
    """

    name = "grsgd"

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        max_lead: int = 2,
        on_failure: str = "abort",
        **common: Any,
    ) -> None:
        self.max_lead, self.on_failure = max_lead, on_failure
        self.survives = False
        self.lost: list[int] = []
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if isinstance(self.max_lead, bool) or not isinstance(self.max_lead, (int, np.integer)) or self.max_lead < 0:
            raise ArgumentError(f"max_lead must be an integer >= 0, got {self.max_lead!r}")
        self.survives = faults.survival(self.on_failure, "GR-SGD", self.rank)
        self.peers = _ring(self.rank, self.size)
        self.weight = 1.0 / (len(self.peers) + 1)
        return (int(self.max_lead), self.on_failure)

    def _start(self) -> None:
        self._comm = faults.returning(self.comm.Dup()) if self.survives else self.comm.Dup()
        self._edges = {peer: _Edge(self.flat.state_data, self.flat.dtype) for peer in self.peers}

    @property
    def exchanges(self) -> dict[int, int]:
        """Exchanges applied so far, per neighbor."""
        return {peer: edge.done for peer, edge in self._edges.items()}

    def _step(self) -> None:
        self.optimizer.step()
        if not self.peers:
            return
        with self._communicating():
            while self.peers and not self._exchange(self.iterations + 1):
                self._recover()

    def _exchange(self, k: int) -> bool:
        """Step ``k``'s exchanges (module docstring); False where a peer failed (the private
        communicator is then revoked, and the survivors recover)."""
        try:
            with faults.failing(self._comm, self.survives):
                for peer, edge in self._edges.items():
                    if edge.pending and p2p.test(edge.pending):
                        self._apply(edge)
                    if not edge.pending:
                        self._begin(peer, edge)
                for peer, edge in self._edges.items():
                    if edge.done < k - self.max_lead:
                        self._finish(peer, edge)
        except faults.PeerFailure:
            return False
        return True

    def _begin(self, peer: int, edge: _Edge) -> None:
        """Start an exchange with ``peer``: snapshot x, post the send and the receive."""
        array_module(edge.snapshot).copyto(edge.snapshot, self.flat.state_data)
        edge.pending = [p2p.irecv(self._comm, edge.theirs, peer)]  # pending before the send, which may fail
        edge.pending.append(p2p.isend(self._comm, edge.snapshot, peer))
        edge.started += 1

    def _finish(self, peer: int, edge: _Edge) -> None:
        """Wait for the exchange in flight with ``peer`` and apply it."""
        p2p.operation(f"GR-SGD exchange with ring neighbor {peer}")
        p2p.waitall(edge.pending, self._comm, (peer,), poll=True)
        self._apply(edge)

    def _apply(self, edge: _Edge) -> None:
        """x += w (theirs - snapshot), in float32 for half precision."""
        x, w = self.flat.state_data, self.weight
        if edge.work is not None:  # half precision
            acc, term = edge.work
            widen(edge.theirs, term, self.flat.dtype)
            widen(edge.snapshot, acc, self.flat.dtype)
            term -= acc
            term *= w
            widen(x, acc, self.flat.dtype)
            acc += term
            narrow(acc, x, self.flat.dtype)
        else:
            edge.theirs -= edge.snapshot
            edge.theirs *= w
            x += edge.theirs
        edge.pending = []
        edge.done += 1

    def _take_back(self, edge: _Edge) -> None:
        """x -= the increment of the last exchange applied on ``edge``, which its buffers hold
        (``theirs``, or the float32 term for half precision) until the next one completes."""
        x = self.flat.state_data
        if edge.work is not None:
            acc, term = edge.work
            widen(x, acc, self.flat.dtype)
            acc -= term
            narrow(acc, x, self.flat.dtype)
        else:
            x -= edge.theirs
        edge.done -= 1

    def settle(self) -> None:
        """Complete every exchange so that none is in flight (collective; module docstring).
        Where a worker's death is survived, the survivors recover and settle again among
        themselves."""
        super().settle()
        while not self._settle_once():
            self._recover(agreed=True)

    def _settle_once(self) -> bool:
        """One settle over the current ring; False: a peer failed (the survivors agreed so,
        on every rank). Where deaths are survived it ends with an agreement, so that every
        survivor leaves it with the same verdict."""
        if not self.peers and not self.survives:
            return True
        mine = np.array([edge.started for edge in self._edges.values()], np.int64)
        theirs = np.zeros(len(self.peers), np.int64)
        requests: list = []
        ended = True
        try:
            with faults.failing(self._comm, self.survives), self._communicating():
                requests += [self._comm.Irecv(theirs[i : i + 1], p, _SETTLE_TAG) for i, p in enumerate(self.peers)]
                requests += [self._comm.Isend(mine[i : i + 1], p, _SETTLE_TAG) for i, p in enumerate(self.peers)]
                p2p.operation("GR-SGD settle")
                p2p.waitall(requests, self._comm, self.peers, poll=True)
                for (peer, edge), started in zip(self._edges.items(), theirs.tolist()):
                    if started > edge.started:  # the neighbor started one more: take part
                        if edge.pending:
                            self._finish(peer, edge)
                        self._begin(peer, edge)
                    if edge.pending:
                        self._finish(peer, edge)
        except faults.PeerFailure:
            faults.drain(requests)
            ended = False
        if not self.survives:
            return True
        with p2p.waiting(self._comm):
            return faults.agree(self._comm, ended)

    def _recover(self, agreed: bool = False) -> None:
        """After a peer failed (collective over the survivors; module docstring): agree
        (unless the caller did), shrink, settle the exchanges that the failure interrupted,
        and re-link the ring over the survivors."""
        old = self._comm
        faults.revoke(old)  # where this worker saw it first: the others see it too
        for edge in self._edges.values():
            faults.drain(edge.pending)
            edge.pending = []
        survivors, lost = faults.recover(old, "GR-SGD", agreed)
        public = self.comm
        self._relink(survivors)
        old.Free()
        if not lost:  # a false alarm (faults.false_alarm): the same ring, on the caller's communicator
            survivors.Free()
            self.comm = public
            faults.false_alarm("GR-SGD", self.rank)
            return
        self.lost += lost
        if self.rank == 0:
            faults.warn(
                f"GR-SGD: worker(s) {', '.join(map(str, lost))} of MPI_COMM_WORLD failed; "
                f"{self.size} continue on the ring of the survivors"
            )

    def _relink(self, survivors: MPI.Intracomm) -> None:
        """Make both ends of every exchange between survivors apply it or neither, and
        re-link the ring over ``survivors`` (collective over them; module docstring): where
        an end applied one more exchange than the other, it takes that one back; every edge
        of the new ring starts with both counts at the larger of its ends' step numbers."""
        world = p2p.world_ranks(self._comm)
        me, step = world[self.rank], self.iterations + 1
        with p2p.waiting(survivors):
            gathered = survivors.allgather((me, step, {world[p]: edge.done for p, edge in self._edges.items()}))
        views = {w: (k, done) for w, k, done in gathered}
        for peer, edge in self._edges.items():
            if world[peer] not in views:  # it died: this worker's own view stands
                continue
            theirs = views[world[peer]][1][me]
            if edge.done - theirs not in (-1, 0, 1):  # an exchange starts only after the one before completed
                raise RuntimeError(f"GR-SGD: {edge.done} exchanges applied with rank {peer}, it {theirs}")
            if edge.done > theirs:
                self._take_back(edge)
        kept = {world[p]: edge for p, edge in self._edges.items() if world[p] in views}
        self.comm, self.rank, self.size = survivors, survivors.Get_rank(), survivors.Get_size()
        self._comm = faults.returning(survivors.Dup())
        self.peers = _ring(self.rank, self.size)
        self.weight = 1.0 / (len(self.peers) + 1)
        world = p2p.world_ranks(survivors)
        self._edges = {}
        for peer in self.peers:
            edge = kept.get(world[peer]) or _Edge(self.flat.state_data, self.flat.dtype)
            edge.started = edge.done = max(step, views[world[peer]][0])
            self._edges[peer] = edge

    def state_dict(self) -> dict[str, Any]:
        """The counters and ``exchanges``: the exchanges applied with each neighbor, in
        :attr:`peers` order (after settle(), when none is in flight)."""
        if any(edge.pending for edge in self._edges.values()):
            raise RuntimeError("GR-SGD state_dict() with an exchange in flight: call settle() first")
        return {**super().state_dict(), "exchanges": [edge.done for edge in self._edges.values()]}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        counts = [int(c) for c in state["exchanges"]]
        if len(counts) != len(self._edges):
            raise ValueError(f"exchanges holds counts for {len(counts)} neighbors, this worker has {len(self._edges)}")
        for edge, count in zip(self._edges.values(), counts):
            edge.started = edge.done = count

    def close(self) -> None:
        """Settle and free the private communicator (collective)."""
        if self.closed:
            return
        self.settle()
        self._comm.Free()
        super().close()


def _ring(rank: int, size: int) -> tuple[int, ...]:
    """The ring neighbors of ``rank`` among ``size`` workers (two, one for 2, none for 1)."""
    return tuple(sorted({(rank - 1) % size, (rank + 1) % size} - {rank}))


class _Edge:
    """One ring neighbor's exchange state: buffers allocated once, the transfers in flight, counts."""

    def __init__(self, x: Any, dtype: str) -> None:
        xp = array_module(x)
        self.snapshot, self.theirs = xp.empty_like(x), xp.empty_like(x)
        #: float32 (accumulator, term) for half precision; None for other dtypes.
        self.work: tuple[Any, Any] | None = (
            (xp.empty(x.shape, np.float32), xp.empty(x.shape, np.float32)) if dtype in _HALF else None
        )
        self.pending: list = []
        self.started = self.done = 0
