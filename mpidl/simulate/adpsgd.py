"""AD-PSGD simulated: active workers average with a passive neighbor, whose server serialises the averagings.

The schedule of :mod:`algorithms.adpsgd` (Lian et al., ICML 2018) on the
bipartite graph it uses (the ring for even n, even workers active; the
complete bipartite graph between even and odd workers for odd n), each
worker stepping at its own speed:

* an active worker computes its gradient (f_i C), waits for the averaging it
  started at its previous step if that is still running, applies its SGD
  step, starts the next averaging with a neighbor drawn as the real worker
  draws it (``np.random.default_rng([seed, rank])``), and computes on;
* the averaging: the request's envelope reaches the passive neighbor's
  server after the latency; the server takes requests one at a time, in the
  order they came (first come, first served), receiving the active worker's
  model (m bytes) and then sending its own (m bytes) over the network, both
  as flows sharing the links with every other transfer in flight; both
  workers then hold (x_lower + x_higher) / 2 (bitwise alike);
* a passive worker computes its gradient and applies its SGD step, waiting
  while its server holds its model (the lock of the real worker).

Each gradient is computed on the worker's model at the start of its
computation (the real worker reads a model that an averaging may change
during the forward pass). With learning rate 0 every averaging keeps the sum
of all models.

Epochs: n x S steps of all workers together (:mod:`mpidl.pacing`); a worker
stops at its first step boundary after the budget is spent, and the epoch
ends when every worker has stopped and every averaging has ended (the real
``settle()``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from algorithms.topology import build

from .network import Network
from .workers import Workers


class ADPSGD:
    """Asynchronous pairwise averaging (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster.

    Attributes:
        active: whether each worker starts averagings.
        averagings: averagings each worker took part in.
    """

    name = "adpsgd"
    uneven = True

    def __init__(self, workers: Workers, network: Network) -> None:
        self.workers, self.network = workers, network
        n = workers.n
        topology = build("ring" if n % 2 == 0 else "bipartite", n) if n > 1 else None
        sides = topology.sides() if topology is not None else None
        self.active = [sides is not None and sides[i] == 0 for i in range(n)]
        self.peers = [topology.neighbors(i) if topology is not None else () for i in range(n)]
        self._rng = [np.random.default_rng([workers.seed, i]) for i in range(n)]
        self.averagings = np.zeros(n, np.int64)
        self._pending = [False] * n  # active: an averaging of its is running
        self._blocked_since: list[float | None] = [None] * n  # waiting for its averaging / its lock
        self._queue: list[deque[int]] = [deque() for _ in range(n)]  # passive: requests waiting
        self._serving = [False] * n  # passive: its server holds its model
        self._budget = 0  # the step count at which the current epoch ends
        self._total = 0

    def epoch(self, epoch: int) -> None:
        """Run ``epoch`` (its budget of n x S steps) to its settled end."""
        w = self.workers
        self._budget += w.n * w.steps
        for i in range(w.n):
            self._compute(i)
        self.network.engine.run()

    def _compute(self, i: int) -> None:
        if self._total >= self._budget:  # the epoch is over: this worker stops
            return
        self.workers.gradient(i)
        self.network.engine.after(self.workers.compute_time(i), self._computed, i)

    def _computed(self, i: int) -> None:
        busy = self._pending[i] if self.active[i] else self._serving[i]
        if busy:
            self._blocked_since[i] = self.network.engine.now
            return
        self._step(i)

    def _step(self, i: int) -> None:
        """Worker ``i``'s SGD step, its next averaging (active), its next computation."""
        w = self.workers
        w.update(i)
        self._total += 1
        if self.active[i] and self.peers[i]:
            peer = self.peers[i][int(self._rng[i].integers(len(self.peers[i])))]
            self._pending[i] = True
            self.network.engine.after(self.network.latency(i, peer), self._arrive, i, peer)
        self._compute(i)

    def _unblock(self, i: int) -> None:
        since = self._blocked_since[i]
        if since is not None:
            self._blocked_since[i] = None
            self.workers.waited[i] += self.network.engine.now - since
            self._step(i)

    def _arrive(self, active: int, passive: int) -> None:
        self._queue[passive].append(active)
        if not self._serving[passive]:
            self._serve(passive)

    def _serve(self, passive: int) -> None:
        """The passive worker's server takes its next request: the active model in, its own out."""
        active = self._queue[passive].popleft()
        self._serving[passive] = True
        m = self.workers.nbytes

        def received() -> None:
            self.network.transfer(passive, active, m, lambda: self._averaged(active, passive))

        self.network.transfer(active, passive, m, received)

    def _averaged(self, active: int, passive: int) -> None:
        self.workers.average(sorted((active, passive)))
        self.averagings[[active, passive]] += 1
        self._pending[active] = False
        self._serving[passive] = False
        self._unblock(passive)  # a step waiting for the lock takes it before the next request
        if self._queue[passive]:
            self._serve(passive)
        self._unblock(active)


__all__ = ["ADPSGD"]
