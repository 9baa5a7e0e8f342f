"""GR-SGD simulated: ring gossip without a barrier, each worker's lead over its exchanges bounded.

The schedule of :mod:`algorithms.grsgd` (after Zhou et al.'s Gossip Ring
SGD): worker i, at the end of its step k (after its SGD step), for each ring
neighbor j in ascending order applies the exchange in flight with j if it has
completed and starts one (a snapshot of x_i) if none is in flight; then it
waits, applying exchanges as they complete, until it has applied at least
k - ``max_lead`` with every neighbor. An exchange's two transfers (each
snapshot, m bytes, as flows on the network) start once both ends have
started it (the rendezvous of a large message), and it completes when both
have ended; applying it is x_i += w (s_j - s_i), w = 1/(d + 1), the real
worker's arithmetic on float32, so every exchange keeps the sum of the
models. The transfers progress on their own (as over an RDMA NIC); the real
worker, which has no service thread, moves them on only when it enters MPI.

Epochs: every worker takes the same number of steps (``uneven`` false); the
epoch ends with ``settle()``: once every worker has taken its steps, on every
edge the end that started fewer exchanges starts the missing one, and all
exchanges in flight complete and are applied (the real settle does this edge
by edge as the neighbors arrive; here it starts when the last worker has).
"""

from __future__ import annotations

import numpy as np

from .network import Network
from .workers import Workers


class _Side:
    """Worker i's end of its edge with j: the buffers, counts and the exchange in flight."""

    def __init__(self, x: np.ndarray) -> None:
        self.snapshot, self.theirs = np.empty_like(x), np.empty_like(x)
        self.started = self.done = 0
        self.pending = self.completed = False


class GRSGD:
    """Ring gossip with a bounded lead (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster.
        max_lead: steps a worker may run ahead of the exchanges it applied with a
            neighbor (0: synchronous).

    Attributes:
        peers: each worker's ring neighbors.
        weight: w, a neighbor snapshot's weight.
    """

    name = "grsgd"
    uneven = False

    def __init__(self, workers: Workers, network: Network, max_lead: int = 2) -> None:
        if max_lead < 0:
            raise ValueError(f"max_lead must be >= 0, got {max_lead}")
        self.workers, self.network, self.max_lead = workers, network, max_lead
        n = workers.n
        self.peers = [tuple(sorted({(i - 1) % n, (i + 1) % n} - {i})) for i in range(n)]
        self.weight = 1.0 / (len(self.peers[0]) + 1)
        self._side = {(i, j): _Side(workers.params[i]) for i in range(n) for j in self.peers[i]}
        self._flows: dict[tuple[int, int], int] = {}  # the edge (low, high): transfers still running
        self._blocked_since = np.full(n, np.nan)
        self._goal = np.zeros(n, np.int64)
        self._settled = 0

    def epoch(self, epoch: int) -> None:
        """Run ``epoch``'s steps (``steps`` per worker) and settle."""
        w = self.workers
        self._goal = w.iterations + w.steps
        self._settled = 0
        for i in range(w.n):
            self._compute(i)
        self.network.engine.run()
        self._settle()

    def _compute(self, i: int) -> None:
        if self.workers.iterations[i] >= self._goal[i]:
            self._settled += 1
            return
        self.workers.gradient(i)
        self.network.engine.after(self.workers.compute_time(i), self._computed, i)

    def _computed(self, i: int) -> None:
        """The end of worker ``i``'s step: SGD, test and start exchanges, then the bound."""
        self.workers.update(i)
        for j in self.peers[i]:
            side = self._side[i, j]
            if side.pending and side.completed:
                self._apply(i, j)
            if not side.pending:
                self._begin(i, j)
        self._bound(i)

    def _bound(self, i: int) -> None:
        """Go on with worker ``i`` once it is within ``max_lead`` of every neighbor."""
        k = int(self.workers.iterations[i])
        for j in self.peers[i]:
            side = self._side[i, j]
            if side.done < k - self.max_lead:
                if not side.completed:  # wait: _completed() calls this again
                    if np.isnan(self._blocked_since[i]):
                        self._blocked_since[i] = self.network.engine.now
                    return
                self._apply(i, j)
        if not np.isnan(self._blocked_since[i]):
            self.workers.waited[i] += self.network.engine.now - self._blocked_since[i]
            self._blocked_since[i] = np.nan
        self._compute(i)

    def _begin(self, i: int, j: int) -> None:
        side, other = self._side[i, j], self._side[j, i]
        side.snapshot[...] = self.workers.params[i]
        side.pending, side.completed = True, False
        side.started += 1
        if other.started == side.started:  # j has started this exchange too: the data moves
            self._flows[min(i, j), max(i, j)] = 2
            self._send(i, j)
            self._send(j, i)

    def _send(self, src: int, dst: int) -> None:
        def arrived() -> None:
            self._side[dst, src].theirs[...] = self._side[src, dst].snapshot
            edge = (min(src, dst), max(src, dst))
            self._flows[edge] -= 1
            if self._flows[edge] == 0:
                self._completed(*edge)

        self.network.transfer(src, dst, self.workers.nbytes, arrived)

    def _completed(self, a: int, b: int) -> None:
        for i, j in ((a, b), (b, a)):
            self._side[i, j].completed = True
            if not np.isnan(self._blocked_since[i]):
                self._bound(i)

    def _apply(self, i: int, j: int) -> None:
        """x_i += w (s_j - s_i) (the real worker's arithmetic)."""
        side = self._side[i, j]
        side.theirs -= side.snapshot
        side.theirs *= self.weight
        self.workers.params[i] += side.theirs
        side.pending = side.completed = False
        side.done += 1

    def _settle(self) -> None:
        """Every edge's ends start the same number of exchanges, and all in flight are applied."""
        assert self._settled == self.workers.n, "the epoch ended with workers still stepping"
        for (i, j), side in self._side.items():
            if self._side[j, i].started > side.started:  # the neighbor started one more: take part
                if side.pending:
                    self._apply(i, j)  # completed: the neighbor applied it before starting the next
                self._begin(i, j)
        self.network.engine.run()
        for (i, j), side in self._side.items():
            if side.pending:
                self._apply(i, j)


__all__ = ["GRSGD"]
