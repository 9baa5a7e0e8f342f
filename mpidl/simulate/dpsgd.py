"""D-PSGD simulated: every step a neighbor averaging over the graph, no global barrier.

The schedule of :mod:`algorithms.dpsgd` (Lian et al., NeurIPS 2017) without
overlap (as ``mpidl train`` runs the numpy model), on a topology of
:mod:`algorithms.topology` (``ring`` by default, uniform weights), each
worker i at its step t:

1. computes its gradient at x_i(t) (f_i C virtual seconds);
2. exchanges x_i(t) with its neighbors (:func:`collectives.neighbor_allreduce`):
   a transfer i -> j of m bytes starts once both i and j have finished
   computing step t (the rendezvous of a large message; every transfer a
   flow on the network, sharing the links with all others), and worker i
   goes on when every transfer to and from it has ended, so a slow worker
   holds up its neighbors, and they theirs one step later, but nobody
   waits for the whole cluster;
3. mixes, x_i <- W_ii x_i + sum_j W_ij x_j(t) in ascending j, the arithmetic
   of :func:`collectives.neighbor_allreduce` on float32 (the neighbor's x_j(t)
   as it arrived), and applies its SGD step with its gradient.

So x_i(t+1) = sum_j W_ij x_j(t) - lr d(g_i(x_i(t))), bit for bit a real
run's (``tests/test_simulate.py`` compares them), and at lr 0 the sum of the
models is kept (W is doubly stochastic). Every worker takes the same number
of steps per epoch (synchronous), so an epoch ends when the last worker has
mixed its last step.

Cost: 2 d flows per worker per step (d the degree), one copy of each
received model (memory: n d P x 4 bytes more).
"""

from __future__ import annotations

import numpy as np

from algorithms.topology import build

from .network import Network
from .workers import Workers


class DPSGD:
    """Synchronous neighbor averaging (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster.
        topology: a name of :data:`algorithms.topology.TOPOLOGIES` (default ring).
    """

    name = "dpsgd"
    uneven = False

    def __init__(self, workers: Workers, network: Network, topology: str = "ring") -> None:
        self.workers, self.network = workers, network
        n = workers.n
        self.topology = build(topology, n) if n > 1 else None
        W = self.topology.W if self.topology is not None else np.ones((1, 1))
        self.peers = [self.topology.neighbors(i) if self.topology is not None else () for i in range(n)]
        self.self_weight = [float(W[i, i]) for i in range(n)]
        self.weights = [[float(W[i, j]) for j in self.peers[i]] for i in range(n)]
        self._received = [{j: np.empty_like(workers.params[i]) for j in self.peers[i]} for i in range(n)]
        self._ready = np.full(n, -1, np.int64)  # the last step whose gradient each worker has computed
        self._left = [0] * n  # transfers to and from each worker still running in this step
        self._computed_at = np.zeros(n)
        self._goal = np.zeros(n, np.int64)  # the step count at which the current epoch ends

    def epoch(self, epoch: int) -> None:
        """Run ``epoch``'s steps (``steps`` per worker) to the last worker's last mix."""
        w = self.workers
        self._goal = w.iterations + w.steps
        for i in range(w.n):
            self._compute(i)
        self.network.engine.run()

    def _compute(self, i: int) -> None:
        if self.workers.iterations[i] >= self._goal[i]:
            return
        self.workers.gradient(i)
        self.network.engine.after(self.workers.compute_time(i), self._computed, i)

    def _computed(self, i: int) -> None:
        """Worker ``i`` has its gradient of step t: start the transfers whose other end is ready."""
        w, t = self.workers, int(self.workers.iterations[i])
        self._ready[i], self._computed_at[i] = t, self.network.engine.now
        if not self.peers[i]:
            self._mixed(i)
            return
        self._left[i] = 2 * len(self.peers[i])
        for j in self.peers[i]:
            if self._ready[j] == t and int(w.iterations[j]) == t:  # j waits in its exchange of step t
                self._send(i, j)
                self._send(j, i)

    def _send(self, src: int, dst: int) -> None:
        params = self.workers.params

        def arrived() -> None:
            self._received[dst][src][...] = params[src]  # x_src(t): src cannot step before this ends
            self._ended(src)
            self._ended(dst)

        self.network.transfer(src, dst, self.workers.nbytes, arrived)

    def _ended(self, i: int) -> None:
        self._left[i] -= 1
        if self._left[i] == 0:
            self._mixed(i)

    def _mixed(self, i: int) -> None:
        """Worker ``i``'s exchange is over: mix (the arithmetic of neighbor_allreduce), step."""
        w = self.workers
        w.waited[i] += self.network.engine.now - self._computed_at[i]
        if self.peers[i]:
            x = w.params[i]
            np.multiply(x, self.self_weight[i], out=x)
            for j, weight in zip(self.peers[i], self.weights[i]):
                term = self._received[i][j]
                np.multiply(term, weight, out=term)
                np.add(x, term, out=x)
        w.update(i)
        self._compute(i)


__all__ = ["DPSGD"]
