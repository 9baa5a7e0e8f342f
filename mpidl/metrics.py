"""Per-epoch metrics of ``mpidl train``: what is measured, how, and the JSON record.

After every epoch all workers evaluate together (collective over the
workers' communicator). The evaluation reads the parameters but changes
nothing the training uses: no parameter, gradient, optimizer state, counter
or random generator; its time is not counted as training time.

* The **averaged model** x_bar = (1/n) sum_i x_i is computed with an
  all-reduce (average) of copies of the workers' flat states — parameters and
  BatchNorm statistics (:mod:`algorithms.flat`) — and tested; its bits are the
  same on every worker, so each tests a 1/n slice of the test set and the
  sums are added up.
* Each worker tests its **own model** x_i (its own state) on the whole test
  set; the worst of these is reported.
* The **consensus distance** is (1/n) sum_i ||x_i - x_bar||^2 / ||x_bar||^2
  over the parameters: 0 when all workers hold the same parameters
  (AllReduce-SGD, LSGD), small when a decentralized algorithm keeps them close.

One JSON record per epoch (:func:`measure`); accuracies are fractions in
[0, 1], times seconds, counters cumulative since the start of training:

================================ =============================================================
key                              value
================================ =============================================================
``epoch``                        1, 2, ...
``time_s``                       training wall time so far, evaluation excluded; the slowest
                                 worker's
``epoch_s``                      this epoch's training wall time, the slowest worker's
``eval_s``                       this evaluation's wall time (rank 0's)
``train_loss``                   mean minibatch loss of the epoch, over all workers' steps
``steps``                        steps all workers took in the epoch (n x steps per epoch for
                                 most algorithms; the budget plus a few where workers step
                                 at their own speeds, see :mod:`mpidl.pacing`)
``test_loss``                    test loss of the averaged model
``test_acc``                     test accuracy of the averaged model
``test_acc_worst``               lowest test accuracy of a worker's own model
``test_acc_mean``                mean over workers of their own models' test accuracy
``consensus``                    consensus distance (above)
``bytes_per_step_mean``, ``_max`` mean and max over workers of bytes sent / steps taken
``bytes_total``                  bytes sent by all workers together
``internode_bytes_per_step_mean`` mean over workers of the bytes sent to ranks on other nodes /
                                 steps taken (0 on one node)
``internode_bytes_total``        bytes sent to other nodes by all workers together
``workers``                      per worker, lists indexed by rank: ``test_acc``,
                                 ``consensus`` (||x_i - x_bar||^2 / ||x_bar||^2),
                                 ``train_loss`` (null if it took no step this epoch),
                                 ``iterations``, ``bytes_sent``, ``internode_bytes``,
                                 ``comm_wait_s`` (time its steps spent communicating or
                                 waiting), ``time_s`` (its training wall time)
================================ =============================================================

Bytes are the payload a worker's steps sent (:attr:`algorithms.Algorithm.bytes_sent`),
exact counts from the point-to-point layer; the evaluation's all-reduce is not
counted. Bytes to other nodes (:class:`NodeBytes`) are counted by destination
(:func:`collectives.transport.p2p.bytes_by_peer`), all of the worker's
threads together, the evaluation's excluded; nodes as
:func:`collectives.topology.layout.layout` sees them (``MPIDL_RANKS_PER_NODE``
emulates them). A peer whose traffic bypasses mpidl's transport (DDP) has none
counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mpi4py import MPI

import collectives
from collectives.topology.layout import layout
from collectives.transport.p2p import bytes_by_peer

from . import plotting
from .models import Model


def measure(
    epoch: int,
    algo: Any,
    net: Model,
    x_test: Any,
    y_test: Any,
    comm: MPI.Comm,
    *,
    loss_sum: float,
    steps: int,
    time_s: float,
    epoch_s: float,
    internode_bytes: int = 0,
) -> dict[str, Any]:
    """Evaluate after ``epoch`` (collective) and return its record (module docstring) on every rank.

    ``loss_sum``, ``steps``, ``time_s``, ``epoch_s`` and ``internode_bytes`` are
    this worker's: the sum of its minibatch losses this epoch and its steps,
    its training time so far and this epoch's, the bytes its training sent to
    other nodes so far.
    """
    t0 = time.perf_counter()
    rank, n, total = comm.Get_rank(), comm.Get_size(), len(y_test)
    average = collectives.allreduce(net.copy(algo.state), comm, "avg", "ring")
    part = slice(rank * total // n, (rank + 1) * total // n)
    avg_loss, avg_correct = net.evaluate(average, x_test[part], y_test[part])
    _, own_correct = net.evaluate(algo.state, x_test, y_test)
    distance, norm = net.squared_norms(algo.params, average[: algo.flat.size])
    mine = (
        avg_loss,
        avg_correct,
        own_correct / total,
        distance / norm if norm else 0.0,
        loss_sum,
        steps,
        algo.iterations,
        algo.bytes_sent,
        internode_bytes,
        algo.comm_wait_s,
        time_s,
        epoch_s,
    )
    columns = map(list, zip(*comm.allgather(mine)))
    avg_losses, avg_corrects, acc, consensus, losses, taken, iterations, sent, across, wait, times, epoch_times = (
        columns
    )
    per_step = [b / max(i, 1) for b, i in zip(sent, iterations)]
    across_per_step = [b / max(i, 1) for b, i in zip(across, iterations)]
    return {
        "epoch": epoch,
        "time_s": max(times),
        "epoch_s": max(epoch_times),
        "eval_s": time.perf_counter() - t0,
        "train_loss": sum(losses) / max(sum(taken), 1),
        "steps": sum(taken),
        "test_loss": sum(avg_losses) / total,
        "test_acc": sum(avg_corrects) / total,
        "test_acc_worst": min(acc),
        "test_acc_mean": sum(acc) / n,
        "consensus": sum(consensus) / n,
        "bytes_per_step_mean": sum(per_step) / n,
        "bytes_per_step_max": max(per_step),
        "bytes_total": sum(sent),
        "internode_bytes_per_step_mean": sum(across_per_step) / n,
        "internode_bytes_total": sum(across),
        "workers": {
            "test_acc": acc,
            "consensus": consensus,
            "train_loss": [s / k if k else None for s, k in zip(losses, taken)],
            "iterations": iterations,
            "bytes_sent": sent,
            "internode_bytes": across,
            "comm_wait_s": wait,
            "time_s": times,
        },
    }


class NodeBytes:
    """The payload bytes this process sent to ranks on other nodes since the construction,
    by destination, less what the enclosed :meth:`excluding` blocks sent. Construction is
    collective over ``MPI_COMM_WORLD`` (it reads the node layout)."""

    def __init__(self) -> None:
        world = MPI.COMM_WORLD
        node_of = layout(world).node_of
        self._remote = {r for r, node in enumerate(node_of) if node != node_of[world.Get_rank()]}
        self._excluded = self._sent()

    def _sent(self) -> int:
        return sum(n for peer, n in bytes_by_peer().items() if peer in self._remote)

    @contextmanager
    def excluding(self) -> Iterator[None]:
        """Leave out what this process sends to other nodes inside the block."""
        before = self._sent()
        try:
            yield
        finally:
            self._excluded += self._sent() - before

    def carry(self, nbytes: int) -> None:
        """Count ``nbytes`` sent before (by the run a checkpoint continues)."""
        self._excluded -= nbytes

    @property
    def total(self) -> int:
        """Bytes sent to other nodes so far, the excluded blocks' left out."""
        return self._sent() - self._excluded


def line(record: dict[str, Any], epochs: int, model_bytes: int) -> str:
    """One epoch's record as the line ``mpidl train`` prints."""
    per_step = record["bytes_per_step_mean"]
    return (
        f"epoch {record['epoch']:>{len(str(epochs))}}/{epochs}  time {record['time_s']:7.2f} s  "
        f"loss {record['train_loss']:.4f}  test acc {100 * record['test_acc']:6.2f}% (averaged model)  "
        f"{100 * record['test_acc_worst']:6.2f}% (worst worker)  consensus {record['consensus']:.2e}  "
        f"sent/step {per_step / 1024:8.1f} KiB ({per_step / model_bytes:.2f} x model)"
    )


def plot(records: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Test accuracy (averaged model, worst worker) against training time and against epoch."""
    fig, axes = plotting.pyplot().subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, label in ((axes[0], "time_s", "training time (s)"), (axes[1], "epoch", "epoch")):
        x = [r[key] for r in records]
        ax.plot(x, [100 * r["test_acc"] for r in records], marker="o", label="averaged model")
        ax.plot(x, [100 * r["test_acc_worst"] for r in records], marker=".", linestyle="--", label="worst worker")
        ax.set_xlabel(label)
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("test accuracy (%)")
    fig.suptitle(title)
    plotting.finish(fig, axes, path)
