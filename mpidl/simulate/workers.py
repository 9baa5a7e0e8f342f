"""The simulated workers' real numerics: n models, each with its own SGD, data shard and slowdowns.

What ``mpidl train --backend numpy`` does on each rank, for n workers in one
process: the MLP of :class:`mpidl.models.mlp.NumpyMLP` (every worker starts
from the same :func:`~mpidl.models.mlp.init_params`), torch's SGD rule of
:class:`algorithms.optim.SGD` per worker, the shards and batches of
:mod:`mpidl.data` (:func:`~mpidl.data.shard`, :func:`~mpidl.data.epoch_batches`
for synchronous epochs, :func:`~mpidl.data.batch_stream` where workers step
at their own speeds), and each worker's slowdown per step
(:class:`mpidl.slowdowns.Slowdowns`). The parameters are the rows of one
n x P array, so averaging and evaluating are array operations.

Time: a worker's computation of its k-th step takes f_k x C virtual seconds,
C the paced step time (``--step-time``) and f_k its slowdown factor, as a
paced worker of ``mpidl train`` takes (:mod:`mpidl.stepclock`); the update
inside ``step()`` takes no time (a paced run counts it into the pace).

Evaluation (:meth:`Workers.evaluate`), as :mod:`mpidl.metrics` measures: the
averaged model's test loss and accuracy, and the consensus distance (1/n)
sum_i ||x_i - x_bar||^2 / ||x_bar||^2.

Memory: 5 x n x P x 4 bytes (parameters, and each SGD's gradient, momentum
and two work arrays): 1 GiB for 1024 workers of the MLP 784-64-10.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from algorithms import optim

from .. import data
from ..models.mlp import NumpyMLP
from ..slowdowns import RandomSlowdown, Slowdowns


class Workers:
    """n workers training ``net``'s MLP on their shards of ``dataset`` (module docstring).

    Args:
        n: workers.
        dataset: the normalized dataset.
        hidden: the MLP's hidden layer sizes.
        batch_size, lr, momentum, seed: as ``mpidl train``'s.
        step_time: the paced computation time C of a step, in seconds.
        slow: fixed slowdown factors by worker (``--slow``).
        slowdown: random transient slowdowns (``--slowdown``), or None.

    Attributes:
        net: the model (its forward and backward pass serve every worker).
        params: n x P, row i worker i's parameters.
        optimizers: worker i's SGD over ``params[i]``.
        steps: steps per worker in a synchronous epoch.
        iterations: steps each worker took.
        waited: seconds each worker waited on communication.
        loss_sum, taken: the current epoch's sum of batch losses and steps.
    """

    def __init__(
        self,
        n: int,
        dataset: data.Dataset,
        hidden: Sequence[int],
        *,
        batch_size: int,
        lr: float,
        momentum: float,
        seed: int,
        step_time: float,
        slow: dict[int, float] | None = None,
        slowdown: RandomSlowdown | None = None,
    ) -> None:
        if n < 1 or step_time <= 0:
            raise ValueError(f"need at least one worker and a positive step time, got {n} and {step_time}")
        bad = sorted(w for w in (slow or {}) if not 0 <= w < n)
        if bad:
            raise ValueError(f"--slow names worker(s) {bad}, but there are only {n} workers")
        self.n, self.dataset, self.seed, self.step_time = n, dataset, seed, step_time
        self.net = NumpyMLP((dataset.features, *hidden, dataset.classes), seed)
        self.params = np.tile(self.net.params, (n, 1))
        self.optimizers = [optim.SGD(self.params[i], lr=lr, momentum=momentum) for i in range(n)]
        samples = len(dataset.y_train)
        self.steps = data.steps_per_epoch(samples, n, batch_size)
        self.shards = [data.shard(samples, i, n, seed) for i in range(n)]
        self.slowdowns = [Slowdowns(i, dict(slow or {}), slowdown, seed) for i in range(n)]
        self.iterations = np.zeros(n, np.int64)
        self.waited = np.zeros(n)
        self.loss_sum, self.taken = 0.0, 0
        self._batches: list[Iterator[np.ndarray]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of one worker's parameters (what an averaging moves)."""
        return int(self.params[0].nbytes)

    def begin_epoch(self, epoch: int, uneven: bool) -> None:
        """Start ``epoch``'s batches: ``steps`` each, or (``uneven``) as many as a worker asks."""
        self.loss_sum, self.taken = 0.0, 0
        if uneven:
            self._batches = [data.batch_stream(s, self.steps, self.seed, epoch, i) for i, s in enumerate(self.shards)]
        else:
            self._batches = [
                iter(data.epoch_batches(s, self.steps, self.seed, epoch, i)) for i, s in enumerate(self.shards)
            ]

    def compute_time(self, i: int) -> float:
        """Virtual seconds worker ``i``'s next step computes (module docstring)."""
        return self.slowdowns[i].factor(int(self.iterations[i])) * self.step_time

    def gradient(self, i: int) -> None:
        """Worker ``i``'s gradient on its next batch, at its current parameters, into its
        optimizer's gradient."""
        batch = next(self._batches[i])
        ds = self.dataset
        self.loss_sum += self.net.loss_and_grad(
            self.params[i], ds.x_train[batch], ds.y_train[batch], self.optimizers[i].grad
        )

    def update(self, i: int) -> None:
        """Worker ``i``'s optimizer step with its gradient; one step more."""
        self.optimizers[i].step()
        self.iterations[i] += 1
        self.taken += 1

    def average(self, members: Sequence[int]) -> None:
        """Set the parameters of ``members`` to their average, as a ring all-reduce and the
        division give it (the sum in member order, then / k; for a pair (x_a + x_b) / 2,
        what both ends of mpidl's averagings compute): bitwise identical rows."""
        self.params[list(members)] = mean_of([self.params[m] for m in members])

    def evaluate(self) -> tuple[float, float, float]:
        """(test loss, test accuracy) of the averaged model, and the consensus distance."""
        center = self.params.mean(axis=0, dtype=np.float64).astype(self.params.dtype)
        ds = self.dataset
        loss, correct = self.net.evaluate(center, ds.x_test, ds.y_test)
        spread = 0.0
        norm = 1.0
        for row in self.params:
            distance, norm = self.net.squared_norms(row, center)
            spread += distance
        consensus = spread / self.n / norm if norm else 0.0
        return loss / len(ds.y_test), correct / len(ds.y_test), consensus


def mean_of(rows: Sequence[np.ndarray]) -> np.ndarray:
    """A new array: the sum of ``rows`` added in their order, divided by their count (in
    their dtype), as an all-reduce of mpidl's kernels and its division give it."""
    total = rows[0].copy()
    for row in rows[1:]:
        total += row
    total /= total.dtype.type(len(rows))
    return total


__all__ = ["Workers", "mean_of"]
