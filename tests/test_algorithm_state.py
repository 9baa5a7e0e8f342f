"""Checkpoint state of the training algorithms on 1..4 ranks: after settle(), state_dict()
carried through JSON and load_state_dict() make a fresh instance continue the worker.

A synchronous algorithm's restored copy takes bit for bit the steps the original
takes (LSGD applies the delayed gradient sum it saved, static Prague resumes its
schedule where it was); an asynchronous one starts from exactly the saved state and
draws the random choices the original would have (AD-PSGD's neighbors)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
from algorithms import SGD

pytestmark = pytest.mark.mpi

DIM = 12

#: Configurations whose runs are reproducible: a restored copy must match bit for bit.
SYNC_CONFIGS = {
    "allreduce": ("allreduce", {"collective": "ring"}),
    "dpsgd": ("dpsgd", {"topology": "ring"}),
    "lsgd-pairs": ("lsgd", {"layout": 2, "collective": "ring"}),
    "lsgd-singletons": ("lsgd", {"layout": 1, "collective": "ring"}),
    "grsgd-synchronous": ("grsgd", {"max_lead": 0}),
    "prague-static-pairs": ("prague", {"policy": "static", "group_size": 2, "period": 2}),
    "prague-static-choco-topk": ("prague", {"policy": "static", "group_size": 2, "compression": "topk:0.25"}),
    "allreduce-topk": ("allreduce", {"collective": "ring", "compression": "topk:0.25"}),
    "allreduce-sign": ("allreduce", {"collective": "ring", "compression": "sign", "error_feedback": True}),
    "lsgd-pairs-sign": ("lsgd", {"layout": 2, "collective": "ring", "compression": "sign", "error_feedback": True}),
    "dpsgd-choco-topk": ("dpsgd", {"topology": "ring", "compression": "topk:0.25"}),
}

#: Configurations whose updates depend on the workers' timing.
ASYNC_CONFIGS = {
    "adpsgd": ("adpsgd", {}),
    "adpsgd-choco-topk": ("adpsgd", {"compression": "topk:0.25"}),
    "grsgd": ("grsgd", {"max_lead": 2}),
    "prague-random": ("prague", {"policy": "random", "local_steps": 2}),
    "prague-smart": ("prague", {"policy": "smart"}),
    "prague-choco-topk": ("prague", {"compression": "topk:0.25"}),
}


def gradient(x: np.ndarray, rank: int, t: int) -> np.ndarray:
    """Worker ``rank``'s gradient at step t: it depends on the step, so a copy must be at the right one."""
    return x - np.sin(np.arange(DIM) * (rank + 1) + t)


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a checkpoint gives it back: arrays as they are, the rest through JSON."""
    arrays = {k: v.copy() for k, v in state.items() if isinstance(v, np.ndarray)}
    return {**json.loads(json.dumps({k: v for k, v in state.items() if k not in arrays})), **arrays}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal states (comparing arrays bit for bit, the rest as JSON gives it back)."""
    a, b = through_json(a), through_json(b)
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


@dataclass
class Resumed:
    """An original worker and a fresh copy restored from the original's state.

    Attributes:
        comm: the workers.
        original, copy: the two algorithms (closed).
        x, y: their parameters at the end.
        state: the original's state, as a checkpoint gives it back.
        restored: whether the copy's state right after loading equals ``state``.
        ran, ran_again: what the original's and the copy's stretch after ``state`` returned.
    """

    comm: MPI.Comm
    original: algorithms.Algorithm
    copy: algorithms.Algorithm
    x: np.ndarray
    y: np.ndarray
    state: dict[str, Any]
    restored: bool
    ran: Any
    ran_again: Any


def resumed(config: tuple[str, dict[str, Any]], size: int, stretch: Callable[..., Any]) -> Resumed:
    """The original runs ``stretch(algo, x, rank, 0)``, settles and saves its state, then
    ``stretch(algo, x, rank, 10)``; the copy loads the state and runs ``stretch(copy, y, rank, 10)``."""
    comm = comm_of_size(size)
    name, options = config
    if "group_size" in options:
        options = {**options, "group_size": min(options["group_size"], comm.Get_size())}
    rank = comm.Get_rank()
    x = np.full(DIM, float(rank))
    with algorithms.create(name, x, SGD(x, lr=0.1), comm, **options) as original:
        stretch(original, x, rank, 0)
        original.settle()
        saved, state = x.copy(), through_json(original.state_dict())
        ran = stretch(original, x, rank, 10)
    y = np.zeros(DIM)
    with algorithms.create(name, y, SGD(y, lr=0.1), comm, **options) as copy:
        y[:] = saved
        copy.load_state_dict(state)
        restored = same(copy.state_dict(), state)
        ran_again = stretch(copy, y, rank, 10)
    return Resumed(comm, original, copy, x, y, state, restored, ran, ran_again)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(SYNC_CONFIGS))
def test_a_restored_synchronous_algorithm_takes_the_same_steps(config: str, size: int) -> None:
    def stretch(algo: algorithms.Algorithm, x: np.ndarray, rank: int, first: int) -> None:
        for t in range(first, first + 7):
            algo.step(gradient(x, rank, t))

    run = resumed(SYNC_CONFIGS[config], size, stretch)
    same_steps = run.restored and run.copy.iterations == 14 and np.array_equal(run.x, run.y)
    assert all_ok(run.comm, same_steps), (config, np.abs(run.x - run.y).max())
    if isinstance(run.original, algorithms.LSGD):  # the pipeline's sum, on every worker, with more than one group
        assert all_ok(run.comm, ("delayed_sum" in run.state) == (run.original.groups > 1))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(ASYNC_CONFIGS))
def test_a_restored_asynchronous_algorithm_starts_from_the_saved_state(config: str, size: int) -> None:
    """Random sleeps make the workers' speeds differ; the state is taken after settle()."""
    rng = np.random.default_rng(MPI.COMM_WORLD.Get_rank())

    def stretch(algo: algorithms.Algorithm, x: np.ndarray, rank: int, first: int) -> list[int | None]:
        """Ten steps, settled; the neighbors AD-PSGD drew."""
        peers = []
        for t in range(first, first + 10):
            time.sleep(rng.uniform(0, 5e-4))
            algo.step(gradient(x, rank, t))
            peers.append(getattr(algo, "last_peer", None))
        algo.settle()
        return peers

    run = resumed(ASYNC_CONFIGS[config], size, stretch)
    ok = run.restored and run.ran_again == run.ran and run.copy.iterations == 20
    assert all_ok(run.comm, ok), (config, run.state, run.ran, run.ran_again)


@pytest.mark.parametrize("name, late", [("adpsgd", 1), ("prague", 0)])
def test_every_worker_waits_for_one_slow_to_load_its_state(name: str, late: int) -> None:
    """load_state_dict() is collective: with one rank loading 0.5 s late, no other worker's
    first step reaches it before its parameters and state are in place. The late rank is
    one that others wait for: AD-PSGD's passive rank 1, whose server would average the
    parameters it had before; Prague's service rank 0 in groups of every worker, whose
    group generator would be loaded while requests wait. At lr 0 the workers' parameter
    sum is the loaded one."""
    comm = comm_of_size(4)
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    rank, size = comm.Get_rank(), comm.Get_size()
    options = {"group_size": size} if name == "prague" else {}
    x = np.full(DIM, float(rank))
    with algorithms.create(name, x, SGD(x, lr=0.0), comm, **options) as original:
        original.step(np.ones(DIM))
        original.settle()
        state = through_json(original.state_dict())
    y = np.zeros(DIM)
    with algorithms.create(name, y, SGD(y, lr=0.0), comm, **options) as copy:
        if rank == late:
            time.sleep(0.5)
        y[:] = rank + 1.0
        copy.load_state_dict(state)
        for _ in range(5):
            copy.step(np.ones(DIM))
        copy.settle()
    total = comm.allreduce(float(y.sum()))
    assert total == pytest.approx(DIM * size * (size + 1) / 2, rel=1e-12)


def test_lsgd_on_a_torch_model_with_momentum() -> None:
    """The delayed gradient sum of a torch model's LSGD, with the optimizer's own state_dict."""
    torch = pytest.importorskip("torch")
    comm = comm_of_size(4)
    rank = comm.Get_rank()

    def make(value: float) -> tuple[Any, Any, algorithms.Algorithm]:
        model = torch.nn.Linear(DIM, 1).double()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, algorithms.create("lsgd", model, opt, comm, layout=2, collective="ring")

    def steps(model: Any, algo: algorithms.Algorithm, first: int) -> None:
        for t in range(first, first + 6):
            algo.zero_grad()
            inputs = torch.sin(torch.arange(DIM, dtype=torch.float64) * (rank + 1) + t)
            model(inputs).square().sum().backward()
            algo.step()

    model, opt, algo = make(0.5)
    with algo:
        steps(model, algo, 0)
        algo.settle()
        saved, opt_state, state = algo.params.clone(), deepcopy(opt.state_dict()), through_json(algo.state_dict())
        steps(model, algo, 6)
    model2, opt2, copy = make(0.0)
    with copy:
        with torch.no_grad():
            copy.params.copy_(saved)
        opt2.load_state_dict(opt_state)
        copy.load_state_dict(state)
        steps(model2, copy, 6)
    assert all_ok(comm, torch.equal(algo.params, copy.params) and ("delayed_sum" in state) == (algo.groups > 1))


def test_state_in_flight_or_of_another_model_is_refused_on_every_rank() -> None:
    """GR-SGD with a lead has an exchange in flight after a step: state_dict() wants settle()
    first. An LSGD state of another model's size does not load."""
    comm = comm_of_size(4)
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    x = np.zeros(DIM)
    with algorithms.create("grsgd", x, SGD(x, lr=0.1), comm, max_lead=2) as algo:
        algo.step(np.ones(DIM))
        with pytest.raises(RuntimeError, match="exchange in flight: call settle"):
            algo.state_dict()
        algo.settle()
        assert algo.state_dict()["exchanges"] == [1] * len(algo.peers)
    with algorithms.create("lsgd", x, SGD(x, lr=0.1), comm, layout=1, collective="ring") as algo:
        algo.step(np.ones(DIM))
        state = {**algo.state_dict(), "delayed_sum": np.zeros(DIM + 1)}
        with pytest.raises(ValueError, match="delayed_sum has 13 elements of float64, the model 12 of float64"):
            algo.load_state_dict(state)


#: Compressed and CHOCO-SGD configurations (with the optimizer's momentum), and a key of their memories.
MEMORIES = [
    ("allreduce", {"collective": "ring", "compression": "topk:0.25"}, 0.0, "residual"),
    ("allreduce", {"collective": "ring", "compression": "sign@reduce_scatter", "error_feedback": True}, 0.0, "server"),
    ("allreduce", {"collective": "ring", "compression": "sign"}, 0.9, "velocity"),
    ("allreduce", {"collective": "ring", "compression": "sign"}, 0.9, "velocity_started"),
    ("lsgd", {"layout": 2, "collective": "ring", "compression": "sign", "error_feedback": True}, 0.0, "residual"),
    ("dpsgd", {"topology": "ring", "compression": "topk:0.25"}, 0.0, "public"),
    ("dpsgd", {"topology": "ring", "compression": "topk:0.25"}, 0.0, "mixed"),
    ("adpsgd", {"compression": "topk:0.25"}, 0.0, "copies"),
    ("prague", {"compression": "topk:0.25"}, 0.0, "copies"),
    ("prague", {"compression": "topk:0.25"}, 0.0, "copy_origin"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, options, momentum, key", MEMORIES, ids=[f"{m[0]}-{m[3]}" for m in MEMORIES])
def test_a_state_without_a_memory_is_refused_and_the_memory_kept(
    name: str, options: dict[str, Any], momentum: float, key: str
) -> None:
    """A state that lacks a memory raises ValueError naming it on every worker that keeps one
    (LSGD's representatives), and leaves the memory as it was, not zeroed; a worker that
    keeps none raises a ValueError naming the workers whose state does not fit."""
    comm = comm_of_size(4)
    rank = comm.Get_rank()
    x = np.full(DIM, float(rank))
    with algorithms.create(name, x, SGD(x, lr=0.1, momentum=momentum), comm, **options) as algo:
        for t in range(3):
            algo.step(gradient(x, rank, t))
        algo.settle()
        state = through_json(algo.state_dict())
        expected = f"the state lacks '{key}'"
        kept_anywhere = comm.allreduce(key in state, op=MPI.LOR)  # not by LSGD's single group
        try:
            algo.load_state_dict({k: v for k, v in state.items() if k != key})
            wrong = "loaded" if kept_anywhere else None
        except Exception as exc:  # caught, so that every rank reaches the collective state_dict() below
            refused = isinstance(exc, algorithms.StateError) and expected in str(exc)
            wrong = None if refused and kept_anywhere else repr(exc)
        kept = same(algo.state_dict(), state)
    assert all_ok(comm, wrong is None and kept), (wrong, kept)


def test_lsgd_memory_starts_afresh_on_a_worker_that_was_no_representative() -> None:
    """Under another layout a representative may resume a worker that kept no memory."""
    comm = comm_of_size(4)
    if comm.Get_size() < 2:
        pytest.skip("needs two groups")
    rank = comm.Get_rank()
    x = np.full(DIM, float(rank))
    options = {"layout": 1, "collective": "ring", "compression": "sign", "error_feedback": True}
    with algorithms.create("lsgd", x, SGD(x, lr=0.1), comm, **options) as algo:
        for t in range(3):
            algo.step(gradient(x, rank, t))
        algo.settle()
        state = through_json(algo.state_dict())
        had_memory = np.any(state["residual"] != 0)
        saved_by_a_non_representative = {k: v for k, v in state.items() if k not in ("residual", "server")}
        algo.load_state_dict({**saved_by_a_non_representative, "representative": False})
        after = algo.state_dict()
    assert all_ok(comm, bool(had_memory) and not np.any(after["residual"]) and not np.any(after.get("server", 0)))
