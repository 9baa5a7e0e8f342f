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
from collectives.transport import p2p
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

    Attributes:
        peers: the ring neighbors (two, one for n = 2, none for n = 1).
        weight: w, the weight of a neighbor's snapshot.
        exchanges: exchanges applied, per neighbor.
    """

    name = "grsgd"

    def __init__(
        self, model: Any, optimizer: Any, comm: MPI.Comm | None = None, *, max_lead: int = 2, **common: Any
    ) -> None:
        self.max_lead = max_lead
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if isinstance(self.max_lead, bool) or not isinstance(self.max_lead, (int, np.integer)) or self.max_lead < 0:
            raise ArgumentError(f"max_lead must be an integer >= 0, got {self.max_lead!r}")
        self.peers = tuple(sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank}))
        self.weight = 1.0 / (len(self.peers) + 1)
        return (int(self.max_lead),)

    def _start(self) -> None:
        self._comm = self.comm.Dup()
        self._edges = {peer: _Edge(self.flat.state_data, self.flat.dtype) for peer in self.peers}

    @property
    def exchanges(self) -> dict[int, int]:
        """Exchanges applied so far, per neighbor."""
        return {peer: edge.done for peer, edge in self._edges.items()}

    def _step(self) -> None:
        self.optimizer.step()
        if not self.peers:
            return
        k = self.iterations + 1
        with self._communicating():
            for peer, edge in self._edges.items():
                if edge.pending and p2p.test(edge.pending):
                    self._apply(edge)
                if not edge.pending:
                    self._begin(peer, edge)
            for peer, edge in self._edges.items():
                if edge.done < k - self.max_lead:
                    self._finish(peer, edge)

    def _begin(self, peer: int, edge: _Edge) -> None:
        """Start an exchange with ``peer``: snapshot x, post the send and the receive."""
        array_module(edge.snapshot).copyto(edge.snapshot, self.flat.state_data)
        edge.pending = [p2p.irecv(self._comm, edge.theirs, peer), p2p.isend(self._comm, edge.snapshot, peer)]
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

    def settle(self) -> None:
        """Complete every exchange so that none is in flight (collective; module docstring)."""
        super().settle()
        if not self.peers:
            return
        mine = np.array([edge.started for edge in self._edges.values()], np.int64)
        theirs = np.zeros(len(self.peers), np.int64)
        with self._communicating():
            requests = [self._comm.Irecv(theirs[i : i + 1], p, _SETTLE_TAG) for i, p in enumerate(self.peers)]
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
