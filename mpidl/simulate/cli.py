"""``mpidl simulate``: an algorithm on n simulated workers, in virtual time, in one process.

    mpidl simulate --algorithm adpsgd --workers 64 --slow 63:4 --epochs 2

Each simulated worker trains the numpy MLP on its own shard with real
gradients and averages real parameters, as ``mpidl train --backend numpy
--step-time C`` would on n ranks; time advances by models (the paced step
times f x C, the flow-level network at ``--rate``), not by clocks
(:mod:`mpidl.simulate`). Prints one line per epoch: virtual training time
(evaluations excluded), the averaged model's test accuracy and the
consensus distance; then each worker's steps, and the time to ``--target``.
No MPI launcher is needed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from collectives.tuning.costmodel import Params

from .. import data
from ..compare import time_to
from ..stepclock import parse_duration
from ..train import _nonnegative_float, _parse_slowdown, _positive_int, _sizes, parse_slow
from .network import parse_rate
from .patterns import ALLREDUCES
from .prague import POLICIES
from .run import SIMULATED, SimConfig, simulate


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl simulate`` options."""
    defaults = SimConfig()
    g = p.add_argument_group("cluster")
    g.add_argument("--algorithm", default=defaults.algorithm, choices=list(SIMULATED), help="(default allreduce)")
    g.add_argument("--workers", type=_positive_int, default=defaults.workers, help="(default 16)")
    g.add_argument(
        "--ranks-per-node", type=_positive_int, default=defaults.ranks_per_node, help="workers per node (default 2)"
    )
    g.add_argument("--rate", type=_rate, default="1gbit", help="every node's link, each way (default 1gbit)")
    g.add_argument(
        "--costmodel",
        metavar="FILE",
        help="the latencies and intra-node rate from a cost-model calibration (default: its built-in values)",
    )
    g.add_argument("--step-time", type=parse_duration, default="150ms", help="paced step C (default 150ms)")
    g.add_argument("--slow", type=parse_slow, action="append", default=[], metavar="RANK:FACTOR", help="(repeatable)")
    g.add_argument("--slowdown", type=_parse_slowdown, metavar="p=PROB,F=FACTOR,P=STEPS", help="random slowdowns")
    g = p.add_argument_group("algorithm")
    g.add_argument("--collective", choices=list(ALLREDUCES), help="allreduce: (default hierarchical_ring)")
    g.add_argument("--policy", choices=POLICIES, help="prague: the group generator's policy (default smart)")
    g.add_argument("--group-size", type=_positive_int, help="prague: (default 2)")
    g.add_argument("--local-steps", type=_positive_int, help="prague: steps between averagings (default 1)")
    g = p.add_argument_group("training")
    g.add_argument("--dataset", default=defaults.dataset, choices=list(data.DATASETS), help="(default fashion-mnist)")
    g.add_argument("--data-dir", metavar="DIR", help="folder of the dataset's files")
    g.add_argument("--train-samples", type=_positive_int, metavar="N", help="the first N samples only")
    g.add_argument("--test-samples", type=_positive_int, metavar="N", help="the first N samples only")
    g.add_argument("--hidden", type=_sizes, default=defaults.hidden, metavar="N[,N...]", help="(default 64)")
    g.add_argument("--epochs", type=_positive_int, default=defaults.epochs, help="(default 5)")
    g.add_argument("--batch-size", type=_positive_int, default=defaults.batch_size, help="per worker (default 32)")
    g.add_argument("--lr", type=_nonnegative_float, default=defaults.lr, help="(default 0.05)")
    g.add_argument("--momentum", type=_nonnegative_float, default=defaults.momentum, help="(default 0.9)")
    g.add_argument("--seed", type=int, default=defaults.seed, help="(default 0)")
    g.add_argument("--target", type=float, metavar="ACC", help="report the virtual time to this test accuracy")
    g.add_argument("--json", metavar="FILE", help="write the run as mpidl train --json does")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` of parsed ``args``.

    Raises:
        ValueError: an option given for an algorithm that does not take it, or an
            unreadable ``--costmodel`` file.
    """
    keywords = {"collective": "allreduce", "policy": "prague", "group_size": "prague", "local_steps": "prague"}
    options: dict[str, Any] = {}
    for key, algorithm in keywords.items():
        value = getattr(args, key)
        if value is None:
            continue
        if algorithm != args.algorithm:
            raise ValueError(f"--{key.replace('_', '-')} is for --algorithm {algorithm}, not {args.algorithm}")
        options[key] = value
    params = None
    if args.costmodel:
        try:
            params = Params.load(args.costmodel)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--costmodel {args.costmodel}: {exc}") from None
    return SimConfig(
        algorithm=args.algorithm,
        options=options,
        workers=args.workers,
        ranks_per_node=args.ranks_per_node,
        dataset=args.dataset,
        data_dir=args.data_dir,
        train_samples=args.train_samples,
        test_samples=args.test_samples,
        hidden=args.hidden,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        step_time=args.step_time,
        slow=dict(args.slow),
        slowdown=args.slowdown,
        rate=args.rate,
        params=params,
    )


def main(args: argparse.Namespace) -> int:
    """Run ``mpidl simulate`` with parsed ``args``; 2 for a bad option."""
    try:
        config = config_from_args(args)
        print(
            f"# mpidl simulate: {config.algorithm} on {config.workers} workers "
            f"({config.ranks_per_node} per node, links {8 * config.rate / 1e9:g} Gbit/s), "
            f"paced {1e3 * config.step_time:g} ms per step",
            flush=True,
        )
        result = simulate(config, report=lambda text: print(text, flush=True))
    except (ValueError, data.DatasetError) as exc:
        print(f"mpidl simulate: error: {exc}")
        return 2
    steps = result.workers["steps"]
    print(
        f"steps per worker: min {min(steps)}, max {max(steps)}; simulated in {result.meta['simulated']['wall_s']:.1f} s"
    )
    if args.target is not None:
        reached = time_to(result.epochs, args.target)
        print(f"to {100 * args.target:g}%: " + (f"{reached:.1f} s (virtual)" if reached is not None else "not reached"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.json(), f, indent=1)
    return 0


__all__ = ["add_arguments", "config_from_args", "main"]
