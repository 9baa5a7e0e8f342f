"""A script written for Horovod, ported call for call (``examples/horovod_port.py``), trains
to the model a reference computes, on every rank alike; ``mpidl.DistributedOptimizer``
is AllReduce-SGD behind the optimizer's own interface."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, mpiexec, needs_torch, on_rank0_quietly

import algorithms
import mpidl
from collectives import ArgumentError

ROOT = Path(__file__).resolve().parent.parent
PORT = ROOT / "examples" / "horovod_port.py"

pytestmark = [pytest.mark.mpi, needs_torch]


def port_reference(n: int) -> list[float]:
    """The port's final weights: SGD (lr 0.25, halved each epoch; momentum 0.5) on the
    average of the batches of the ranks still in at each step (rank r has 2 + r)."""
    from algorithms import SGD

    width, w = 6, np.zeros(6)
    opt = SGD(w, lr=0.25, momentum=0.5)
    for epoch in range(2):
        opt.lr = 0.25 * 0.5**epoch
        for step in range(n + 1):
            still_in = [r for r in range(n) if 2 + r > step]
            batch = [(np.arange(width) + 1.0) * (r + 1) + step + 10 * epoch for r in still_in]
            opt.grad[:] = sum(batch) / len(still_in)
            opt.step()
    return w.tolist()


@pytest.mark.timeout(150)
def test_the_ported_horovod_script_trains_as_the_reference() -> None:
    """Three ranks on two emulated nodes (``MPIDL_RANKS_PER_NODE=2``): the places, the
    weights (bit for bit, on every rank), the schedule's learning rate, the steps taken,
    the asynchronous sum and the gathered rows of per-rank count. The time limit covers
    three interpreters importing torch on a busy machine."""
    n = 3
    done = on_rank0_quietly(
        mpiexec, n, [str(PORT)], timeout=120, env={"MPIDL_RANKS_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda run: run["rank"])
    assert [run["rank"] for run in runs] == list(range(n))
    expected = port_reference(n)
    gathered = [[r, step] for r in range(n) for step in range(2 + r)]
    for run, (local_rank, local_size) in zip(runs, [(0, 2), (1, 2), (0, 1)]):
        assert (run["size"], run["local_rank"], run["local_size"]) == (n, local_rank, local_size), run
        assert run["weights"] == expected, (run["weights"], expected)
        assert run["lr"] == 0.0625 and run["steps"] == 2 * (n + 1), run
        assert run["batches"] == sum(2 + r for r in range(n)) and run["gathered"] == gathered, run


def net(seed: int):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def train(model, opt, comm: MPI.Comm, steps: int = 4) -> bytes:  # type: ignore[no-untyped-def]
    """Steps on this rank's own data with the optimizer's own step(); the parameters' bytes."""
    import torch

    g = torch.Generator().manual_seed(100 + comm.Get_rank())
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        (model(x) ** 2).mean().backward()
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


@pytest.mark.parametrize("size", [1, 2, 3])
def test_distributed_optimizer_is_allreduce_sgd(size: int) -> None:
    """The same bits as AllReduce-SGD built on the model, on every rank; still the
    optimizer's class (a scheduler takes it), with its settings and state."""
    import torch

    comm = comm_of_size(size)
    options = {"collective": "ring", "overlap": True, "bucket_mb": 1e-4}
    model = net(comm.Get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    distributed = mpidl.DistributedOptimizer(opt, model.named_parameters(), comm=comm, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(distributed, step_size=1, gamma=0.5)
    ours = train(model, distributed, comm)
    scheduler.step()
    theirs_model = net(comm.Get_rank())
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.1, momentum=0.9)
    with algorithms.create("allreduce", theirs_model, theirs_opt, comm, **options):
        theirs = train(theirs_model, theirs_opt, comm)
    ok = distributed is opt and isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "DistributedSGD"
    ok &= ours == theirs and len(set(comm.allgather(ours))) == 1
    ok &= opt.algorithm.iterations == 4 and opt.param_groups[0]["lr"] == 0.05
    ok &= all("momentum_buffer" in state for state in opt.state_dict()["state"].values())
    assert all_ok(comm, ok)
    opt.algorithm.close()


@pytest.mark.parametrize("size", [2, 3])
def test_synchronize_then_step_averages_once(size: int) -> None:
    """Horovod's clipping pattern: synchronize() leaves the average of the ranks' gradients
    in p.grad; step() inside skip_synchronize() then sends nothing more."""
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = mpidl.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), [("w", w)], comm=comm, collective="ring")
    (w * torch.full((4,), float(rank + 1), dtype=torch.float64)).sum().backward()
    opt.synchronize()
    averaged = bool(torch.all(w.grad == (n + 1) / 2))
    sent = opt.algorithm.bytes_sent
    with opt.skip_synchronize():
        opt.step()
    ok = averaged and opt.algorithm.bytes_sent == sent and bool(torch.all(w == -(n + 1) / 2))
    assert all_ok(comm, ok)
    opt.algorithm.close()


def test_what_distributed_optimizer_refuses() -> None:
    import torch

    comm = MPI.COMM_SELF
    model = net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ArgumentError, match="1 of the optimizer's 4 parameters are not in named_parameters"):
        mpidl.DistributedOptimizer(opt, named[1:], comm=comm)
    with pytest.raises(ArgumentError, match=r"names 0\.weight more than once"):
        mpidl.DistributedOptimizer(opt, [*named, ("0.weight", named[1][1])], comm=comm)
    opt = mpidl.DistributedOptimizer(opt, named, comm=comm)
    with pytest.raises(ArgumentError, match="distributed already"):
        mpidl.DistributedOptimizer(opt, named, comm=comm)
    opt.algorithm.close()
