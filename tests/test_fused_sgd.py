"""SGD's update fused with the shared-memory all-reduce (algorithms/fused_sgd.py): the bits of
the unfused step, state the optimizer keeps whole, memory that outlives close()."""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
from collectives import ArgumentError
from collectives.kernels import resident
from collectives.transport.context import context

pytestmark = pytest.mark.mpi
torch = pytest.importorskip("torch")

#: Buckets closed at 256 bytes: the test model gets several, and a weight spans two ranks' parts.
SMALL_BUCKETS = 1 / 4096
#: The update is fused where every bucket is all-reduced in shared memory: "shm" makes sure
#: of it (what "auto" chooses depends on this machine's calibration).
SHM = "shm"

OPTIONS = [
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True},
    {"momentum": 0.8, "dampening": 0.25, "maximize": True},
    {},
]


def model_and_optimizer(options: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.SGD]:
    """8 -> 33 -> BatchNorm -> 5, seed 0; two parameter groups (the first with its own lr and weight decay)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.BatchNorm1d(33), torch.nn.Linear(33, 5)
    )
    params = list(model.parameters())
    groups = [{"params": params[:2], "lr": 0.05, "weight_decay": 1e-2}, {"params": params[2:]}]
    return model, torch.optim.SGD(groups, lr=0.1, **options)


def backward(model: torch.nn.Module, comm: MPI.Comm, step: int) -> None:
    """This rank's loss at ``step`` (own data), backward."""
    g = torch.Generator().manual_seed(1000 * step + comm.Get_rank())
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def snapshot(algo: algorithms.AllReduceSGD) -> list[torch.Tensor]:
    """Copies of the state (parameters, BatchNorm buffers), the gradients and every momentum buffer."""
    opt = algo.optimizer
    buffers = [opt.state[p].get("momentum_buffer") for p, _ in algo.flat.views]
    return [algo.state.clone(), algo.grads.clone()] + [b.clone() for b in buffers if b is not None]


def train(comm: MPI.Comm, options: dict[str, Any], fuse: bool | None, steps: int = 6) -> tuple[list, Any]:
    """``steps`` AllReduce-SGD steps with an LR schedule; the snapshot after them and the
    algorithm (closed)."""
    model, opt = model_and_optimizer(options)
    algo = algorithms.AllReduceSGD(model, opt, comm, collective=SHM, fuse_update=fuse, bucket_mb=SMALL_BUCKETS)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for step in range(steps):
        algo.zero_grad()
        backward(model, comm, step)
        algo.step()
        schedule.step()
    out = snapshot(algo)
    algo.close()
    return out, algo


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("options", OPTIONS, ids=["momentum", "nesterov", "dampening-maximize", "plain"])
def test_the_fused_update_gives_the_bits_of_the_optimizer(size: int, options: dict[str, Any]) -> None:
    """Parameters, buffers, averaged gradients and momentum after 6 steps: bitwise those of
    all-reduce then optimizer.step(), on every rank, and the same bytes counted. An LR
    scheduler sees every step (no warning that optimizer.step() was not called)."""
    comm = comm_of_size(size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused, algo = train(comm, options, None)
    plain, unfused = train(comm, options, False)
    ok = algo.fused_update is None and unfused.fused_update is None  # closed: released
    ok &= len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
    params = fused[0][: algo.flat.size].numpy().tobytes()
    ok &= len(set(comm.allgather(params))) == 1
    # the all-reduce's bytes, not the update's writes
    ok &= algo.bytes_sent == unfused.bytes_sent and (algo.bytes_sent > 0) == (comm.Get_size() > 1)
    assert all_ok(MPI.COMM_WORLD, ok), (size, options)


def test_fused_steps_mix_with_synchronize_and_a_loaded_optimizer_state() -> None:
    """A fused step, a step through synchronize(), clipping and optimizer.step(), an optimizer
    state loaded from a copy, fused steps again: the bits of the same sequence unfused."""
    comm = MPI.COMM_WORLD

    def run(fuse: bool | None) -> tuple[list, bool]:
        model, opt = model_and_optimizer({"momentum": 0.9})
        algo = algorithms.AllReduceSGD(model, opt, comm, collective=SHM, fuse_update=fuse, bucket_mb=SMALL_BUCKETS)
        active = algo.fused_update is not None
        saved = None
        for step in range(6):
            algo.zero_grad()
            backward(model, comm, step)
            if step in (1, 4):
                algo.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            else:
                algo.step()
            if step == 1:
                state = opt.state_dict()["state"]
                saved = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in state.items()}}
            if step == 3:
                assert saved is not None
                opt.load_state_dict({**opt.state_dict(), **saved})
        out = snapshot(algo)
        algo.close()
        return out, active

    (fused, active), (plain, _) = run(None), run(False)
    ok = active == (comm.Get_size() > 1)
    ok &= all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert all_ok(comm, ok)


def test_views_taken_before_close_stay_valid() -> None:
    """close() moves the parameters and momentum back into private memory; a state dict
    and a momentum buffer taken before it still read the values they had (the shared
    memory lasts as long as a view of it)."""
    comm = MPI.COMM_WORLD
    model, opt = model_and_optimizer({"momentum": 0.9})
    algo = algorithms.AllReduceSGD(model, opt, comm, collective=SHM, bucket_mb=SMALL_BUCKETS)
    for step in range(2):
        algo.zero_grad()
        backward(model, comm, step)
        algo.step()
    held = model.state_dict()
    momentum = opt.state[model[0].weight]["momentum_buffer"]
    expected = {k: v.clone() for k, v in held.items()}, momentum.clone()
    shared = algo.fused_update is not None
    algo.close()
    moved = model[0].weight.data_ptr() != held["0.weight"].data_ptr()
    ok = moved == shared and all(torch.equal(held[k], v) for k, v in expected[0].items())
    ok &= torch.equal(momentum, expected[1]) and torch.equal(opt.state[model[0].weight]["momentum_buffer"], momentum)
    assert all_ok(comm, ok)


def test_fuse_update_errors_name_the_reason() -> None:
    """fuse_update=True where it cannot apply: an ArgumentError on every rank saying why."""
    comm = MPI.COMM_WORLD
    cases: list[tuple[dict[str, Any], str]] = [
        ({"fuse_update": "yes"}, "fuse_update must be"),
        ({"fuse_update": True, "overlap": True}, "overlap"),
        ({"fuse_update": True, "collective": "ring"}, "shared memory"),
        ({"fuse_update": True, "compression": "fp16"}, "compressed"),
    ]
    if comm.Get_size() == 1:
        cases.append(({"fuse_update": True}, "shared memory"))
    failures = []
    for options, words in cases:
        model, opt = model_and_optimizer({"momentum": 0.9})
        options = {"overlap": False, **options}  # else one rank with a core to spare overlaps: that reason first
        try:
            algorithms.AllReduceSGD(model, opt, comm, bucket_mb=SMALL_BUCKETS, **options).close()
            failures.append(f"{options}: no error")
        except ArgumentError as exc:
            if words not in str(exc):
                failures.append(f"{options}: {exc}")
    model, _ = model_and_optimizer({})
    adam = torch.optim.Adam(model.parameters())
    try:
        algorithms.AllReduceSGD(model, adam, comm, fuse_update=True).close()
        failures.append("Adam: no error")
    except ArgumentError as exc:
        if "Adam, not torch.optim.SGD" not in str(exc):
            failures.append(f"Adam: {exc}")
    with algorithms.AllReduceSGD(model, adam, comm) as algo:  # None: not fused, no error
        if algo.fused_update is not None:
            failures.append("Adam fused")
    assert all_ok(comm, not failures), failures


def test_shared_memory_that_cannot_be_allocated_fails_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resident, "SHM_DIR", "/nonexistent/mpidl")
    node = context(MPI.COMM_WORLD).comm
    try:
        resident.SharedVectors(node, 100, np.float32)
        message = ""
    except OSError as exc:
        message = str(exc)
    assert all_ok(MPI.COMM_WORLD, "cannot allocate" in message and "/nonexistent/mpidl" in message), message


def test_workers_with_their_own_models_are_not_fused() -> None:
    """broadcast_init=False, each worker its own initial model: the update is not fused (the
    rank that reduces a block would write its own parameters into every worker's), so the
    steps give the bits of fuse_update=False; fuse_update=True says why not, on every rank."""
    comm = MPI.COMM_WORLD

    def run(fuse: bool | None) -> tuple[list, bool]:
        model, opt = model_and_optimizer({"momentum": 0.9})
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + comm.Get_rank())
        with algorithms.AllReduceSGD(
            model, opt, comm, collective=SHM, fuse_update=fuse, bucket_mb=SMALL_BUCKETS, broadcast_init=False
        ) as algo:
            for step in range(3):
                algo.zero_grad()
                backward(model, comm, step)
                algo.step()
            return snapshot(algo), algo.fused_update is not None

    (own, fused), (plain, _) = run(None), run(False)
    ok = not fused and all(torch.equal(a, b) for a, b in zip(own, plain))
    ok &= comm.Get_size() == 1 or len(set(comm.allgather(own[0].numpy().tobytes()))) == comm.Get_size()
    model, opt = model_and_optimizer({"momentum": 0.9})
    with pytest.raises(ArgumentError, match=r"fuse_update=True, but the workers keep their own models"):
        algorithms.AllReduceSGD(model, opt, comm, collective=SHM, fuse_update=True, broadcast_init=False)
    assert all_ok(comm, ok)


class SmallShm:
    """``os.posix_fallocate`` on a ``/dev/shm`` with ``room`` bytes for this process (the
    shared vectors' allocation: :func:`collectives.kernels.resident.node_memory`), what
    was allocated counted since the last :meth:`empty`."""

    def __init__(self, room: int) -> None:
        self.room, self.used, self._allocate = room, 0, os.posix_fallocate

    def empty(self) -> None:
        self.used = 0

    def __call__(self, fd: int, offset: int, length: int) -> None:
        if self.used + length > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.used += length
        self._allocate(fd, offset, length)


@pytest.mark.parametrize("room", [1.5, 2.5], ids=["no-room-for-the-parameters", "no-room-for-the-momentum"])
def test_a_small_dev_shm_falls_back_to_the_unfused_update(room: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /dev/shm with room for the gradients but not for the update's parameters (or its
    momentum) beside them, on rank 1 alone: every rank falls back to the unfused update, which
    gives the bits of fuse_update=False; rank 0 says so once, the others not; with
    fuse_update=True the OSError is raised on every rank."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("the update is fused on two or more ranks")
    model, _ = model_and_optimizer({})
    gradients = sum(p.numel() for p in model.parameters()) * 4
    shm = SmallShm(int(room * gradients))
    if comm.Get_rank() == 1:
        monkeypatch.setattr(os, "posix_fallocate", shm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, algo = train(comm, {"momentum": 0.9}, None)
    said = [w for w in caught if "not fused with the all-reduce" in str(w.message)]
    shm.empty()
    try:
        train(comm, {"momentum": 0.9}, True)
        refused = ""
    except OSError as exc:
        refused = str(exc)
    monkeypatch.undo()
    plain, _ = train(comm, {"momentum": 0.9}, False)
    ok = algo.resident and all(torch.equal(a, b) for a, b in zip(fallback, plain))
    ok &= len(said) == (1 if comm.Get_rank() == 0 else 0) and "No space left" in refused
    assert all_ok(comm, ok), (said, refused)
