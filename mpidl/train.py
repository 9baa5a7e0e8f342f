"""``mpidl train``: a training algorithm on a real dataset, with per-epoch metrics.

    mpiexec -n 4 mpidl train --algorithm dpsgd --topology ring

Every rank is a worker. Each trains a model (:mod:`mpidl.models`: an MLP, a
LeNet-5 or a ResNet-8) on its own shard of the training set
(:mod:`mpidl.data`), one batch per step: it zeroes its gradients, runs the
forward and backward pass, and calls the algorithm's ``step()``
(:mod:`algorithms`, or a peer of :mod:`mpidl.peers` such as PyTorch DDP),
which communicates and applies SGD with momentum. After every epoch the workers evaluate together
(:mod:`mpidl.metrics`); rank 0 prints one line per epoch on stdout, shows a
progress bar on stderr, and at the end writes ``--json`` and ``--plot``.

Heterogeneity and pacing: each worker computes its gradient for real, then
waits out its step's slowdown before calling ``step()``
(:mod:`mpidl.stepclock`): by default a step slowed by a factor f sleeps
(f - 1) x its computation time; with ``--step-time C`` every step's
computation takes f x C (paced compute: many workers share few cores, as
GPU workers of a large model would behave), and the main thread's waits
poll. The factor is fixed per rank (``--slow RANK:FACTOR``, repeatable)
times a random transient one (``--slowdown p=0.1,F=4,P=10``), seeded
(:mod:`mpidl.slowdowns`), so every algorithm of a comparison sees the same
schedule. The communication and the optimizer update inside ``step()`` are
never stretched.

Which worker is slow: at the end rank 0 prints each worker's mean step,
computation and communication/waiting time per step, names the slowest
worker where it stands out, and the CPU the workers used
(:mod:`mpidl.stragglers`); the JSON holds them under ``workers``.

Timeline (``--timeline FILE``, ``--timeline-plot FILE.png``): every rank's
computation, communication and waiting per step, as a Chrome trace and a
Gantt chart (:mod:`mpidl.timeline`).

Checkpoints (``--checkpoint DIR``, ``--checkpoint-every K``, ``--resume``):
after the last step, and after every K-th step, the workers settle the
algorithm (nothing is in flight), and every worker saves its model's state
(parameters and buffers), its optimizer's momentum, the algorithm's state
(counters and what it keeps between steps:
:meth:`algorithms.Algorithm.state_dict`), the loop's position and the
metrics so far (:mod:`mpidl.checkpoint`: one file per worker, written
atomically). ``--resume`` restores them and continues with the next step.
Since an epoch's batches depend only on (seed, epoch, rank), a resumed run
of an algorithm whose runs are reproducible (AllReduce-SGD, D-PSGD, LSGD,
GR-SGD with ``--max-lead 0``, Prague with static groups) takes exactly the
steps the uninterrupted run would have, and ends with the same parameters
and metrics (times aside; with ``--collective auto`` as long as the job
chooses the same all-reduce algorithms, which the persisted measurements of
``auto`` make so on the same machine: ``mpidl train`` has ``auto`` tune on
copies, never on the training's own calls, see ``docs/collectives.rst``). Where the
workers' timing decides the updates
(AD-PSGD, GR-SGD with a lead, Prague with random or smart groups), the
resumed run starts from exactly the saved state, random generators
included, and the interleaving of its steps is its own. With uneven steps
(AD-PSGD, Prague with random or smart groups) the workers agree only at
epoch ends, so checkpoints are taken there: after each epoch in which a
multiple of K steps per worker falls (an epoch counting as its steps per
worker of a synchronous run).

Threads: each worker uses ``--threads`` threads for torch and for numpy's
BLAS (default: the machine's cores divided by the ranks on it, at least 1),
so that ranks sharing a machine do not oversubscribe it.

Failures: an exception on one rank (other than the errors every rank raises
alike, :data:`AGREED_ERRORS`) leaves :func:`train` at once, without closing
the algorithm (a collective the other ranks are not in): ``mpidl.init()``'s
hook prints it first and ends the job (``docs/failures.rst``).

A worker that dies (``--on-failure continue``, for the algorithms that take
``on_failure``: AD-PSGD, GR-SGD, Prague; where the MPI library has ULFM) does not end the job
when it dies while the workers train: the algorithm's survivors recover
(:mod:`collectives.transport.faults`), settle, and deal the training set anew
among themselves (each its shard of the survivors' :func:`mpidl.data.shard`,
so the dead worker's samples are trained on); the epoch's step budget is
then the survivors' (n' x the steps of an n'-worker epoch), counting the
steps they took in it so far and not the dead worker's. GR-SGD, whose
workers take equal numbers of steps, has no budget: its survivors first
take the epoch's remaining steps on their old shards (each as many as
before the death), settle, and then each takes the steps an n'-worker epoch
has beyond those, and as many in every later epoch. Rank 0 of the
survivors prints a line, reports the epochs and writes the outputs; the
JSON's ``failures`` says in which epoch which workers died. A death during
the evaluation or a checkpoint still ends the job.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, cast

import numpy as np
from mpi4py import MPI

import algorithms
import collectives
from algorithms import events
from algorithms.topology import TOPOLOGIES, WEIGHTS, Topology
from collectives.transport import faults, p2p

from . import __version__, checkpoint, data, metrics, models, pacing, peers, plotting, stragglers, timeline
from .models.torch_model import TorchModel
from .slowdowns import RandomSlowdown, Slowdowns, parse_random
from .stepclock import StepClock, parse_duration

T = TypeVar("T")


class UsageError(ValueError):
    """A bad ``mpidl train`` option or set-up (raised on every rank alike)."""


#: The errors :func:`train` raises on every rank alike (the others are one rank's failure).
AGREED_ERRORS = (UsageError, data.DatasetError, checkpoint.CheckpointError, collectives.ArgumentError)


def _parser(kind: Callable[[str], T], accept: Callable[[T], bool], wanted: str) -> Callable[[str], T]:
    """An argparse type: ``kind(text)`` if ``accept`` takes it, else "expected <wanted>"."""

    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    parse.__name__ = wanted
    return parse


_positive_int = _parser(int, lambda v: v > 0, "a positive int")
_nonnegative_int = _parser(int, lambda v: v >= 0, "an integer >= 0")
_nonnegative_float = _parser(float, lambda v: v >= 0, "a number >= 0")


@dataclass(frozen=True)
class AlgorithmOption:
    """A command-line option handed to the algorithms whose constructor takes ``keyword``
    (``switch``: a boolean, ``--flag`` or ``--no-flag``)."""

    flag: str
    keyword: str
    help: str
    choices: Sequence[str] | None = None
    type: Callable[[str], Any] = str
    metavar: str | None = None
    switch: bool = False

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments."""
        return self.flag.lstrip("-").replace("-", "_")

    def applies_to(self) -> list[str]:
        """Names of the algorithms that take this option."""
        every = {**algorithms.ALGORITHMS, **peers.PEERS}
        return [name for name, cls in every.items() if self.keyword in inspect.signature(cls).parameters]


#: Algorithm options of the command line; each goes to the algorithms whose constructor takes its keyword.
ALGORITHM_OPTIONS = (
    AlgorithmOption("--topology", "topology", "communication graph (default ring)", list(TOPOLOGIES)),
    AlgorithmOption("--weights", "weights", "mixing weights on the graph (default uniform)", list(WEIGHTS)),
    AlgorithmOption(
        "--collective",
        "collective",
        "the all-reduce algorithm (default auto: the cost model's choice)",
        list(collectives.COLLECTIVES),
    ),
    AlgorithmOption(
        "--layout",
        "layout",
        "ranks per node, e.g. 2 or 3,1: LSGD's groups, and the nodes of the "
        "topology-aware all-reduce algorithms (default: detected, or MPIDL_RANKS_PER_NODE)",
    ),
    AlgorithmOption(
        "--max-lead",
        "max_lead",
        "steps a worker may run ahead of the exchanges it completed with a ring neighbor; 0 is synchronous (default 2)",
        type=_nonnegative_int,
    ),
    AlgorithmOption("--group-size", "group_size", "workers per P-Reduce group (default 2)", type=_positive_int),
    AlgorithmOption(
        "--policy", "policy", "how the group generator forms groups (default smart)", list(collectives.POLICIES)
    ),
    AlgorithmOption(
        "--partner",
        "partner",
        "how an active worker chooses the neighbor of its next averaging: random, or aware of nodes and "
        "measured link costs (default random)",
        ["random", "aware"],
    ),
    AlgorithmOption(
        "--cross-every",
        "cross_every",
        "aware partners and policy: every how many averagings a worker crosses nodes (default 2)",
        type=_positive_int,
    ),
    AlgorithmOption(
        "--local-steps", "local_steps", "optimizer steps between averagings (default 1)", type=_positive_int
    ),
    AlgorithmOption(
        "--period",
        "period",
        "static policy: averagings a partition of the workers is kept (default 1)",
        type=_positive_int,
    ),
    AlgorithmOption(
        "--overlap",
        "overlap",
        "communicate during forward and backward (--no-overlap: after them; default: overlap where every "
        "rank has a core to spare)",
        switch=True,
    ),
    AlgorithmOption(
        "--bucket-mb",
        "bucket_mb",
        "the size at which a gradient bucket is closed, in MiB (default 4; DDP's 25)",
        type=_parser(float, lambda v: v > 0, "a positive number"),
    ),
    AlgorithmOption(
        "--compression",
        "compression",
        f"compress what is sent: NAME[:PARAM] of {', '.join(collectives.COMPRESSORS)}, e.g. fp16, qsgd:127, "
        "sign, topk:0.01, powersgd:4 (default none), then @allgather, @reduce_scatter or @hierarchical "
        "(exact inside a node, compressed across) to choose how sign, qsgd and the casts are aggregated; "
        "allreduce: every gradient bucket; lsgd: among the groups; dpsgd: CHOCO-SGD's gossip; adpsgd and prague: "
        "the same, with copies per edge; "
        "ddp: its powersgd:R and fp16 hooks; horovod: fp16",
        metavar="NAME[:PARAM][@AGG]",
    ),
    AlgorithmOption(
        "--error-feedback",
        "error_feedback",
        "carry what compression dropped into the next step (default: for topk and powersgd)",
        switch=True,
    ),
    AlgorithmOption(
        "--local-momentum",
        "local_momentum",
        "apply the optimizer's momentum on each worker before compressing (default: for sign and topk, "
        "where the optimizer has momentum)",
        switch=True,
    ),
    AlgorithmOption(
        "--compression-start",
        "compression_start",
        "steps all-reduced uncompressed before compression starts (default 0)",
        type=_parser(int, lambda v: v >= 0, "a number of steps >= 0"),
        metavar="K",
    ),
    AlgorithmOption(
        "--clip-norm",
        "clip_norm",
        "clip each tensor of each worker's gradient to this l2 norm before compression (DGC's local "
        "clipping; default none)",
        type=_parser(float, lambda v: v > 0, "a positive number"),
        metavar="C",
    ),
    AlgorithmOption(
        "--momentum-masking",
        "momentum_masking",
        "zero the local momentum of the elements top-k sent (DGC's momentum factor masking; default: on "
        "for top-k with local momentum)",
        switch=True,
    ),
    AlgorithmOption(
        "--sparsity-warmup",
        "sparsity_warmup",
        "top-k keeps 25 %%, 6.25 %%, ... of the elements, K steps each, before its ratio (DGC's warm-up; "
        "default 0: none)",
        type=_parser(int, lambda v: v >= 0, "a number of steps >= 0"),
        metavar="K",
    ),
    AlgorithmOption(
        "--gamma",
        "gamma",
        "CHOCO-SGD's consensus step size (default: by compressor, docs/training.rst; adpsgd moves each of a "
        "pair by half of it, prague each member of a group of k by 1/k of it towards each other member)",
        type=_parser(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ),
)

_FLAG_OF = {opt.keyword: opt.dest for opt in ALGORITHM_OPTIONS}

#: The prefix of the algorithm's arrays (:meth:`algorithms.Algorithm.state_dict`) in a checkpoint.
_ALGORITHM_ARRAY = "algorithm."


@dataclass
class TrainConfig:
    """What to train, and how (the ``mpidl train`` options without the output files)."""

    algorithm: str = "allreduce"  # the synchronous baseline, as Horovod and DDP train (docs/training.rst)
    options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_dir: str | None = None
    train_samples: int | None = None
    test_samples: int | None = None
    model: str = "mlp"
    hidden: tuple[int, ...] = (64,)
    epochs: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    backend: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    slow: dict[int, float] = field(default_factory=dict)
    slowdown: RandomSlowdown | None = None
    step_time: float | None = None
    polled_waits: bool | None = None
    timeline: bool = False
    progress: bool = True
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    on_failure: str = "abort"


@dataclass
class TrainResult:
    """A finished run: its description, the per-epoch records, this worker's final
    parameters, every worker's step times and CPU use (:func:`mpidl.stragglers.report`),
    and on rank 0 the timeline recorded (:func:`mpidl.timeline.stop`), if one was;
    the workers that died (``--on-failure continue``: ``{"epoch", "lost", "workers",
    "samples_per_worker"}`` each: the epoch, their ``MPI_COMM_WORLD`` ranks, the
    survivors' number and shard sizes); ``reporter``: whether this worker is rank 0
    of those that finished (it writes the outputs)."""

    meta: dict[str, Any]
    epochs: list[dict[str, Any]]
    params: np.ndarray
    workers: dict[str, Any] = field(default_factory=dict)
    timeline: dict[str, Any] | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    reporter: bool = False


def parse_slow(text: str) -> tuple[int, float]:
    """Parse ``RANK:FACTOR`` (e.g. "3:4") of ``--slow``."""
    rank, sep, factor = text.partition(":")
    try:
        if not sep:
            raise ValueError
        value = (int(rank), float(factor))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --slow {text!r}: use RANK:FACTOR, e.g. 3:4") from None
    if value[0] < 0 or not value[1] >= 1:
        raise argparse.ArgumentTypeError(f"bad --slow {text!r}: RANK must be >= 0 and FACTOR >= 1")
    return value


def _parse_slowdown(text: str) -> RandomSlowdown:
    try:
        return parse_random(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(s) for s in text.split(",")) if text else ()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl train`` options."""
    defaults = TrainConfig()
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--algorithm",
        default=defaults.algorithm,
        choices=[*algorithms.ALGORITHMS, *peers.PEERS],
        help=f"training algorithm, or a peer in the same harness (ddp: PyTorch DDP over gloo; horovod: "
        f"Horovod's DistributedOptimizer over MPI, where installed; default {defaults.algorithm})",
    )
    g.add_argument(
        "--on-failure",
        default=defaults.on_failure,
        choices=faults.ON_FAILURE,
        help="what a worker's death does: abort ends the job; continue lets the survivors train on, with "
        f"the dead worker's data dealt among them (for {', '.join(_surviving())}, where the MPI library has "
        f"ULFM: docs/failures.rst; default {defaults.on_failure})",
    )
    for opt in ALGORITHM_OPTIONS:
        how: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction}
            if opt.switch
            else {"choices": opt.choices, "type": opt.type, "metavar": opt.metavar}
        )
        g.add_argument(opt.flag, default=None, help=f"{opt.help}; for {', '.join(opt.applies_to())}", **how)
    g = p.add_argument_group("data and model")
    g.add_argument(
        "--dataset",
        default=defaults.dataset,
        choices=list(data.DATASETS),
        help="digits: scikit-learn's bundled digits; fashion-mnist, mnist: IDX files from --data-dir (default: "
        f"Debian's {data.FASHION_MNIST_DIR}, or where 'mpidl data fetch' puts them, {data.user_dir('DATASET')})",
    )
    g.add_argument("--data-dir", metavar="DIR", help="folder of the dataset's files")
    g.add_argument(
        "--train-samples", type=_positive_int, metavar="N", help="train on the first N samples only (default all)"
    )
    g.add_argument(
        "--test-samples", type=_positive_int, metavar="N", help="test on the first N samples only (default all)"
    )
    g.add_argument(
        "--model",
        default=defaults.model,
        choices=models.MODELS,
        help="mlp (--hidden), lenet (LeNet-5) or resnet (ResNet-8 with BatchNorm); the CNNs need torch "
        f"(default {defaults.model})",
    )
    g.add_argument(
        "--hidden",
        type=_sizes,
        default=defaults.hidden,
        metavar="N[,N...]",
        help="the MLP's hidden layer sizes, '' for none (default 64)",
    )
    g.add_argument(
        "--backend",
        default=defaults.backend,
        choices=models.BACKENDS,
        help="model backend (default auto: torch if installed, else numpy)",
    )
    g.add_argument(
        "--device",
        default=defaults.device,
        choices=["cpu", "cuda"],
        help="where the torch model and its buffers live (cuda: GPU local rank mod GPU count)",
    )
    g.add_argument("--threads", type=_positive_int, help="threads per worker (default: cores / ranks on the node)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int, default=defaults.epochs, help=f"(default {defaults.epochs})")
    g.add_argument(
        "--batch-size",
        type=_positive_int,
        default=defaults.batch_size,
        help=f"per worker (default {defaults.batch_size})",
    )
    g.add_argument("--lr", type=_nonnegative_float, default=defaults.lr, help=f"learning rate (default {defaults.lr})")
    g.add_argument(
        "--momentum", type=_nonnegative_float, default=defaults.momentum, help=f"(default {defaults.momentum})"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the initial model, the shards and every epoch's order (default 0)",
    )
    g.add_argument(
        "--slow",
        type=parse_slow,
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="make RANK's computation FACTOR times as long by sleeping (repeatable)",
    )
    g.add_argument(
        "--slowdown",
        type=_parse_slowdown,
        metavar="p=PROB,F=FACTOR,P=STEPS",
        help="random transient slowdowns: each worker, in each period of STEPS of its steps, is FACTOR "
        "times as slow with probability PROB, drawn from the seed (or seed=S), the rank and the period",
    )
    g.add_argument(
        "--step-time",
        type=parse_duration,
        metavar="TIME",
        help="paced compute: every step's computation takes TIME (e.g. 150ms) times its slowdown, "
        "the gradient computed for real and the rest slept",
    )
    g.add_argument(
        "--polled-waits",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the main thread's waits for communication poll with back-off sleeps instead of "
        "MPI's busy waiting (default: with --step-time)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write the run's description and per-epoch metrics as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="plot test accuracy against time and epoch (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument(
        "--timeline",
        metavar="FILE",
        help="write every rank's computation, communication and waiting per step as a Chrome trace "
        "(open it in https://ui.perfetto.dev or chrome://tracing)",
    )
    g.add_argument(
        "--timeline-plot",
        metavar="FILE.png",
        help="draw a Gantt chart of steps 1-3 of the timeline, a row per rank and thread (needs matplotlib)",
    )
    g = p.add_argument_group("checkpoints")
    g.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="write checkpoints into DIR: after the last step, and every --checkpoint-every steps",
    )
    g.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=0,
        metavar="K",
        help="also write a checkpoint after every K-th step",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint DIR (same options; --epochs may grow)",
    )


def _surviving() -> list[str]:
    """Names of the algorithms that can survive a dead worker (they take ``on_failure``)."""
    return [name for name, cls in algorithms.ALGORITHMS.items() if "on_failure" in inspect.signature(cls).parameters]


def algorithm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The constructor keywords of ``args.algorithm`` from the algorithm options given.

    Raises:
        UsageError: an option given that the algorithm does not take.
    """
    options = {}
    for opt in ALGORITHM_OPTIONS:
        value = getattr(args, opt.dest)
        if value is None:
            continue
        takers = opt.applies_to()
        if args.algorithm not in takers:
            raise UsageError(
                f"{opt.flag} does not apply to --algorithm {args.algorithm} (it applies to {', '.join(takers)})"
            )
        options[opt.keyword] = value
    return options


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``mpidl train`` arguments."""
    slow: dict[int, float] = {}
    for rank, factor in args.slow:
        if rank in slow:
            raise UsageError(f"--slow given twice for rank {rank}")
        slow[rank] = factor
    return TrainConfig(
        algorithm=args.algorithm,
        options=algorithm_options(args),
        dataset=args.dataset,
        data_dir=args.data_dir,
        train_samples=args.train_samples,
        test_samples=args.test_samples,
        model=args.model,
        hidden=args.hidden,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        backend=args.backend,
        device=args.device,
        threads=args.threads,
        slow=slow,
        slowdown=args.slowdown,
        step_time=args.step_time,
        polled_waits=args.polled_waits,
        timeline=bool(args.timeline or args.timeline_plot),
        progress=not args.no_progress,
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        on_failure=args.on_failure,
    )


def _agreed(comm: MPI.Comm, fn: Callable[[], T]) -> T:
    """Run the local set-up ``fn`` on every rank; if it failed on any, raise a
    :class:`UsageError` on every rank (so that none waits in a collective)."""
    try:
        value: T | None = fn()
        problem = None
    except (ValueError, ImportError, RuntimeError) as exc:
        value, problem = None, str(exc)
    failed = [(rank, p) for rank, p in enumerate(comm.allgather(problem)) if p]
    if failed:
        rank, problem = failed[0]
        raise UsageError(
            problem
            if len({p for _, p in failed}) == 1 and len(failed) == comm.Get_size()
            else f"rank {rank}: {problem}"
        )
    return cast(T, value)


def _set_threads(threads: int, backend: str) -> None:
    """Limit torch's and numpy's BLAS threads (threadpoolctl, when installed)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(limits=threads)
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)


def _setup(config: TrainConfig, local: MPI.Comm, dataset: data.Dataset) -> tuple[models.Model, int]:
    """This worker's model (with its optimizer) and thread count; local checks only."""
    threads = config.threads or max(1, (os.cpu_count() or 1) // local.Get_size())
    device = models.rank_device(config.device, local.Get_rank())
    net = models.make(
        config.model,
        dataset.shape,
        dataset.classes,
        hidden=config.hidden,
        backend=config.backend,
        seed=config.seed,
        device=device,
    )
    _set_threads(threads, net.backend)
    net.make_optimizer(config.lr, config.momentum)
    return net, threads


def _progress(total: int, show: bool, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False, disable=not show)


def train(config: TrainConfig, comm: MPI.Comm | None = None) -> TrainResult:
    """Run the training of ``config`` (collective over ``comm``, default ``MPI.COMM_WORLD``).

    Rank 0 prints a header, one line per epoch and a summary on stdout.
    Every rank returns the result.

    Raises:
        UsageError, data.DatasetError, collectives.ArgumentError: bad
            options or set-up, on every rank alike (:data:`AGREED_ERRORS`);
            any other exception is this rank's alone, and leaves without
            closing the algorithm (module docstring).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    bad = sorted(r for r in config.slow if r >= comm.Get_size())
    if bad:
        raise UsageError(f"--slow names rank(s) {bad}, but there are only {comm.Get_size()} ranks")
    if config.resume and not config.checkpoint:
        raise UsageError("--resume needs --checkpoint DIR, the folder to resume from")
    if config.on_failure == "continue" and config.algorithm not in _surviving():
        raise UsageError(
            f"--on-failure continue: --algorithm {config.algorithm} cannot go on without a dead worker "
            f"(only {', '.join(_surviving())} can); use --on-failure abort, the default"
        )
    if config.on_failure == "continue" and config.timeline:
        raise UsageError("--timeline gathers every worker's record at the end: not with --on-failure continue")
    dataset = data.load(config.dataset, config.data_dir, comm).subset(config.train_samples, config.test_samples)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        net, threads = _agreed(comm, lambda: _setup(config, local, dataset))
    finally:
        local.Free()
    steps = data.steps_per_epoch(len(dataset.y_train), comm.Get_size(), config.batch_size)
    options = dict(config.options)
    cls = peers.PEERS.get(config.algorithm) or algorithms.ALGORITHMS[config.algorithm]
    if "seed" in inspect.signature(cls).parameters:
        options["seed"] = config.seed  # the algorithm's own random choices (neighbors, groups)
    if config.on_failure != "abort":
        options["on_failure"] = config.on_failure
    algo = cls(net.model, net.optimizer, comm, **options)
    if isinstance(algo, peers.DDP):
        assert isinstance(net, TorchModel), "DDP refuses other models"
        net.forward_module = algo.forward_module  # the forward pass goes through the DDP wrapper
    if isinstance(algo, peers.Horovod):
        net.optimizer = algo.optimizer  # Horovod's optimizer keeps the momentum (checkpoints)
    survives = bool(getattr(algo, "survives", False))
    budget = pacing.StepBudget(comm, comm.Get_size() * steps, survives=survives) if algo.uneven_steps else None
    polled = config.step_time is not None if config.polled_waits is None else config.polled_waits
    run: _Run | None = None
    try:
        run = _Run(config, dataset, net, algo, steps, threads, budget, polled)
        if config.resume:
            run.load_algorithm_state(_agreed(comm, run.restore))
        if comm.Get_rank() == 0:
            print(_header(run.meta), flush=True)
        blocking = p2p.poll_waits(polled)
        try:
            if config.timeline:
                timeline.start(comm)
            run.epochs()
            trace = timeline.stop() if config.timeline else None
        finally:
            timeline.abandon()  # where an exception left before stop(): this rank's recording is dropped
            p2p.poll_waits(blocking)
        workers = stragglers.report(run.times, run.cpu, algo.comm)
        params = net.to_numpy(algo.params)
    except AGREED_ERRORS:  # every rank is here: they close together
        _close(algo, budget if run is None else run.budget)
        raise
    # Any other exception is this rank's alone and leaves at once, unclosed: closing is
    # collective, and would wait for the other ranks (or fail first with an error of its
    # own) before the exception is printed; mpidl.init()'s hook prints it and ends the job.
    _close(algo, run.budget)
    reporter = algo.comm.Get_rank() == 0  # after close(), which may have recovered from a failure
    if reporter and run.records:
        last = run.records[-1]
        print(
            f"final: test accuracy {100 * last['test_acc']:.2f}% (averaged model), "
            f"{100 * last['test_acc_worst']:.2f}% (worst worker); "
            f"{last['bytes_per_step_mean']:.0f} B sent per worker per step = "
            f"{last['bytes_per_step_mean'] / run.meta['model_bytes']:.2f} x model; "
            f"{last['time_s']:.2f} s training",
            flush=True,
        )
        print(stragglers.table(workers), flush=True)
    return TrainResult(run.meta, run.records, params, workers, trace, run.failures, reporter)


def _close(algo: algorithms.Algorithm, budget: pacing.StepBudget | None) -> None:
    """Close the algorithm and the step budget (collective; the budget is abandoned where
    the algorithm's workers are no longer its own: a worker died)."""
    algo.close()
    if budget is not None and budget.comm is algo.comm:
        budget.close()
    elif budget is not None:
        budget.abandon()


class _Run:
    """The training loop of one worker, and its state (what a checkpoint holds).

    An epoch is ``steps`` steps on every worker; for an algorithm whose
    workers may take different numbers of steps (``uneven_steps``: AD-PSGD,
    Prague with random or smart groups) it is ``budget``'s instead: n x
    ``steps`` steps of all workers together, each worker stepping at its own
    speed (:mod:`mpidl.pacing`). Either way the algorithm settles before the
    evaluation. Where a worker died, the survivors' budget and shards take
    over (module docstring).

    Attributes:
        step: steps taken (all epochs).
        budget: the step budget (uneven steps), the survivors' after a failure.
        sweep: batches per pass over this worker's shard.
        failures: the workers that died (:class:`TrainResult`).
        time_s: training time of the finished epochs.
        epoch_s, loss_sum: training time and sum of minibatch losses of the
            current epoch so far (0 between epochs).
        records: the finished epochs' metrics.
    """

    def __init__(
        self,
        config: TrainConfig,
        dataset: data.Dataset,
        net: models.Model,
        algo: algorithms.Algorithm,
        steps: int,
        threads: int,
        budget: pacing.StepBudget | None,
        polled: bool,
    ) -> None:
        self.config, self.net, self.algo, self.steps, self.budget = config, net, algo, steps, budget
        self.meta = _describe(config, dataset, net, algo, steps, threads, polled)
        slowdowns = Slowdowns(algo.rank, config.slow, config.slowdown, config.seed)
        self.clock = StepClock(slowdowns, config.step_time)
        self.updated_s = 0.0  # what the last step() took besides communicating (the update)
        self.times = stragglers.StepTimes()
        self.cpu = stragglers.CpuMeter()
        self.samples, self.sweep = len(dataset.y_train), steps
        self.indices = data.shard(self.samples, algo.rank, algo.size, config.seed)
        self.dealt = algo.comm  # the workers among whom the training set is dealt
        self.survives = bool(getattr(algo, "survives", False))
        self.failures: list[dict[str, Any]] = []
        self.x_train, self.y_train = net.array(dataset.x_train), net.array(dataset.y_train)
        self.x_test, self.y_test = net.array(dataset.x_test), net.array(dataset.y_test)
        self.step, self.time_s, self.epoch_s, self.loss_sum = 0, 0.0, 0.0, 0.0
        self.records: list[dict[str, Any]] = []
        self.node_bytes = metrics.NodeBytes()

    def signature(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint's (all but the epochs and the outputs)."""
        keys = (
            "algorithm",
            "options",
            "workers",
            "dataset",
            "train_samples",
            "model_spec",
            "backend",
            "batch_size",
            "lr",
            "momentum",
            "seed",
        )
        return {k: self.meta[k] for k in keys}

    def epochs(self) -> None:
        """Train from the current state to the last epoch; rank 0 prints a line per epoch."""
        total = self.config.epochs * self.steps
        bar = _progress(total, self.config.progress and self.algo.rank == 0, f"train {self.config.algorithm}")
        bar.update(min(self.step, total))
        self.cpu.start()
        try:
            for epoch in range(self.step // self.steps + 1, self.config.epochs + 1):
                self._epoch(epoch, bar)
        finally:
            self.cpu.stop()
            bar.close()

    def _epoch(self, epoch: int, bar: Any) -> None:
        """Finish ``epoch`` (from its first step not yet taken), evaluate, checkpoint when due."""
        cfg, net, algo = self.config, self.net, self.algo
        t0 = time.perf_counter()
        if self.budget is None:
            loss_sum, taken, t0 = self._synchronous_steps(epoch, bar, t0)
        else:
            loss_sum, taken = self._budgeted_steps(epoch)
            bar.update(self.steps)
        with events.span("settle", events.COMMUNICATION, epoch=epoch):
            algo.settle()
            net.synchronize()
        epoch_s = self.epoch_s + time.perf_counter() - t0
        self.time_s += epoch_s
        self.epoch_s, self.loss_sum = 0.0, 0.0
        internode_bytes = self.node_bytes.total
        with self.node_bytes.excluding(), events.span("evaluate", events.EVALUATION, epoch=epoch):
            record = metrics.measure(
                epoch,
                algo,
                net,
                self.x_test,
                self.y_test,
                algo.comm,
                loss_sum=float(loss_sum),
                steps=taken,
                time_s=self.time_s,
                epoch_s=epoch_s,
                internode_bytes=internode_bytes,
            )
        self.records.append(record)
        if algo.rank == 0:
            bar.write(metrics.line(self.records[-1], cfg.epochs, self.meta["model_bytes"]), file=sys.stdout)
            sys.stdout.flush()
        if self._due() or epoch == cfg.epochs:
            self._save()

    def _synchronous_steps(self, epoch: int, bar: Any, t0: float) -> tuple[Any, int, float]:
        """The rest of ``epoch``'s steps, checkpointing when due; (loss sum, steps, the
        time the epoch's current stretch of training started). Where a worker died, the
        survivors settle, deal the training set among themselves and take the steps their
        epoch has beyond those taken (module docstring)."""
        sweep = self.sweep  # the steps of this epoch: an epoch of as many workers as there are
        batches = data.epoch_batches(self.indices, sweep, self.config.seed, epoch, self.algo.rank)
        order = self.net.array(np.concatenate(batches))
        ends = np.cumsum([len(b) for b in batches]).tolist()
        loss_sum: Any = self.loss_sum
        first = 0 if self.failures else self.step - (epoch - 1) * self.steps  # a resumed run has lost none
        for k in range(first, sweep):
            loss_sum = loss_sum + self._train_step(order[(ends[k - 1] if k else 0) : ends[k]])
            bar.update()
            if k < sweep - 1 and self._due():
                self.net.synchronize()
                self.epoch_s += time.perf_counter() - t0
                self.loss_sum = float(loss_sum)
                self._save()
                t0 = time.perf_counter()
        taken = sweep
        while self.survives:
            with events.span("settle", events.COMMUNICATION, epoch=epoch):
                self.algo.settle()  # every survivor has taken as many steps: they recover here or agree
            if not self._stale():
                break
            self._regroup(epoch, taken)
            stream = data.batch_stream(self.indices, self.sweep, self.config.seed, epoch, self.algo.rank)
            for _ in range(self.sweep - taken):
                loss_sum = loss_sum + self._train_step(self.net.array(next(stream)))
            taken = self.sweep
        return loss_sum, taken, t0

    def _budgeted_steps(self, epoch: int) -> tuple[Any, int]:
        """Steps until the epoch's budget is spent; (loss sum, steps taken by this worker).
        Where a worker dies, the survivors leave the loop, settle (recovering, each in its
        step or its settle) and spend the rest of the epoch with their own budget and
        shards (:meth:`_regroup`)."""
        loss_sum: Any = 0.0
        taken = 0
        while True:
            if self._stale():
                self._regroup(epoch, taken)
            budget = self.budget
            assert budget is not None  # the loop of an uneven-steps algorithm
            stream = data.batch_stream(self.indices, self.sweep, self.config.seed, epoch, self.algo.rank)
            budget.begin_epoch()
            while not budget.over() and not self._stale():
                loss_sum = loss_sum + self._train_step(self.net.array(next(stream)))
                budget.step()
                taken += 1
            if not budget.survives:
                return loss_sum, taken
            with events.span("settle", events.COMMUNICATION, epoch=epoch):
                self.algo.settle()  # every survivor is here, or recovering in its last step: they agree
            if not self._stale():
                return loss_sum, taken

    def _stale(self) -> bool:
        """Whether the algorithm has recovered from a worker's death since the budget was made."""
        return self.dealt is not self.algo.comm

    def _regroup(self, epoch: int, taken: int) -> None:
        """After a worker died (collective over the survivors, settled): abandon the step
        budget, deal the training set among the survivors, and make their budget, which
        counts the ``taken`` steps of each in ``epoch`` (module docstring; an algorithm
        without a budget takes the steps of its epoch, :attr:`sweep`, beyond those)."""
        algo, old = self.algo, self.budget
        if old is not None:
            old.abandon()
        lost = [r for r in getattr(algo, "lost", []) if all(r not in f["lost"] for f in self.failures)]
        self.sweep = data.steps_per_epoch(self.samples, algo.size, self.config.batch_size)
        self.indices = data.shard(self.samples, algo.rank, algo.size, self.config.seed)
        self.dealt = algo.comm
        with p2p.waiting(algo.comm):
            counted, shards = algo.comm.allreduce(taken), algo.comm.allgather(len(self.indices))
        if old is not None:
            self.budget = pacing.StepBudget(algo.comm, algo.size * self.sweep, counted, survives=True)
        self.failures.append({"epoch": epoch, "lost": lost, "workers": algo.size, "samples_per_worker": shards})
        if algo.rank == 0:
            print(
                f"# epoch {epoch}: worker(s) {', '.join(map(str, lost))} of MPI_COMM_WORLD died; {algo.size} "
                f"continue, the {self.samples} training samples dealt among them ({min(shards)}-{max(shards)} "
                f"each), the epoch's {counted} steps so far counted towards {algo.size} x {self.sweep}",
                flush=True,
            )

    def _train_step(self, batch: Any) -> Any:
        """One step on ``batch``: the gradient, the paced or slowed wait (:mod:`mpidl.stepclock`),
        the algorithm's step, each timed (:class:`mpidl.stragglers.StepTimes`, and a span each
        while a timeline is recorded); returns the loss."""
        net, algo = self.net, self.algo
        k = algo.iterations
        t0 = time.perf_counter()
        algo.zero_grad()
        loss = net.loss_backward(self.x_train[batch], self.y_train[batch])
        net.synchronize()
        t1 = time.perf_counter()
        factor, overrun = self.clock.pause(k, t1 - t0, self.updated_s)
        t2 = time.perf_counter()
        waited = algo.comm_wait_s
        algo.step()
        t3 = time.perf_counter()
        waited = algo.comm_wait_s - waited
        self.updated_s = t3 - t2 - waited
        self.times.add(t1 - t0, t2 - t0, t3 - t0, waited, factor, overrun)
        recorder = events.active
        if recorder is not None:
            recorder.add("compute", events.COMPUTE, t0, t1, step=k)
            if self.clock.step_time is not None or factor != 1:
                recorder.add("paced" if self.clock.step_time else "slowed", events.PACED, t1, t2, step=k, factor=factor)
            recorder.add("step", events.STEP, t2, t3, step=k)
        self.step += 1
        return loss

    def _due(self) -> bool:
        """Whether a ``--checkpoint-every K`` checkpoint is due: after every K-th step; with
        uneven steps (asked at epoch ends only), after an epoch in which a multiple of K
        steps per worker falls (module docstring)."""
        every = self.config.checkpoint_every
        if not self.config.checkpoint or every == 0:
            return False
        if self.budget is None:
            return self.step % every == 0
        end = self.records[-1]["epoch"] * self.steps
        return end // every > (end - self.steps) // every

    def _save(self) -> None:
        """Settle the algorithm and write the checkpoint at the current position
        (collective): after :attr:`step`, or with uneven steps after the last epoch
        recorded, whose position is its steps per worker of a synchronous run (every
        worker's own count differs; the algorithm's state keeps it)."""
        if not self.config.checkpoint:
            return
        algo, net = self.algo, self.net
        algo.settle()  # again at an epoch end (cheap): nothing may be in flight for the state below
        state = algo.state_dict()
        step = self.step if self.budget is None else self.records[-1]["epoch"] * self.steps
        info = {
            "run": self.signature(),
            "step": step,
            "time_s": self.time_s,
            "epoch_s": self.epoch_s,
            "loss_sum": self.loss_sum,
            "records": self.records,
            "algorithm": {k: v for k, v in state.items() if not isinstance(v, np.ndarray)},
            "internode_bytes": self.node_bytes.total,
            "step_times": self.times.state(),
        }
        arrays = {
            "params": net.to_numpy(algo.params),
            **({"buffers": net.to_numpy(algo.state[algo.flat.size :])} if algo.flat.has_buffers else {}),
            **net.optimizer_state(),
            **{_ALGORITHM_ARRAY + k: v for k, v in state.items() if isinstance(v, np.ndarray)},
        }
        checkpoint.save(self.config.checkpoint, step, algo.comm, arrays, info)

    def restore(self) -> dict[str, Any]:
        """Continue from the newest checkpoint in ``config.checkpoint`` (local): the
        model, the optimizer and the run's counters; return the algorithm's state, for
        :meth:`load_algorithm_state` once every rank has read its file.

        Raises:
            UsageError: the checkpoint is of another run.
            checkpoint.CheckpointError: this worker's file cannot be read, or what it
                holds does not fit (a key missing, an array of another size), naming the file.
        """
        assert self.config.checkpoint, "restore() without a checkpoint folder"
        arrays, info = checkpoint.load(self.config.checkpoint, self.algo.rank)
        missing = sorted({"run", "step", "time_s", "epoch_s", "loss_sum", "records", "algorithm"} - set(info))
        if missing:
            raise UsageError(
                f"the checkpoint in {self.config.checkpoint} lacks {', '.join(missing)}: "
                "written by an earlier mpidl, it cannot be resumed"
            )
        differ = {k: (v, self.signature()[k]) for k, v in info["run"].items() if self.signature().get(k) != v}
        if differ:
            raise UsageError(
                "the checkpoint is of another run: "
                + "; ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in differ.items())
            )
        algo = self.algo
        try:
            self.net.load(algo.params, arrays.pop("params"))
            if algo.flat.has_buffers:
                self.net.load(algo.state[algo.flat.size :], arrays.pop("buffers"))
            state = dict(info["algorithm"])
            for key in [k for k in arrays if k.startswith(_ALGORITHM_ARRAY)]:
                state[key[len(_ALGORITHM_ARRAY) :]] = arrays.pop(key)
            self.net.load_optimizer_state(arrays)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # what the file holds does not fit
            problem = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc)
            raise checkpoint.CheckpointError(
                f"{checkpoint.rank_file(self.config.checkpoint, algo.rank)}: {problem}"
            ) from exc
        self.step, self.time_s, self.epoch_s = info["step"], info["time_s"], info["epoch_s"]
        self.loss_sum, self.records = info["loss_sum"], info["records"]
        self.node_bytes.carry(info.get("internode_bytes", 0))
        if "step_times" in info:
            self.times = stragglers.StepTimes.from_state(info["step_times"])
        return state

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        """Load the algorithm's state that :meth:`restore` returned (collective).

        Raises:
            checkpoint.CheckpointError: on every rank, where it does not fit on some
                rank, naming that rank's file.
        """
        assert self.config.checkpoint, "load_algorithm_state() without a checkpoint folder"
        try:
            self.algo.load_state_dict(state)
        except algorithms.StateError as exc:  # raised on every rank alike: the first rank it names
            rank, problem = next(iter(exc.problems.items()))
            raise checkpoint.CheckpointError(
                f"rank {rank}: {checkpoint.rank_file(self.config.checkpoint, rank)}: {problem}"
            ) from exc


def _describe(
    config: TrainConfig,
    dataset: data.Dataset,
    net: models.Model,
    algo: algorithms.Algorithm,
    steps: int,
    threads: int,
    polled: bool,
) -> dict[str, Any]:
    """The ``meta`` part of the JSON: the run's configuration and what it resolved to."""
    meta = {
        "command": "mpidl train",
        "version": __version__,
        "algorithm": config.algorithm,
        "options": {_FLAG_OF.get(k, k): str(v) for k, v in config.options.items()},
        "workers": algo.size,
        "dataset": dataset.name,
        "train_samples": len(dataset.y_train),
        "test_samples": len(dataset.y_test),
        "features": dataset.features,
        "classes": dataset.classes,
        "model": net.name,
        "model_spec": net.spec,
        "parameters": net.parameters,
        "model_bytes": algo.flat.nbytes,
        "backend": net.backend,
        "device": str(net.device),
        "threads": threads,
        "uneven_steps": algo.uneven_steps,
        **schedule_meta(config, steps),
        "polled_waits": polled,
        "on_failure": config.on_failure,
        "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
    }
    topo = getattr(algo, "topology", None)
    if isinstance(topo, Topology):
        meta["topology"] = {"name": topo.name, "spectral_gap": topo.spectral_gap}
    return meta


def schedule_meta(config: Any, steps: int) -> dict[str, Any]:
    """The run description's fields of the schedule and the pace (epochs, steps per epoch,
    batch, optimizer, seed, slowdowns, step time) that ``mpidl train`` and ``mpidl
    simulate`` share: ``config`` a :class:`TrainConfig` or a simulation's config."""
    return {
        "epochs": config.epochs,
        "steps_per_epoch": steps,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "momentum": config.momentum,
        "seed": config.seed,
        "slow": {str(r): f for r, f in sorted(config.slow.items())},
        "slowdown": config.slowdown.describe() if config.slowdown is not None else None,
        "step_time_s": config.step_time,
    }


def _header(meta: dict[str, Any]) -> str:
    """The two lines rank 0 prints before training."""
    what = meta["algorithm"]
    if meta["options"]:
        what += " (" + ", ".join(f"{k}={v}" for k, v in meta["options"].items()) + ")"
    if "topology" in meta:
        what += f", {meta['topology']['name']} spectral gap {meta['topology']['spectral_gap']:.3f}"
    slow = "".join(f", rank {r} slowed x{f:g}" for r, f in meta["slow"].items())
    if meta["slowdown"] is not None:
        r = meta["slowdown"]
        slow += f", random slowdowns x{r['F']:g} with p={r['p']:g} per {r['P']} steps"
    if meta["step_time_s"] is not None:
        slow += f", paced {1e3 * meta['step_time_s']:g} ms per step"
    return (
        f"# mpidl train: {what} on {meta['dataset']} ({meta['train_samples']} train / "
        f"{meta['test_samples']} test samples), {meta['workers']} workers{slow}\n"
        f"# {meta['model']} ({meta['parameters']} parameters, {meta['model_bytes']} B), {meta['backend']} on "
        f"{meta['device']}, {meta['threads']} thread(s) per worker; {meta['epochs']} epochs x "
        + (
            f"{meta['workers'] * meta['steps_per_epoch']} steps of all workers together"
            if meta["uneven_steps"]
            else f"{meta['steps_per_epoch']} steps"
        )
        + f", batch <= {meta['batch_size']} per worker, lr {meta['lr']}, "
        f"momentum {meta['momentum']}, seed {meta['seed']}"
    )


def write_json(result: TrainResult, path: str) -> None:
    """Write ``{"meta": ..., "epochs": [...], "workers": ..., "failures": [...]}`` to ``path``."""
    with open(path, "w") as f:
        out = {"meta": result.meta, "epochs": result.epochs, "workers": result.workers, "failures": result.failures}
        json.dump(out, f, indent=1)


def main(args: argparse.Namespace) -> int:
    """Run ``mpidl train`` with parsed ``args``; rank 0 prints and writes the files."""
    from .runtime import USAGE_EXIT_CODE, init

    comm = init()
    # one algorithm per size from the first step, the persisted one where there is one: repeatable bits
    collectives.set_tuning(deterministic=True, watch=False)
    try:
        config = config_from_args(args)
        if args.plot or args.timeline_plot:
            _agreed(comm, plotting.require)
        result = train(config, comm)
    except AGREED_ERRORS as exc:
        if comm.Get_rank() == 0:
            print(f"mpidl train: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if result.reporter:
        if args.json:
            write_json(result, args.json)
        if args.plot:
            metrics.plot(result.epochs, args.plot, f"{config.algorithm} on {config.dataset}, {comm.Get_size()} workers")
        if result.timeline is not None and args.timeline:
            timeline.write(result.timeline, args.timeline)
        if result.timeline is not None and args.timeline_plot:
            title = f"mpidl train --algorithm {config.algorithm}, {comm.Get_size()} workers"
            timeline.plot(result.timeline, args.timeline_plot, title=title)
    return 0


__all__ = [
    "AGREED_ERRORS",
    "ALGORITHM_OPTIONS",
    "AlgorithmOption",
    "TrainConfig",
    "TrainResult",
    "UsageError",
    "add_arguments",
    "algorithm_options",
    "config_from_args",
    "main",
    "parse_slow",
    "train",
    "write_json",
]
