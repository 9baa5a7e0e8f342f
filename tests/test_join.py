"""Uneven inputs (``AllReduceSGD.join()``): workers with different numbers of batches end
with the model a reference computes from the averages of the workers still in at each
step, bit for bit, the same on every worker, without a hang."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, needs_torch

import algorithms
from algorithms import SGD
from collectives import ArgumentError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

WIDTH = 7
LR, MOMENTUM = 0.25, 0.5  # powers of two: the reference's arithmetic is the algorithm's


def batches(n: int) -> list[int]:
    """Batches per worker: uneven, one worker with none where there are three or more."""
    return [4, 2, 0, 5][:n] if n > 2 else [4, 2][:n]


def gradient(rank: int, step: int) -> np.ndarray:
    """Worker ``rank``'s gradient at ``step``: integers, so that every sum is exact."""
    return (np.arange(WIDTH) + 1.0) * (rank + 1) + 3 * step


def reference(counts: list[int]) -> np.ndarray:
    """The model after SGD on the average over the workers still in, step by step."""
    x = np.zeros(WIDTH)
    opt = SGD(x, lr=LR, momentum=MOMENTUM)
    for step in range(max(counts)):
        still_in = [r for r, c in enumerate(counts) if c > step]
        opt.grad[:] = sum(gradient(r, step) for r in still_in) / len(still_in)
        opt.step()
    return x


def numpy_run(comm: MPI.Comm, counts: list[int], **options: Any) -> tuple[np.ndarray, algorithms.AllReduceSGD]:
    rank = comm.Get_rank()
    x = np.zeros(WIDTH)
    algo = algorithms.AllReduceSGD(x, SGD(x, lr=LR, momentum=MOMENTUM), comm, **options)
    with algo, algo.join() as join:
        for step in range(counts[rank]):
            algo.step(gradient(rank, step))
    assert join.rounds == max(counts)  # every step of the workers still in, taken or answered
    return x, algo


@pytest.mark.parametrize("collective", ["ring", "auto"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_numpy_models_end_as_the_reference(size: int, collective: str) -> None:
    comm = comm_of_size(size)
    counts = batches(comm.Get_size())
    x, algo = numpy_run(comm, counts, collective=collective)
    same = len(set(comm.allgather(x.tobytes()))) == 1
    ok = same and np.array_equal(x, reference(counts)) and algo.iterations == max(counts)
    assert all_ok(comm, ok), (x, reference(counts), algo.iterations)


@pytest.mark.parametrize("size", [2, 3])
def test_even_inputs_give_the_bits_of_the_plain_step(size: int) -> None:
    """Every worker with the same batches: join() changes nothing but the count."""
    comm = comm_of_size(size)
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(WIDTH) for _ in range(3)]
    models = []
    for joined in (False, True):
        x = np.ones(WIDTH)
        algo = algorithms.AllReduceSGD(x, SGD(x, lr=0.1, momentum=0.9), comm, collective="ring")
        with algo, algo.join() if joined else algo.no_sync(enabled=False):
            for g in grads:
                algo.step(g)
        models.append(x.tobytes())
    assert all_ok(comm, models[0] == models[1])


@needs_torch
@pytest.mark.parametrize(
    "options",
    [
        {"overlap": False, "collective": "ring"},
        {"overlap": True, "collective": "ring"},
        {"overlap": False, "collective": "shm"},  # the gradients in shared memory, the update fused
        {"overlap": True, "collective": "shm"},
    ],
    ids=["ring", "ring-overlap", "shm-fused", "shm-overlap"],
)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_torch_models_end_as_the_reference(size: int, options: dict[str, Any]) -> None:
    """A linear model whose gradient is the batch, stepped by the optimizer itself (as DDP's
    loop does), in buckets of one parameter; momentum and all."""
    import torch

    comm = comm_of_size(size)
    n, rank = comm.Get_size(), comm.Get_rank()
    counts = batches(n)
    model = torch.nn.Sequential(*(torch.nn.Linear(1, 1, bias=False) for _ in range(WIDTH))).double()
    for layer in model:
        torch.nn.init.zeros_(layer.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with algorithms.AllReduceSGD(model, opt, comm, bucket_mb=1e-6, **options) as algo:
        with algo.join():
            for step in range(counts[rank]):
                opt.zero_grad()
                inputs = torch.from_numpy(gradient(rank, step))
                sum(layer(inputs[i : i + 1]).sum() for i, layer in enumerate(model)).backward()
                opt.step()
        fused = algo.fused_update is not None
    x = np.array([layer.weight.item() for layer in model])
    same = len(set(comm.allgather(x.tobytes()))) == 1
    ok = same and np.array_equal(x, reference(counts)) and algo.iterations == max(counts)
    assert all_ok(comm, ok), (x, reference(counts), algo.overlap, fused)


@needs_torch
def test_the_optimizer_state_is_the_last_workers() -> None:
    """After the block every worker holds the momentum of the workers that stepped last."""
    import torch

    comm = comm_of_size(3)
    rank = comm.Get_rank()
    model = torch.nn.Linear(WIDTH, 1, bias=False).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with algorithms.AllReduceSGD(model, opt, comm, collective="ring") as algo, algo.join() as join:
        for step in range(batches(comm.Get_size())[rank]):
            opt.zero_grad()
            (model.weight * torch.from_numpy(gradient(rank, step))).sum().backward()
            opt.step()
    momentum = opt.state[model.weight]["momentum_buffer"].numpy().tobytes()
    last = batches(comm.Get_size()).index(max(batches(comm.Get_size())))
    assert all_ok(comm, len(set(comm.allgather(momentum))) == 1 and join.last == last), join.last


@pytest.mark.parametrize("size", [2, 3])
def test_an_argument_error_inside_the_block_ends_it_on_every_rank(size: int) -> None:
    """mpidl raises an ArgumentError on every rank alike: the block ends without answering
    steps nobody takes, and the algorithm steps on afterwards."""
    comm = comm_of_size(size)
    x = np.zeros(3)
    with algorithms.AllReduceSGD(x, SGD(x, lr=1.0), comm, collective="ring") as algo:
        with pytest.raises(ArgumentError), algo.join():
            algo.step(np.ones(3))
            algorithms.broadcast_parameters({"x": x}, comm, root=comm.Get_size())
        algo.step(np.ones(3))
    assert all_ok(comm, np.array_equal(x, np.full(3, -2.0)))


def test_what_join_refuses() -> None:
    comm = comm_of_size(2)
    x = np.zeros(4)
    compressed = algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, compression="sign")
    with compressed, pytest.raises(ArgumentError, match="compressed all-reduces cannot"):
        compressed.join()
    averaging = algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, average_buffers=True)
    with averaging, pytest.raises(ArgumentError, match="average_buffers=True"):
        averaging.join()
    algo = algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm)
    with algo, algo.join(), pytest.raises(RuntimeError, match=r"join\(\) inside join\(\)"):
        algo.join()
    for name in ("dpsgd", "adpsgd"):
        with algorithms.create(name, x, SGD(x, lr=0.1), comm) as algo, pytest.raises(NotImplementedError):
            algo.join()
