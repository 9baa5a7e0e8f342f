"""AllReduce-SGD simulated: every step waits for the slowest worker, then one all-reduce.

The schedule of :mod:`algorithms.allreduce_sgd` without overlap (as ``mpidl
train`` runs a paced or numpy model): each worker computes its gradient
(f_i C virtual seconds), the all-reduce of the gradients starts when the last
worker arrives and takes T, the time of its pattern alone on the network
(:mod:`~mpidl.simulate.patterns`: ``ring`` or ``hierarchical_ring``; nothing
else is on the network during it); then every worker applies the averaged
gradient. A step takes max_i f_i C + T, and worker i waits
max_j f_j C - f_i C + T of it.

Numerics: the gradients are summed in worker order and divided by n
(:func:`~mpidl.simulate.workers.mean_of`), and every worker's own SGD applies
the same average to the same model, so the workers stay bitwise identical
(for two workers the bits of a real two-rank run: the sum of two is the
same whichever way it is added).
"""

from __future__ import annotations

import numpy as np

from .network import Network
from .patterns import ALLREDUCES, sent_by
from .workers import Workers, mean_of


class AllReduceSGD:
    """Synchronous steps with an all-reduce of the gradients (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster.
        collective: the all-reduce's pattern, a name of :data:`~mpidl.simulate.patterns.ALLREDUCES`.

    Attributes:
        allreduce_s: T, one all-reduce's virtual seconds.
    """

    name = "allreduce"
    uneven = False

    def __init__(self, workers: Workers, network: Network, collective: str = "hierarchical_ring") -> None:
        if collective not in ALLREDUCES:
            raise ValueError(f"unknown collective {collective!r}; simulated: {', '.join(ALLREDUCES)}")
        self.workers, self.network = workers, network
        pattern = ALLREDUCES[collective](network.node_of, workers.nbytes)
        self.allreduce_s = network.alone(pattern)
        self._sent, self._sent_inter = sent_by(pattern, network.node_of)

    def epoch(self, epoch: int) -> None:
        """Run ``epoch``'s steps; the network's clock advances by their virtual time."""
        w, engine = self.workers, self.network.engine
        for _ in range(w.steps):
            times = np.array([w.compute_time(i) for i in range(w.n)])
            for i in range(w.n):
                w.gradient(i)
            average = mean_of([opt.grad for opt in w.optimizers])
            for i, opt in enumerate(w.optimizers):
                np.copyto(opt.grad, average)
                w.update(i)
            slowest = float(times.max())
            w.waited += slowest - times + self.allreduce_s
            self.network.sent += self._sent
            self.network.sent_inter += self._sent_inter
            engine.advance(slowest + self.allreduce_s)


__all__ = ["AllReduceSGD"]
