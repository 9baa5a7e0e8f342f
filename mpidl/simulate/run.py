"""A simulated run: the cluster, the workers, an algorithm's schedule, epochs and their records.

:func:`simulate` builds the workers' numerics (:mod:`~mpidl.simulate.workers`),
the network (:mod:`~mpidl.simulate.network`: ``ranks_per_node`` consecutive
workers per node, as ``mpiexec`` places ranks) and the algorithm's schedule
(:data:`SIMULATED`), then runs the epochs: a synchronous epoch is S steps of
every worker, one of an algorithm whose workers step at their own speeds
n x S steps of all workers together (:mod:`mpidl.pacing`). After each epoch
the workers are evaluated (:meth:`~mpidl.simulate.workers.Workers.evaluate`),
outside virtual time, as ``mpidl train`` leaves its evaluations out of the
training time.

The result has the shape of ``mpidl train --json`` (``meta``, ``epochs``,
``workers``), so ``mpidl compare`` and the emulated cluster's tables read
it; ``meta["simulated"]`` holds the network's parameters and the wall time
the simulation took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from collectives.tuning.costmodel import Params

from .. import __version__, data
from ..slowdowns import RandomSlowdown
from ..train import schedule_meta
from .adpsgd import ADPSGD
from .allreduce import AllReduceSGD
from .engine import Engine
from .network import Links, Network
from .prague import Prague
from .workers import Workers

Schedule = Union[AllReduceSGD, ADPSGD, Prague]

#: The simulated algorithms, by ``mpidl train``'s names.
SIMULATED: dict[str, Callable[..., Schedule]] = {
    "allreduce": AllReduceSGD,
    "adpsgd": ADPSGD,
    "prague": Prague,
}


@dataclass
class SimConfig:
    """What to simulate (``mpidl simulate``'s options)."""

    algorithm: str = "allreduce"
    options: dict[str, Any] = field(default_factory=dict)  # the schedule's keywords (policy, collective, ...)
    workers: int = 16
    ranks_per_node: int = 2
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    train_samples: int | None = None
    test_samples: int | None = None
    hidden: tuple[int, ...] = (64,)
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    step_time: float = 0.15
    slow: dict[int, float] = field(default_factory=dict)
    slowdown: RandomSlowdown | None = None
    rate: float = 125e6  # bytes/s of every NIC (1 Gbit/s)
    params: Params | None = None  # the cost model's latencies and intra-node rate (None: its defaults)


@dataclass
class SimResult:
    """A finished simulation: ``meta``, ``epochs`` and ``workers`` as ``mpidl train --json``
    writes them, and the final parameters of every worker (n x P)."""

    meta: dict[str, Any]
    epochs: list[dict[str, Any]]
    workers: dict[str, Any]
    params: np.ndarray

    def json(self) -> dict[str, Any]:
        """What ``mpidl simulate --json`` writes."""
        return {"meta": self.meta, "epochs": self.epochs, "workers": self.workers}


def simulate(
    config: SimConfig, dataset: data.Dataset | None = None, report: Callable[[str], None] | None = None
) -> SimResult:
    """Run the simulation of ``config`` (one process); ``report`` gets a line per epoch.

    Raises:
        ValueError: an unknown algorithm, a bad option or size, naming it.
        data.DatasetError: the dataset cannot be loaded.
    """
    if config.algorithm not in SIMULATED:
        raise ValueError(f"algorithm {config.algorithm!r} is not simulated; simulated: {', '.join(SIMULATED)}")
    if config.workers < 1 or config.ranks_per_node < 1 or config.epochs < 1:
        raise ValueError("workers, ranks per node and epochs must be at least 1")
    if dataset is None:
        from mpi4py import MPI

        dataset = data.load(config.dataset, config.data_dir, MPI.COMM_SELF)
    started = time.perf_counter()  # the simulation's own time, the dataset's loading left out
    dataset = dataset.subset(config.train_samples, config.test_samples)
    n = config.workers
    workers = Workers(
        n,
        dataset,
        config.hidden,
        batch_size=config.batch_size,
        lr=config.lr,
        momentum=config.momentum,
        seed=config.seed,
        step_time=config.step_time,
        slow=config.slow,
        slowdown=config.slowdown,
    )
    links = Links.calibrated(config.rate, config.params)
    network = Network(Engine(), [w // config.ranks_per_node for w in range(n)], links)
    schedule = SIMULATED[config.algorithm](workers, network, **config.options)
    meta = _describe(config, dataset, workers, network, schedule)
    records: list[dict[str, Any]] = []
    for epoch in range(1, config.epochs + 1):
        t0, sent0, inter0 = network.engine.now, network.sent.sum(), network.sent_inter.sum()
        workers.begin_epoch(epoch, schedule.uneven)
        schedule.epoch(epoch)
        loss, acc, consensus = workers.evaluate()
        taken = workers.taken
        records.append(
            {
                "epoch": epoch,
                "time_s": network.engine.now,
                "epoch_s": network.engine.now - t0,
                "train_loss": workers.loss_sum / max(taken, 1),
                "steps": taken,
                "test_loss": loss,
                "test_acc": acc,
                "consensus": consensus,
                "bytes_per_step_mean": float(network.sent.sum() - sent0) / max(taken, 1),
                "internode_bytes_per_step_mean": float(network.sent_inter.sum() - inter0) / max(taken, 1),
            }
        )
        if report is not None:
            report(line(records[-1], config.epochs))
    meta["simulated"]["wall_s"] = time.perf_counter() - started
    meta["simulated"]["events"] = network.engine.events
    return SimResult(meta, records, _per_worker(workers, network), workers.params)


def line(record: dict[str, Any], epochs: int) -> str:
    """One epoch's line of ``mpidl simulate``'s output."""
    return (
        f"epoch {record['epoch']:3d}/{epochs}  virtual time {record['time_s']:9.2f} s "
        f"(epoch {record['epoch_s']:7.2f} s)  loss {record['train_loss']:.4f}  "
        f"test acc {100 * record['test_acc']:6.2f}%  consensus {record['consensus']:.1e}  steps {record['steps']}"
    )


def _per_worker(workers: Workers, network: Network) -> dict[str, Any]:
    steps = workers.iterations
    return {
        "steps": steps.tolist(),
        "comm_wait_s": workers.waited.tolist(),
        "bytes_sent": network.sent.tolist(),
        "internode_bytes": network.sent_inter.tolist(),
    }


def _describe(
    config: SimConfig, dataset: data.Dataset, workers: Workers, network: Network, schedule: Schedule
) -> dict[str, Any]:
    links = network.links
    return {
        "command": "mpidl simulate",
        "version": __version__,
        "algorithm": config.algorithm,
        "options": {k: str(v) for k, v in config.options.items()},
        "workers": workers.n,
        "ranks_per_node": config.ranks_per_node,
        "nodes": network.nodes,
        "dataset": dataset.name,
        "train_samples": len(dataset.y_train),
        "test_samples": len(dataset.y_test),
        "model": workers.net.name,
        "model_spec": workers.net.spec,
        "parameters": workers.net.parameters,
        "model_bytes": workers.nbytes,
        "backend": "numpy",
        "uneven_steps": schedule.uneven,
        **schedule_meta(config, workers.steps),
        "simulated": {
            "rate_Bps": links.inter,
            "intra_Bps": links.intra,
            "alpha_inter_s": links.alpha_inter,
            "alpha_intra_s": links.alpha_intra,
            "params_source": (config.params or Params()).source,
            **({"allreduce_s": schedule.allreduce_s} if isinstance(schedule, AllReduceSGD) else {}),
        },
    }


__all__ = ["SIMULATED", "SimConfig", "SimResult", "line", "simulate"]
