"""mpidl in a user's own PyTorch loop: gradient accumulation, synchronize() before
clipping and unscaling, a GradScaler, frozen parameters, BatchNorm buffers averaged,
the optimizer's state broadcast, learning-rate schedules, and ShardSampler's shards.

Every synchronous algorithm (AllReduce-SGD plain, overlapped and in shared memory;
D-PSGD plain and overlapped; LSGD with one group and with a group per rank) on 1 to
4 ranks; numbers that must agree across ranks are compared bit for bit."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
from collectives import ArgumentError
from collectives.transport.p2p import bytes_by_peer
from mpidl.data import DatasetError, ShardSampler, epoch_batches, shard, steps_per_epoch

pytestmark = pytest.mark.mpi
torch = pytest.importorskip("torch")
nn = torch.nn

#: The synchronous configurations: (algorithm, options).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "allreduce": ("allreduce", {"collective": "ring", "overlap": False}),
    "allreduce-overlap": ("allreduce", {"collective": "ring", "overlap": True, "bucket_mb": 1 / 1024}),
    "allreduce-shm": ("allreduce", {"collective": "shm", "overlap": True, "bucket_mb": 1 / 1024}),
    "dpsgd": ("dpsgd", {"overlap": False}),
    "dpsgd-overlap": ("dpsgd", {"overlap": True}),
    "lsgd": ("lsgd", {"collective": "ring"}),
    "lsgd-groups": ("lsgd", {"collective": "ring", "layout": 1}),  # a group per rank: the delayed pipeline
}
#: The configurations whose workers apply the same averaged gradient.
AVERAGING = [name for name in CONFIGS if not name.startswith("dpsgd")]
#: AllReduce-SGD with the update fused with the all-reduce in shared memory (two or more ranks).
FUSED = {"allreduce-fused": ("allreduce", {"collective": "shm", "overlap": False})}


def cnn(batchnorm: bool = False) -> nn.Module:
    """conv 3x3 (1 -> 3 channels) [BatchNorm] ReLU, linear 48 -> 3, on 1x6x6 images; float64, seed 0."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm2d(3)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(1, 3, 3), *norm, nn.ReLU(), nn.Flatten(), nn.Linear(48, 3)).double()


def batches(comm: MPI.Comm, steps: int, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own batches (seeded by its rank)."""
    g = torch.Generator().manual_seed(100 + comm.Get_rank())
    return [
        (torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def same_everywhere(comm: MPI.Comm, t: torch.Tensor) -> bool:
    return len({v.tobytes() for v in comm.allgather(t.detach().numpy().copy())}) == 1


def build(config: str, model: nn.Module, opt: Any, comm: MPI.Comm, **extra: Any) -> algorithms.Algorithm:
    name, options = {**CONFIGS, **FUSED}[config]
    return algorithms.create(name, model, opt, comm, **options, **extra)


def run(
    config: str,
    comm: MPI.Comm,
    finish: Callable[[algorithms.Algorithm, Any], None],
    steps: int = 4,
    accumulate: int = 1,
    batchnorm: bool = False,
    scaler: Any = None,
    **extra: Any,
) -> tuple[torch.Tensor, int, int]:
    """Train ``steps`` steps, each on ``accumulate`` batches (every backward pass in
    no_sync(enabled=not last), the loss divided by ``accumulate`` and scaled by ``scaler``
    if given), ending every step with ``finish``; (the final state, the iterations, the bytes sent)."""
    model = cnn(batchnorm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(comm, steps * accumulate)
    with build(config, model, opt, comm, **extra) as algo:
        for t in range(steps):
            algo.zero_grad()
            for k in range(accumulate):
                x, y = data[t * accumulate + k]
                with algo.no_sync(enabled=k < accumulate - 1):
                    loss = loss_of(model, x, y) / accumulate
                    (loss if scaler is None else scaler.scale(loss)).backward()
            finish(algo, opt)
        return algo.state.detach().clone(), algo.iterations, algo.bytes_sent


def by_step(algo: algorithms.Algorithm, opt: Any) -> None:
    algo.step()


def by_synchronize_and_step(algo: algorithms.Algorithm, opt: Any) -> None:
    algo.synchronize()
    algo.step()


def by_synchronize_and_optimizer(algo: algorithms.Algorithm, opt: Any) -> None:
    algo.synchronize()
    opt.step()


def by_optimizer(algo: algorithms.Algorithm, opt: Any) -> None:
    opt.step()  # DDP's habit: neither algo.step() nor synchronize()


# --- synchronize() -------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_synchronize_then_step_gives_the_bits_of_step(config: str, size: int) -> None:
    """Three ways to end a step: step(); synchronize() and step(); synchronize() and the
    optimizer's own step(). The same bits, iterations and bytes (LSGD's first step
    hands the optimizer a zero gradient, which moves nothing under plain momentum SGD)."""
    comm = comm_of_size(size)
    runs = [run(config, comm, finish) for finish in (by_step, by_synchronize_and_step, by_synchronize_and_optimizer)]
    states, iterations, sent = zip(*runs)
    ok = all(torch.equal(states[0], s) for s in states[1:]) and len(set(iterations)) == 1 and len(set(sent)) == 1
    ok &= iterations[0] == 4 and (comm.Get_size() == 1 or sent[0] > 0)
    if config in AVERAGING:
        ok &= same_everywhere(comm, states[0])
    assert all_ok(MPI.COMM_WORLD, ok), (iterations, sent)


# --- the optimizer's own step ------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("config", [*CONFIGS, *FUSED])
def test_a_plain_optimizer_step_is_the_algorithms_step(config: str, size: int) -> None:
    """DDP's habit, backward then the optimizer's own step() and nothing else, with and
    without accumulation in no_sync(): the step synchronizes first, once, so it gives the
    bits, iterations and bytes of algo.step(), and the gradient-averaging configurations
    keep every worker's model identical."""
    comm = comm_of_size(size)
    ok = True
    for accumulate in (1, 3):
        (state, iterations, sent), (plain, plain_iterations, plain_sent) = (
            run(config, comm, finish, accumulate=accumulate) for finish in (by_step, by_optimizer)
        )
        ok &= torch.equal(state, plain) and iterations == plain_iterations == 4 and sent == plain_sent
        ok &= comm.Get_size() == 1 or sent > 0
        if not config.startswith("dpsgd"):
            ok &= same_everywhere(comm, plain)
    assert all_ok(MPI.COMM_WORLD, ok), config


@pytest.mark.parametrize("config", ["allreduce", "allreduce-overlap", "allreduce-shm", "dpsgd-overlap", "lsgd-groups"])
def test_grad_scaler_after_synchronize_gives_the_bits_of_step(config: str) -> None:
    """Horovod's GradScaler step: synchronize(), unscale_, scaler.step(opt), update. The
    optimizer's step does not synchronize again: the bits, iterations and bytes of
    algo.step() without a scaler (a power-of-two scale is undone exactly)."""
    comm = MPI.COMM_WORLD
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)

    def by_scaler(algo: algorithms.Algorithm, opt: Any) -> None:
        algo.synchronize()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    (state, iterations, sent), (scaled, scaled_iterations, scaled_sent) = (
        run(config, comm, by_step),
        run(config, comm, by_scaler, scaler=scaler),
    )
    ok = torch.equal(state, scaled) and iterations == scaled_iterations == 4 and sent == scaled_sent
    ok &= scaler.get_scale() == 2.0**12
    assert all_ok(comm, ok)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("config", ["allreduce", "allreduce-overlap", "allreduce-shm", "lsgd", *FUSED])
def test_every_way_to_step_applies_the_mean_once(config: str, size: int) -> None:
    """One weight at 0, worker r's gradient r + 1, plain SGD at lr 1: one step leaves
    -(n + 1) / 2 exactly on every worker (a local step would leave -(r + 1)), with one
    all-reduce's bytes and one iteration (a second synchronization would count twice), by
    algo.step(), the optimizer's own step(), synchronize() then it, or synchronize() then
    a GradScaler's step."""
    comm = comm_of_size(size)
    rank, n = comm.Get_rank(), comm.Get_size()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def one_step(finish: Callable[[algorithms.Algorithm, Any], None], scaled: bool) -> tuple[float, int, int]:
        model = nn.Linear(1, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with build(config, model, opt, comm) as algo:
            loss = (rank + 1) * model.weight.sum()
            (scaler.scale(loss) if scaled else loss).backward()
            finish(algo, opt)
        return float(model.weight.detach()), algo.iterations, algo.bytes_sent

    def by_scaler(algo: algorithms.Algorithm, opt: Any) -> None:
        algo.synchronize()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    results = [
        one_step(by_step, False),
        one_step(by_optimizer, False),
        one_step(by_synchronize_and_optimizer, False),
        one_step(by_scaler, True),
    ]
    ok = all(r == (-(n + 1) / 2, 1, results[0][2]) for r in results) and (n == 1 or comm.allreduce(results[0][2]) > 0)
    assert all_ok(MPI.COMM_WORLD, ok), results


def test_a_plain_optimizer_step_where_it_cannot_synchronize() -> None:
    """The asynchronous algorithms and compressed D-PSGD communicate during or after the
    update: the optimizer's own step() raises on every rank before it changes anything,
    naming algo.step(), which then works; after close() the optimizer is the caller's
    again. A GradScaler stepping without synchronize() first (it decided on this worker's
    gradients alone whether to step) raises, saying to call it; after it, the step runs."""
    comm = MPI.COMM_WORLD
    ok = True
    for name, options in [("adpsgd", {}), ("grsgd", {}), ("prague", {}), ("dpsgd", {"compression": "fp16"})]:
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batches(comm, 1)[0]
        with algorithms.create(name, model, opt, comm, **options) as algo:
            before = algo.params.detach().clone()
            loss_of(model, x, y).backward()
            with pytest.raises(RuntimeError, match=r"finish each step with algo\.step\(\)"):
                opt.step()
            ok &= torch.equal(before, algo.params) and algo.iterations == 0 and algo.bytes_sent == 0
            comm.Barrier()  # (AD-PSGD's passive workers average as soon as an active one steps)
            algo.step()
            ok &= algo.iterations == 1 and not torch.equal(before, algo.params)
        opt.step()  # closed: the optimizer is the caller's again
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with build("allreduce", model, opt, comm) as algo:
        before = algo.params.detach().clone()
        x, y = batches(comm, 1)[0]
        scaler.scale(loss_of(model, x, y)).backward()
        with pytest.raises(RuntimeError, match=r"call algo\.synchronize"):
            scaler.step(opt)
        ok &= torch.equal(before, algo.params) and algo.iterations == 0
        algo.synchronize()
        scaler.step(opt)
        scaler.update()
        ok &= algo.iterations == 1 and not torch.equal(before, algo.params) and same_everywhere(comm, algo.params)
    assert all_ok(comm, ok)


def test_a_skipped_update_does_not_excuse_the_next_step() -> None:
    """synchronize(), then no update (a GradScaler skips the optimizer's step after an
    overflow), then a new backward pass and the optimizer's own step(): the new gradients
    are synchronized, and the workers stay identical."""
    comm = MPI.COMM_WORLD
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with build("allreduce", model, opt, comm) as algo:
        first, second = batches(comm, 2)
        loss_of(model, *first).backward()
        algo.synchronize()
        opt.zero_grad()
        loss_of(model, *second).backward()
        opt.step()
        ok = algo.iterations == 2 and same_everywhere(comm, algo.params)
    assert all_ok(comm, ok)


@pytest.mark.parametrize("config", AVERAGING)
def test_clipping_after_synchronize_sees_the_averaged_gradient(config: str) -> None:
    """After synchronize() the gradients are what the update applies: the average of the
    workers' (LSGD with groups: the previous step's; zero on its first step); the norm
    that clip_grad_norm_ computes is the same bits on every rank and the clipped models
    stay identical."""
    comm = MPI.COMM_WORLD
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ok, norms, averages = True, [], []
    with build(config, model, opt, comm) as algo:
        delayed = config == "lsgd-groups" and comm.Get_size() > 1
        for x, y in batches(comm, 3):
            algo.zero_grad()
            with algo.no_sync():  # nothing launched: the local gradient can be read before synchronize()
                loss_of(model, 10 * x, y).backward()
            local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
            averages.append(np.mean(comm.allgather(local), axis=0))
            algo.synchronize()
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)))
            algo.step()
            ok &= same_everywhere(comm, algo.params)
    expected = [float(np.linalg.norm(a)) for a in averages]
    if delayed:
        expected = [0.0, *expected[:-1]]
    ok &= np.allclose(norms, expected, rtol=1e-12) and len({tuple(n) for n in comm.allgather(norms)}) == 1
    ok &= max(norms) > 0.1  # the clipping clipped
    assert all_ok(comm, ok), (norms, expected)


# --- gradient accumulation -----------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_accumulation_equals_one_pass_on_the_whole_batch(config: str) -> None:
    """Three backward passes of a third of the loss, the first two in no_sync(), give the
    model that one pass over the three batches at once gives (to rounding), with the
    bytes of a step without accumulation: nothing is sent during no_sync() (but D-PSGD's
    one mix of the step, which overlap starts at the step's first forward pass)."""
    comm = MPI.COMM_WORLD
    accumulated, _, sent = run(config, comm, by_step, steps=2, accumulate=3)

    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(comm, 6)
    with build(config, model, opt, comm) as algo:
        for t in range(2):
            algo.zero_grad()
            x = torch.cat([b[0] for b in data[3 * t : 3 * t + 3]])
            y = torch.cat([b[1] for b in data[3 * t : 3 * t + 3]])
            loss_of(model, x, y).backward()
            algo.step()
        whole, whole_sent = algo.state.detach().clone(), algo.bytes_sent
    ok = torch.allclose(accumulated, whole, rtol=1e-12, atol=1e-14) and sent == whole_sent

    model = cnn()
    with build(config, model, torch.optim.SGD(model.parameters(), lr=0.1), comm) as algo:
        before = sum(bytes_by_peer().values())
        for x, y in batches(comm, 3):
            with algo.no_sync():
                loss_of(model, x, y).backward()
        if config != "dpsgd-overlap":
            ok &= sum(bytes_by_peer().values()) == before and algo.bytes_sent == 0
        algo.step()
    assert all_ok(comm, ok)


# --- GradScaler ----------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_grad_scaler_skips_an_overflowing_step_on_every_worker(config: str) -> None:
    """torch.amp.GradScaler with synchronize(), unscale_, clipping, scaler.step(opt). Rank 1's
    loss overflows at step 2: where gradients are averaged every worker sees the inf,
    skips that update (LSGD with groups one step later, where its delayed gradient
    arrives) and halves its scale, and the models stay identical; D-PSGD's gradients
    are each worker's own, so rank 1 alone skips. The other steps apply."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    delayed = config == "lsgd-groups" and comm.Get_size() > 1
    averaged = config in AVERAGING
    overflow = 2
    skipped_at = overflow + 1 if delayed else overflow
    skipping = comm.Get_size() > 1 and (averaged or rank == 1)
    ok = True
    with build(config, model, opt, comm) as algo:
        for t, (x, y) in enumerate(batches(comm, 5)):
            before = algo.params.detach().clone()
            algo.zero_grad()
            loss = loss_of(model, x, y)
            if t == overflow and rank == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            algo.synchronize()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            if averaged:  # (a D-PSGD worker that skips its update still mixes its model)
                moved = not torch.equal(before, algo.params)
                ok &= moved == (not (delayed and t == 0) and not (skipping and t == skipped_at))
            ok &= scaler.get_scale() == 2.0**10 / (2 if skipping and t >= skipped_at else 1)
            ok &= bool(torch.isfinite(algo.params).all())
            if averaged:
                ok &= same_everywhere(comm, algo.params)
    assert all_ok(comm, ok)


# --- frozen parameters ---------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_frozen_parameters_stay_put(config: str) -> None:
    """A frozen convolution (requires_grad=False before the algorithm is built) under SGD
    with momentum and weight decay, clipping and a GradScaler: it gets no gradient and
    keeps its values (D-PSGD averages it with the neighbors' equal copies: to rounding);
    the rest trains."""
    comm = MPI.COMM_WORLD
    model = cnn()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu")
    trained = model[-1].weight.detach().clone()
    with build(config, model, opt, comm) as algo:
        for x, y in batches(comm, 3):
            algo.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            algo.synchronize()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
        weight = model[0].weight
        ok = weight.grad is None and opt.state[weight] == {} and not torch.equal(model[-1].weight, trained)
        ok &= (
            torch.allclose(weight, frozen, rtol=0, atol=1e-15)
            if config.startswith("dpsgd")
            else torch.equal(weight, frozen)
        )
    assert all_ok(comm, bool(ok))


# --- BatchNorm buffers ---------------------------------------------------------------


@pytest.mark.parametrize("config", ["allreduce", "allreduce-shm", "dpsgd", "lsgd-groups"])
def test_batchnorm_buffers_averaged_when_asked(config: str) -> None:
    """average_buffers=True averages the running statistics every step: the same bits on
    every rank, and the bits that average_buffers() after every step gives; without it
    the gradient-averaging algorithms leave each worker its own. The batch counter
    (int64) stays local and counts the worker's own passes."""
    comm = MPI.COMM_WORLD

    def statistics(**extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
        on_demand = extra.pop("on_demand", False)
        model = cnn(batchnorm=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with build(config, model, opt, comm, **extra) as algo:
            for x, y in batches(comm, 3):
                algo.zero_grad()
                loss_of(model, x, y).backward()
                algo.synchronize()
                algo.step()
                if on_demand:
                    algo.average_buffers()
        bn = model[1]
        counted.append(int(bn.num_batches_tracked))
        return torch.cat([bn.running_mean, bn.running_var]), algo.params.detach().clone()

    counted: list[int] = []

    averaged, params = statistics(average_buffers=True)
    on_demand, params_on_demand = statistics(on_demand=True)
    local, _ = statistics()
    ok = same_everywhere(comm, averaged) and torch.equal(averaged, on_demand) and torch.equal(params, params_on_demand)
    ok &= counted == [3, 3, 3]
    if comm.Get_size() > 1 and config != "dpsgd":
        ok &= not same_everywhere(comm, local)
    assert all_ok(comm, ok)


def test_buffer_averaging_every_step_needs_a_synchronous_algorithm() -> None:
    comm = MPI.COMM_WORLD
    model = cnn(batchnorm=True)
    with pytest.raises(ArgumentError, match="average_buffers=True"):
        algorithms.create("adpsgd", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, average_buffers=True)


def test_synchronize_where_it_has_no_meaning() -> None:
    """An asynchronous algorithm and compressed D-PSGD say why they have no synchronize();
    step(grad) after synchronize() is refused, and the step still ends."""
    comm = MPI.COMM_WORLD
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with algorithms.create("grsgd", model, opt, comm, max_lead=0) as algo, pytest.raises(NotImplementedError) as e:
        algo.synchronize()
    assert "clip or unscale them before step" in str(e.value)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with algorithms.create("dpsgd", model, opt, comm, compression="fp16") as algo, pytest.raises(NotImplementedError):
        algo.synchronize()
    model = cnn()
    with build("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), comm) as algo:
        algo.synchronize()
        with pytest.raises(ValueError, match="after synchronize"):
            algo.step(np.zeros(algo.flat.size))
        algo.step()
        assert all_ok(comm, algo.iterations == 1)


# --- the optimizer's state -----------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state(size: int, kind: str) -> None:
    """Rank r takes r local steps with its own learning rate (rank 0 none: its optimizer has
    no state yet, which the others then drop) or, from root 1, rank 1's state reaches
    every rank. Afterwards every rank holds the root's state bit for bit, and the same
    gradient makes the same step everywhere."""
    comm = comm_of_size(size)
    rank, size = comm.Get_rank(), comm.Get_size()
    ok = True
    for root in {0, size - 1}:
        model = cnn()
        params = list(model.parameters())
        opt = (
            torch.optim.SGD(params, lr=0.1 + rank, momentum=0.9)
            if kind == "sgd"
            else torch.optim.Adam(params, lr=0.01 * (1 + rank))
        )
        for x, y in batches(comm, rank):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
        torch.manual_seed(0)
        with torch.no_grad():  # the same model everywhere (the algorithms' construction does that)
            for p in params:
                p.copy_(torch.randn_like(p))
        algorithms.broadcast_optimizer_state(opt, comm, root=root)
        state = opt.state_dict()
        ok &= len(state["state"]) == (len(params) if root else 0) and len(comm.allgather(state["param_groups"])) == size
        ok &= len({repr(g) for g in comm.allgather(state["param_groups"])}) == 1
        for entry in state["state"].values():
            for value in entry.values():
                ok &= same_everywhere(comm, torch.as_tensor(value))
        opt.zero_grad()
        x, y = batches(comm_of_size(1), 1)[0]  # the same batch everywhere
        loss_of(model, x, y).backward()
        opt.step()
        ok &= all(same_everywhere(comm, p) for p in params)
    assert all_ok(MPI.COMM_WORLD, ok)


def test_broadcast_optimizer_state_refuses_on_every_rank() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ArgumentError, match="different roots" if size > 1 else "not a rank"):
        algorithms.broadcast_optimizer_state(opt, comm, root=rank if size > 1 else 1)
    with pytest.raises(ArgumentError, match=rf"state_dict\(\) and load_state_dict\(\) .* rank {size - 1}: object"):
        algorithms.broadcast_optimizer_state(object() if rank == size - 1 else opt, comm)
    if size > 1:  # mpidl's numpy SGD has a state dict, of another kind
        numpy_opt = algorithms.SGD(np.zeros(4), lr=0.1)
        with pytest.raises(ArgumentError, match=rf"rank {size - 1} could not load rank 0's optimizer state"):
            algorithms.broadcast_optimizer_state(numpy_opt if rank == size - 1 else opt, comm)
    if size > 1:
        params = list(model.parameters())
        mismatched = torch.optim.SGD(params[:2] if rank == 1 else params, lr=0.1, momentum=0.9)
        with pytest.raises(ArgumentError, match="rank 1 could not load"):
            algorithms.broadcast_optimizer_state(mismatched, comm)


# --- learning-rate schedules ---------------------------------------------------------


@pytest.mark.parametrize("config", ["allreduce-overlap", "dpsgd", "lsgd-groups"])
def test_lr_scheduler_drives_the_wrapped_optimizer(config: str) -> None:
    """A StepLR on the optimizer the algorithm wraps halves the rate each step: the same
    bits as setting the rates by hand, and no warning that the scheduler stepped
    before the optimizer (but where LSGD's first step, which fills its pipeline, makes
    no update)."""
    comm = MPI.COMM_WORLD
    finals, rates = [], []
    for scheduled in (True, False):
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduled else None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if config == "lsgd-groups" and comm.Get_size() > 1:
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before", UserWarning)
            with build(config, model, opt, comm) as algo:
                for t, (x, y) in enumerate(batches(comm, 4)):
                    if schedule is None:
                        opt.param_groups[0]["lr"] = 0.4 * 0.5**t
                    algo.zero_grad()
                    loss_of(model, x, y).backward()
                    algo.step()
                    if schedule is not None:
                        schedule.step()
        rates.append(opt.param_groups[0]["lr"])
        finals.append(algo.state.detach().clone())
    assert all_ok(comm, torch.equal(*finals) and rates[0] == 0.4 * 0.5**4)


# --- ShardSampler --------------------------------------------------------------------


class RankView:
    """Rank ``rank`` of a communicator of ``size`` ranks that all call alike (no MPI)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value: Any) -> list[Any]:
        return [value] * self.size


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shard_sampler_on_1_to_8_workers(shuffle: bool, drop_last: bool) -> None:
    """Every worker of n = 1..8 yields the same number of indices, ceil(N/n) (floor with
    drop_last); together they cover every sample (drop_last: use each at most once,
    leaving out fewer than n), padding only with samples of the worker's own shard; the
    order depends on the seed and the epoch (set, or the next at each pass); shuffled,
    an epoch's order is mpidl train's."""
    ok = True
    for size in range(1, 9):
        for n in sorted({size, size + 1, 2 * size - 1, 13, 37} - {0}):
            if n < size:
                continue
            samplers = [
                ShardSampler(n, RankView(r, size), seed=5, shuffle=shuffle, drop_last=drop_last) for r in range(size)
            ]
            for epoch in (0, 3):
                for s in samplers:
                    s.set_epoch(epoch)
                orders = [list(s) for s in samplers]
                length = n // size if drop_last else -(-n // size)
                ok &= all(len(o) == len(s) == length for o, s in zip(orders, samplers))
                everything = np.concatenate(orders)
                if drop_last:
                    ok &= len(set(everything.tolist())) == len(everything) > n - size
                else:
                    ok &= set(everything.tolist()) == set(range(n))
                ok &= all(set(o) <= set(s.indices.tolist()) for o, s in zip(orders, samplers))
                for r, (o, s) in enumerate(zip(orders, samplers)):
                    m = min(length, len(s.indices))  # the padding repeats the start of the order
                    ok &= o[m:] == o[: length - m]
                    if shuffle:
                        steps = steps_per_epoch(n, size, 2) if n >= 2 * size else 1
                        train = np.concatenate(epoch_batches(shard(n, r, size, 5), steps, 5, epoch, r))
                        ok &= o[:m] == train[:m].tolist()
                    else:
                        ok &= o[:m] == s.indices[:m].tolist() == sorted(s.indices[:m].tolist())
            if shuffle and n > 2 * size:
                s = samplers[0]
                s.set_epoch(0)
                first = list(s)
                s.set_epoch(1)
                second = list(s)
                other_seed = ShardSampler(n, RankView(0, size), seed=6)
                passes = ShardSampler(n, RankView(0, size), seed=5, drop_last=drop_last)  # a pass: the next epoch
                ok &= second != first and set(second) <= set(s.indices.tolist()) and list(other_seed) != first
                ok &= list(passes) == first and list(passes) == second and passes.epoch == 2
    assert ok


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_sampler_feeds_a_data_loader(size: int) -> None:
    """Over MPI, through torch's DataLoader: every rank gets the same number of batches
    of its own samples, and together they cover the dataset; workers that disagree
    on the seed, or too few samples, raise on every rank."""
    comm = comm_of_size(size)
    size = comm.Get_size()
    dataset = torch.utils.data.TensorDataset(torch.arange(23))
    sampler = ShardSampler(dataset, comm, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    sampler.set_epoch(2)
    seen = torch.cat([b[0] for b in loader]).tolist()
    counts = comm.allgather(len(loader))
    ok = len(set(counts)) == 1 and set().union(*comm.allgather(set(seen))) == set(range(23))
    if size > 1:
        with pytest.raises(DatasetError, match="different"):
            ShardSampler(dataset, comm, seed=comm.Get_rank())
    with pytest.raises(DatasetError, match="cannot be shared"):
        ShardSampler(size - 1 if size > 1 else 0, comm)
    assert all_ok(MPI.COMM_WORLD, ok)
