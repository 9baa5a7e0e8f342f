"""LSGD simulated: gradients reduced inside each node, all-reduced among the nodes one step behind.

The schedule of :mod:`algorithms.lsgd` (Yu et al., arXiv:1906.05936, 2019):
a group is a node's workers, its representative the lowest. At step t,
group g (start s_g):

1. its workers compute (max over the group of f_i C), and a binomial reduce
   of the m-byte gradients brings S_g(t) to the representative (T_red);
2. the representative waits for the inter-group all-reduce of step t - 1
   (a ring among the representatives, T_inter; it started when the last
   representative had its S(t-1), so it is a barrier of all groups, one
   step late) and starts the one of step t;
3. a binomial broadcast of R(t-1) (T_b), and every worker applies R(t-1)/n.

So s_g(t+1) = max(r_g(t), E(t-1)) + T_b, with r_g(t) = s_g(t) + max f_i C +
T_red and E(t) = max_g r_g(t) + T_inter: the inter-group all-reduce hides
behind the next step's computation when that is longer. Each phase's time is
its pattern's alone on the network (:mod:`~mpidl.simulate.patterns`; the
trees run on the nodes' fabrics, the ring on their NICs, so they do not meet).
With one group (one node) LSGD is AllReduce-SGD: a ring all-reduce of the
fresh gradients, no delay.

Numerics: the gradient applied at step t is the average of step t - 1's
gradients (summed in worker order, then divided by n; the real one sums in
the trees' and the ring's order, the same value up to rounding, and the bits
of a real run at two workers), the same on every worker; the first step only
fills the pipeline (no update), and the pipeline runs on across epochs, as
in the real algorithm.
"""

from __future__ import annotations

import numpy as np

from .network import Network
from .patterns import binomial_broadcast, binomial_reduce, by_node, ring, sent_by
from .workers import Workers, mean_of


class LSGD:
    """Layered SGD (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster (a group per node).

    Attributes:
        groups: the workers of each group.
        inter_s: T_inter, the representatives' all-reduce's virtual seconds.
    """

    name = "lsgd"
    uneven = False

    def __init__(self, workers: Workers, network: Network) -> None:
        self.workers, self.network = workers, network
        m = workers.nbytes
        self.groups = by_node(network.node_of)
        if len(self.groups) == 1:
            patterns = [ring(self.groups[0], m)]
            self._tree = np.array([network.alone(patterns[0])])
            self._back = np.zeros(1)
            self.inter_s = 0.0
        else:
            reduces = [binomial_reduce(g, m) for g in self.groups]
            broadcasts = [binomial_broadcast(g, m) for g in self.groups]
            leaders = ring([g[0] for g in self.groups], m)
            self._tree = np.array([network.alone(p) for p in reduces])
            self._back = np.array([network.alone(p) for p in broadcasts])
            self.inter_s = network.alone(leaders)
            patterns = [*reduces, *broadcasts, leaders]
        self._sent = sum(sent_by(p, network.node_of)[0] for p in patterns)
        self._sent_inter = sum(sent_by(p, network.node_of)[1] for p in patterns)
        self._group_of = np.zeros(workers.n, np.int64)
        for k, g in enumerate(self.groups):
            self._group_of[g] = k
        self._delayed: np.ndarray | None = None  # R(t-1)/n, once the pipeline is full
        self._inter_ends = -np.inf  # E(t-1): when the all-reduce in flight ends

    def epoch(self, epoch: int) -> None:
        """Run ``epoch``'s steps; the network's clock advances to the last group's last step."""
        w, engine = self.workers, self.network.engine
        start = np.full(len(self.groups), engine.now)
        for _ in range(w.steps):
            times = np.array([w.compute_time(i) for i in range(w.n)])
            for i in range(w.n):
                w.gradient(i)
            fresh = mean_of([opt.grad for opt in w.optimizers])
            slowest = np.array([times[g].max() for g in self.groups])
            reduced = start + slowest + self._tree
            if len(self.groups) == 1:
                applied: np.ndarray | None = fresh
                after = reduced
            else:
                applied, self._delayed = self._delayed, fresh
                after = np.maximum(reduced, self._inter_ends) + self._back
                self._inter_ends = float(reduced.max()) + self.inter_s
            for i, opt in enumerate(w.optimizers):
                if applied is not None:
                    np.copyto(opt.grad, applied)
                w.update(i, apply=applied is not None)
            w.waited += after[self._group_of] - start[self._group_of] - times
            self.network.sent += self._sent
            self.network.sent_inter += self._sent_inter
            start = after
        engine.advance(float(start.max()) - engine.now)


__all__ = ["LSGD"]
