"""``mpidl step-bench``: one training step, with and without communication and overlap, in one run.

For one model (:mod:`mpidl.models`: the MLP with ``--hidden`` sizes, or a
CNN) and one batch size, every rank times the same training step — zero
the gradients, forward, backward, optimizer step (SGD with momentum) — done
in several ways, each on its own copy of the model (same seed):

* ``local``: no communication at all (``optimizer.zero_grad()``, the plain
  torch loop): what the step costs one worker alone;
* ``comm``: the all-reduce (average) of a model-sized gradient alone, as
  AllReduce-SGD's algorithm choice runs it (``--collective``);
* ``allreduce`` and ``allreduce+overlap``: mpidl's AllReduce-SGD without
  and with its buckets all-reduced during backward (:mod:`algorithms.allreduce_sgd`);
  ``allreduce-unfused``: without overlap and without the SGD update fused with
  the all-reduce where ``allreduce`` fuses it (:mod:`algorithms.fused_sgd`: one
  node, gradients in shared memory);
* ``dpsgd`` and ``dpsgd+overlap``: D-PSGD (``--topology``) without and
  with the averaging run during forward and backward (:mod:`algorithms.dpsgd`);
* ``ddp``: PyTorch DistributedDataParallel over gloo with its defaults
  (25 MiB buckets, overlapped), the process group joined from the MPI ranks
  (:mod:`mpidl.torchdist`);
* ``horovod`` (asked for by name, where Horovod is installed): Horovod's
  ``DistributedOptimizer`` over MPI with its defaults (:class:`mpidl.peers.Horovod`);
  its background thread runs from set-up to the end, while the other
  candidates are timed too.

Timing, as ``mpidl bench`` does it: after warm-up steps, every repetition
times a batch of ``--steps`` steps of each candidate in turn (so the slow
drifts of a shared machine hit all of them alike), starting at a barrier;
a batch's time per step is the slowest rank's, and each candidate reports
the median over repetitions. The phases (zero, forward, backward, step: the
wall time of each call, communication included where it happens) are rank
0's medians. The summary gives each candidate's time over ``local``'s, and
DDP's time over each candidate's.

``--device cuda`` puts the models, batches and gradients on the rank's GPU
(local rank mod the GPU count; DDP stays on gloo, which takes CUDA tensors,
since NCCL refuses ranks that share a GPU); every phase then ends with a
device synchronisation, so that the host clock measures the device's work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import algorithms
import collectives
from algorithms.buckets import DEFAULT_BUCKET_MB
from algorithms.topology import TOPOLOGIES

from . import models, peers, torchdist

#: The candidates, in the order of the table.
CANDIDATES = (
    "local",
    "comm",
    "allreduce",
    "allreduce-unfused",
    "allreduce+overlap",
    "dpsgd",
    "dpsgd+overlap",
    "ddp",
    "horovod",
)
#: The candidates timed when none are named (Horovod, an optional peer, only by name).
DEFAULT_CANDIDATES = CANDIDATES[:-1]
#: The phases of a step, timed separately.
PHASES = ("zero", "forward", "backward", "step")

_clock = time.perf_counter

#: One timed step: the seconds of each of :data:`PHASES`.
Step = Callable[[], tuple[float, float, float, float]]


@dataclass
class Result:
    """One candidate's step (seconds): the median over repetitions of the slowest rank's
    time per step, every repetition's, and rank 0's median phases."""

    name: str
    time: float
    samples: list[float]
    phases: dict[str, float] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl step-bench`` options."""
    p.add_argument("--model", default="mlp", choices=models.MODELS, help="the network (default mlp)")
    p.add_argument(
        "--hidden",
        type=_sizes,
        default=(2048, 2048),
        metavar="N[,N...]",
        help="the MLP's hidden layer sizes (default 2048,2048)",
    )
    p.add_argument(
        "--shape",
        type=_sizes,
        metavar="C,H,W",
        help="the input sample's shape (default 1,8,8 for the MLP, as the digits; 1,28,28 for the CNNs)",
    )
    p.add_argument("--classes", type=int, default=10, help="output classes (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step per rank (default 32)")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: cores / ranks on the node)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the models, batches and gradients live (cuda: GPU local rank mod GPU count; default cpu)",
    )
    p.add_argument(
        "--collective",
        default=collectives.DEFAULT_COLLECTIVE,
        choices=list(collectives.COLLECTIVES),
        help="the all-reduce algorithm of comm and AllReduce-SGD (default auto)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_MB,
        help=f"the size at which AllReduce-SGD closes a bucket, in MiB (default {DEFAULT_BUCKET_MB:g})",
    )
    p.add_argument("--topology", default="ring", choices=list(TOPOLOGIES), help="D-PSGD's graph (default ring)")
    p.add_argument(
        "--candidates",
        default=",".join(DEFAULT_CANDIDATES),
        help=f"comma-separated subset of {','.join(CANDIDATES)} (default all but horovod)",
    )
    p.add_argument("--steps", type=int, default=10, help="steps per timed batch (default 10)")
    p.add_argument("--repeat", type=int, default=7, help="timed batches per candidate (median reported; default 7)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the models and the batches (default 0)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad sizes {text!r}; use e.g. 2048,2048") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def run(args: argparse.Namespace, comm: MPI.Comm) -> tuple[list[Result], dict[str, Any]]:
    """Build every candidate, time them interleaved (module docstring) and return
    (results, description); collective over ``comm``."""
    import torch

    names = [n for n in args.candidates.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if not names:
        raise ValueError(f"no candidate; valid: {', '.join(CANDIDATES)}")
    if unknown:
        raise ValueError(f"unknown candidate(s) {unknown}; valid: {', '.join(CANDIDATES)}")
    if min(args.steps, args.repeat, args.batch_size) < 1 or args.warmup < 0:
        raise ValueError("--steps, --repeat and --batch-size must be positive, --warmup not negative")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    threads = args.threads or max(1, (os.cpu_count() or 1) // local.Get_size())
    device = models.rank_device(args.device, local.Get_rank())
    local.Free()
    torch.set_num_threads(threads)
    shape = args.shape or ((1, 8, 8) if args.model == "mlp" else (1, 28, 28))

    def fresh() -> models.Model:
        net = models.make(
            args.model, shape, args.classes, hidden=args.hidden, backend="torch", seed=args.seed, device=device
        )
        net.make_optimizer(0.01, 0.9)
        return net

    rng = np.random.default_rng([args.seed, comm.Get_rank()])
    x = torch.from_numpy(rng.standard_normal((args.batch_size, math.prod(shape)), dtype=np.float32)).to(device)
    y = torch.from_numpy(rng.integers(0, args.classes, args.batch_size)).to(device)
    steps: dict[str, Step] = {}
    closers: list[Callable[[], None]] = []
    described: dict[str, Any] = {}
    for name in names:
        net = fresh()
        steps[name] = _candidate(name, net, x, y, comm, args, closers, described)
    describe = {
        "model": net.name,
        "parameters": net.parameters,
        "bytes": net.parameters * 4,  # float32
        "batch_size": args.batch_size,
        "ranks": comm.Get_size(),
        "threads": threads,
        "device": device,
        "collective": args.collective,
        "steps": args.steps,
        "repeat": args.repeat,
        **described,
    }
    samples: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    for _ in range(args.repeat):
        for name, step in steps.items():
            comm.Barrier()
            acc = np.zeros(len(PHASES))
            t0 = _clock()
            for _ in range(args.steps):
                acc += step()
            per_step = (_clock() - t0) / args.steps
            samples[name].append(comm.allreduce(per_step, op=MPI.MAX))
            phases[name].append(acc / args.steps)
    for close in closers:
        close()
    results = [
        Result(
            name,
            statistics.median(samples[name]),
            samples[name],
            dict(zip(PHASES, np.median(np.array(phases[name]), axis=0).tolist())),
        )
        for name in names
    ]
    return results, describe


def _candidate(
    name: str,
    net: models.Model,
    x: Any,
    y: Any,
    comm: MPI.Comm,
    args: argparse.Namespace,
    closers: list[Callable[[], None]],
    described: dict[str, Any],
) -> Step:
    """The timed step of candidate ``name`` on its own model ``net`` (module docstring)."""
    import torch

    module, opt, sync = net.model, net.optimizer, net.synchronize
    if name == "local":
        return _training_step(module, x, y, opt.zero_grad, opt.step, sync)
    if name == "comm":
        buf = torch.zeros(net.parameters, device=net.device)

        def alone() -> tuple[float, float, float, float]:
            t0 = _clock()
            collectives.allreduce(buf, comm, "avg", args.collective, validate=False)
            sync()
            return (0.0, 0.0, 0.0, _clock() - t0)

        return alone
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        torchdist.init_process_group(comm)
        on_gpu = net.device.type == "cuda"
        wrapper = DistributedDataParallel(module, device_ids=[net.device.index] if on_gpu else None)
        closers.append(torchdist.destroy_process_group)
        return _training_step(wrapper, x, y, opt.zero_grad, opt.step, sync)
    if name == "horovod":
        peer = peers.Horovod(module, opt, comm)
        closers.append(peer.close)
        return _training_step(module, x, y, peer.zero_grad, peer.step, sync)
    kind, _, overlap = name.partition("+")
    kind, _, unfused = kind.partition("-")
    options: dict[str, Any] = {"topology": args.topology}
    if kind == "allreduce":
        options = {"collective": args.collective, "bucket_mb": args.bucket_mb}
        options.update({"fuse_update": False} if unfused else {})
    algo = algorithms.create(kind, module, opt, comm, overlap=bool(overlap), **options)
    closers.append(algo.close)
    if isinstance(algo, algorithms.AllReduceSGD):
        if name == "allreduce":
            described["fused"] = algo.fused_update is not None
        described["buckets"] = [b.size * algo.flat.grad_data.itemsize for b in algo.buckets]
        described["bucket_collectives"] = list(algo.bucket_collectives)
        described["resident"] = algo.resident
        if algo.choice is not None:
            described["collective"] = f"auto ({algo.choice.algorithm})"
    return _training_step(module, x, y, algo.zero_grad, algo.step, sync)


def _training_step(
    module: Any, x: Any, y: Any, zero: Callable[[], object], step: Callable[[], object], sync: Callable[[], None]
) -> Step:
    """zero(), forward, backward, step(): the seconds of each, ``sync()`` (waiting for
    the device's queued work; nothing on the CPU) ending each phase."""
    import torch

    loss_fn = torch.nn.functional.cross_entropy

    def run() -> tuple[float, float, float, float]:
        t0 = _clock()
        zero()
        sync()
        t1 = _clock()
        loss = loss_fn(module(x), y)
        sync()
        t2 = _clock()
        loss.backward()
        sync()
        t3 = _clock()
        step()
        sync()
        return (t1 - t0, t2 - t1, t3 - t2, _clock() - t3)

    return run


def table(results: Sequence[Result]) -> str:
    """The results as a text table, with each candidate's time over ``local``'s and DDP's over its."""
    by_name = {r.name: r for r in results}
    local, ddp = by_name.get("local"), by_name.get("ddp")
    lines = [
        f"{'candidate':<18} {'step (ms)':>9} {'spread':>13} {'vs local':>8} {'ddp/it':>6}   "
        + " ".join(f"{p:>8}" for p in PHASES)
    ]
    for r in results:
        spread = f"{min(r.samples) * 1e3:.1f}-{max(r.samples) * 1e3:.1f}"
        vs_local = f"{r.time / local.time:8.2f}" if local else f"{'-':>8}"
        vs_ddp = f"{ddp.time / r.time:6.2f}" if ddp else f"{'-':>6}"
        lines.append(
            f"{r.name:<18} {r.time * 1e3:9.2f} {spread:>13} {vs_local} {vs_ddp}   "
            + " ".join(f"{r.phases[p] * 1e3:8.2f}" for p in PHASES)
        )
    if local and "comm" in by_name:
        both = local.time + by_name["comm"].time
        lines.append(f"{'local + comm':<18} {both * 1e3:9.2f} {'(sum)':>13} {both / local.time:8.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``mpidl step-bench`` with parsed ``args``; rank 0 prints and writes the JSON."""
    from .runtime import USAGE_EXIT_CODE, init

    comm = init()
    try:
        results, meta = run(args, comm)
    except ValueError as exc:
        if comm.Get_rank() == 0:
            print(f"mpidl step-bench: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if comm.Get_rank() == 0:
        buckets = meta.get("buckets")
        plan = f", {len(buckets)} buckets (largest {max(buckets) / 2**20:.1f} MiB)" if buckets else ""
        plan += ", gradients in shared memory" if meta.get("resident") else ""
        plan += ", update fused" if meta.get("fused") else ""
        print(
            f"# mpidl step-bench: {meta['model']} ({meta['parameters']:,} parameters, "
            f"{meta['bytes'] / 2**20:.1f} MiB), batch {meta['batch_size']} per rank, {meta['ranks']} ranks, "
            f"{meta['threads']} thread(s) per rank on {meta['device']}; all-reduce {meta['collective']}{plan}"
        )
        print(f"# median of {meta['repeat']} batches of {meta['steps']} steps; phases: rank 0's medians (ms)")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0
