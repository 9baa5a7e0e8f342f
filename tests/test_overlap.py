"""Communication overlapped with computation: AllReduce-SGD's gradient buckets all-reduced
during backward, D-PSGD's averaging during forward and backward. Overlapped and
non-overlapped runs end with bitwise identical models, on 1..4 ranks; unused and
frozen parameters, set-to-none zeroing and gradient accumulation keep that, and
nothing hangs."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, mpiexec, on_rank0_quietly

import algorithms
import collectives
from algorithms import SGD
from algorithms.background import spare_cores
from algorithms.buckets import Bucket, Tracker, plan
from collectives import ArgumentError, reduction
from collectives.kernels.resident import SharedVectors
from collectives.transport import exchange
from collectives.transport.chunks import chunk_bounds
from collectives.transport.context import context
from collectives.transport.p2p import bytes_sent

pytestmark = pytest.mark.mpi
torch = pytest.importorskip("torch")

#: Buckets closed at 256 bytes (64 float32): the test MLP gets three.
SMALL_BUCKETS = 1 / 4096


def mlp(batchnorm: bool = False) -> torch.nn.Module:
    """5 -> 24 -> 16 -> 3 (optionally with BatchNorm after the first layer); seed 0."""
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(24)] if batchnorm else []
    return torch.nn.Sequential(
        torch.nn.Linear(5, 24), *norm, torch.nn.ReLU(), torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def batches(comm: MPI.Comm, steps: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own batches (seeded by its rank)."""
    g = torch.Generator().manual_seed(1000 + comm.Get_rank())
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def same_everywhere(comm: MPI.Comm, t: torch.Tensor) -> bool:
    return len({v.tobytes() for v in comm.allgather(t.detach().numpy())}) == 1


# --- service threads ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_service_thread_waits_without_spinning() -> None:
    """A blocking MPI wait busy-waits on a core the computation needs: a service thread's
    transfers (here an all-reduce and a receive, their peer 0.4 s late) poll instead and
    cost it a small part of the wait in CPU time, with the right sums."""
    import time

    from collectives.transport import p2p
    from collectives.transport.background import Background

    comm = comm_of_size(2)
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    late = comm.rank == 1
    data = np.arange(5, dtype=np.int64) + 10 * comm.rank
    context(comm)  # set up on first use, with blocking collectives, as the algorithms do at construction

    def task() -> tuple[float, float, np.ndarray, np.ndarray]:
        got = np.zeros(3, dtype=np.int64)
        t0, c0 = time.perf_counter(), time.thread_time()
        if late:
            time.sleep(0.4)
        collectives.allreduce(data, comm, "sum", "ring", validate=False)
        if late:
            time.sleep(0.4)
            p2p.send(comm, np.array([7, 8, 9], dtype=np.int64), 0)
        else:
            p2p.recv(comm, got, 1)
        return time.perf_counter() - t0, time.thread_time() - c0, data.copy(), got

    service = Background("test-service")
    service.submit(task)
    (wall, cpu, summed, got), _ = service.result()
    service.close()
    ok = np.array_equal(summed, 2 * np.arange(5) + 10) and (late or got.tolist() == [7, 8, 9])
    ok = ok and (late or (wall >= 0.7 and cpu < 0.2 * wall))
    assert all_ok(comm, ok), (wall, cpu, summed, got)


# --- the bucket plan and the launch order -----------------------------------------------


def test_plan_packs_reverse_order_slices_and_skips_frozen() -> None:
    sizes, trainable = [6, 2, 10, 3, 3, 1], [True, True, True, False, True, True]
    buckets = plan(sizes, trainable, cap=5)
    assert buckets == (
        Bucket(0, 21, 25, (5, 4)),  # the last two parameters, 4 elements; the frozen one ends the bucket
        Bucket(1, 8, 18, (2,)),  # at least the cap: closed
        Bucket(2, 0, 8, (1, 0)),  # 2 elements, then 6 more: closed at 8, over the cap by less than the last
    )
    # Linear layers (weight, bias): each bias travels with its weight, the bias reported first.
    assert plan([4, 1, 4, 1], [True] * 4, cap=4) == (Bucket(0, 5, 10, (3, 2)), Bucket(1, 0, 5, (1, 0)))
    # Every trainable parameter in exactly one bucket, each bucket one contiguous slice.
    covered = sorted(i for b in buckets for i in b.params)
    assert covered == [0, 1, 2, 4, 5]
    assert all(b.size == sum(sizes[i] for i in b.params) for b in buckets)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert plan([7], [True], cap=1) == (Bucket(0, 0, 7, (0,)),)  # a numpy model: one bucket
    assert plan([4, 4], [False, False], cap=8) == ()
    with pytest.raises(ValueError, match="at least one element"):
        plan([4], [True], cap=0)


def test_tracker_launches_in_plan_order_once() -> None:
    buckets = plan([2, 2, 2, 2], [True] * 4, cap=4)  # (3, 2), (1, 0)
    launched: list[int] = []
    tracker = Tracker(buckets, 4, lambda b: launched.append(b.index))
    tracker.report(0)
    tracker.report(1)  # bucket 1 is ready, but bucket 0 is not launched yet
    assert launched == []
    tracker.report(3)
    tracker.report(2)
    assert launched == [0, 1] and tracker.launched == 2
    with pytest.raises(RuntimeError, match="no_sync"):
        tracker.report(2)
    tracker.reset()
    tracker.report(3)  # param 2 never reports (unused): flush launches the rest in order
    tracker.flush()
    assert launched == [0, 1, 0, 1]


# --- all-reduce in place in shared memory ----------------------------------------------


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_shared_vectors_give_the_bits_of_shm(size: int, dtype: str, op: str) -> None:
    """Slices of length 0, 1, < q, odd and the whole vector, reduced in place, with this
    rank's contribution in its vector or partly in private pieces: every rank's vector
    holds what collectives.allreduce(..., "shm") gives, bit for bit, and the elements
    outside the slice are untouched."""
    comm = comm_of_size(size)  # a block of one rank (3 of 4) checks the trivial case
    count = 1037
    rng = np.random.default_rng([7, comm.Get_rank()])
    shared = SharedVectors(context(comm).comm, count, dtype)
    ok = True
    for start, stop in [(5, 5), (5, 6), (10, 12), (100, 357), (0, count)]:
        values = rng.standard_normal(count).astype(dtype)
        expected = values.copy()
        collectives.allreduce(expected[start:stop], comm, op, "shm", validate=False)
        shared.mine[:] = values
        before = bytes_sent()
        shared.allreduce(start, stop, reduction(op, dtype))
        ok &= shared.mine.tobytes() == expected.tobytes()
        part = chunk_bounds(stop - start, comm.Get_size())
        mine = part[comm.Get_rank() + 1] - part[comm.Get_rank()]
        ok &= bytes_sent() - before == (comm.Get_size() - 1) * mine * np.dtype(dtype).itemsize  # results for peers
        # The same contribution, its first and last thirds in private arrays (pieces): the
        # vector's stale contents there are not read.
        a, b = start + (stop - start) // 3, stop - (stop - start) // 3
        pieces = [(start, values[start:a].copy()), (b, values[b:stop].copy())]
        shared.mine[:] = values
        shared.mine[start:a] = shared.mine[b:stop] = np.nan
        shared.allreduce(start, stop, reduction(op, dtype), pieces)
        ok &= shared.mine.tobytes() == expected.tobytes()
    shared.free()
    assert all_ok(MPI.COMM_WORLD, ok), (size, dtype, op)


@pytest.mark.parametrize("overlap", [True, False])
def test_gradients_in_shared_memory_are_averaged_as_shm_averages(overlap: bool) -> None:
    """On one node with shm buckets the flat gradient lives in the shared window (lr 0:
    after a step it holds the average) and leaves it at close(), values kept. (The
    backward pass runs in no_sync(), so that step() launches every bucket.)"""
    comm = MPI.COMM_WORLD
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    algo = algorithms.AllReduceSGD(model, opt, comm, collective="shm", overlap=overlap, bucket_mb=SMALL_BUCKETS)
    x, y = batches(comm, 1)[0]
    algo.zero_grad()
    with algo.no_sync():  # nothing in flight yet: the local gradient can be read
        loss(model, x, y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # where backward left them
    algo.step()
    expected = collectives.allreduce(local, comm, "avg", "shm", validate=False)
    ok = algo.resident == (comm.Get_size() > 1) and torch.equal(algo.grads, expected)
    ok &= all(p.grad.data_ptr() == v.data_ptr() for p, v in algo.flat.views)
    algo.close()
    ok &= torch.equal(algo.grads, expected) and torch.equal(model[-1].bias.grad, expected[-3:])
    ok &= all(p.grad.data_ptr() == v.data_ptr() for p, v in algo.flat.views)
    assert all_ok(comm, ok)


# --- AllReduce-SGD ---------------------------------------------------------------------


def run_allreduce(comm: MPI.Comm, overlap: bool, steps: int = 5, **options: object) -> tuple[torch.Tensor, object]:
    """Train the MLP for ``steps`` steps; return its parameters and the algorithm (closed)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    options = {"bucket_mb": SMALL_BUCKETS, **options}
    with algorithms.AllReduceSGD(model, opt, comm, overlap=overlap, **options) as algo:
        for x, y in batches(comm, steps):
            algo.zero_grad()
            loss(model, x, y).backward()
            algo.step()
    return algo.params.detach().clone(), algo


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("collective", ["auto", "ring", "butterfly"])
def test_allreduce_overlap_gives_the_same_bits(size: int, collective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service thread polls, in segments of POLLED_SEGMENT bytes (here 24: several per
    block), the plain step blocks (one segment): the same bits."""
    monkeypatch.setattr(exchange, "POLLED_SEGMENT", 24)
    comm = comm_of_size(size)
    on, algo = run_allreduce(comm, True, collective=collective)
    off, plain = run_allreduce(comm, False, collective=collective)
    ok = algo.overlap and not plain.overlap and len(algo.buckets) >= 3
    ok &= torch.equal(on, off) and same_everywhere(comm, on)
    ok &= algo.bytes_sent == plain.bytes_sent and algo.iterations == 5
    assert all_ok(MPI.COMM_WORLD, ok), (collective, size)


def test_torch_cpu_models_overlap_with_spare_cores_numpy_models_cannot() -> None:
    comm = MPI.COMM_WORLD
    model = mlp()
    spare = spare_cores(comm)
    with algorithms.AllReduceSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), comm) as algo:
        ok = algo.overlap == spare and all(isinstance(a, str) for a in algo.bucket_collectives)
    with algorithms.DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), comm) as mixing:
        ok &= mixing.overlap == spare
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = node.Get_size()
    node.Free()
    enough = len(os.sched_getaffinity(0)) >= ranks_here * (torch.get_num_threads() + 1)
    ok &= spare == all(comm.allgather(enough))
    x = np.zeros(10, np.float32)
    with algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, bucket_mb=1e-5) as plain:
        ok &= not plain.overlap and plain.buckets == (Bucket(0, 0, 10, (0,)),)  # one bucket: the whole gradient
        plain.step(np.full(10, comm.Get_rank(), np.float32))
        ok &= np.array_equal(x, np.full(10, -0.1 * (comm.Get_size() - 1) / 2, np.float32))
    for cls in (algorithms.AllReduceSGD, algorithms.DPSGD):
        with pytest.raises(ArgumentError, match="overlap needs a torch model") as info:
            cls(x, SGD(x, lr=0.1), comm, overlap=True)
        ok &= len(set(comm.allgather(str(info.value)))) == 1
    with pytest.raises(ArgumentError, match="bucket_mb must be a positive") as info:
        algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, bucket_mb=0)
    assert all_ok(comm, ok and len(set(comm.allgather(str(info.value)))) == 1)


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; each call uses the heads it is told to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(5, 16), torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)
        self.heads = "ab"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return sum(getattr(self, k)(h) for k in self.heads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_unused_parameters_do_not_hang(size: int) -> None:
    """Rank r leaves out head a on odd steps of even ranks and head b on odd ranks: those
    gradients never report, their buckets go at step(); the result is the same bits."""
    comm = comm_of_size(size)
    rank = comm.Get_rank()
    finals = []
    for overlap in (True, False):
        model = TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with algorithms.AllReduceSGD(model, opt, comm, overlap=overlap, bucket_mb=SMALL_BUCKETS) as algo:
            for t, (x, y) in enumerate(batches(comm, 4)):
                model.heads = "a" if rank % 2 else ("b" if t % 2 else "ab")
                opt.zero_grad()  # set_to_none: unused parameters keep None, the hooks re-point the rest
                loss(model, x, y).backward()
                algo.step()
        finals.append(algo.params.detach().clone())
    assert all_ok(MPI.COMM_WORLD, torch.equal(*finals) and same_everywhere(comm, finals[0]))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gradient_accumulation_with_no_sync(size: int) -> None:
    """Two backward passes per step, the first inside no_sync(): the same bits with and
    without overlap; a second backward pass outside it is an error on every rank, and
    close() still finishes what the first one started."""
    comm = comm_of_size(size)
    finals = []
    for overlap in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        with algorithms.AllReduceSGD(model, opt, comm, overlap=overlap, bucket_mb=SMALL_BUCKETS) as algo:
            data = batches(comm, 6)
            for (x1, y1), (x2, y2) in zip(data[::2], data[1::2]):
                algo.zero_grad()
                with algo.no_sync():
                    loss(model, x1, y1).backward()
                loss(model, x2, y2).backward()
                algo.step()
        finals.append(algo.params.detach().clone())
    ok = torch.equal(*finals) and same_everywhere(comm, finals[0])
    model = mlp()
    algo = algorithms.AllReduceSGD(
        model, torch.optim.SGD(model.parameters(), lr=0.1), comm, overlap=True, bucket_mb=SMALL_BUCKETS
    )
    x, y = batches(comm, 1)[0]
    loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="accumulated twice"):
        loss(model, x, y).backward()
    algo.close()
    assert all_ok(MPI.COMM_WORLD, ok)


def test_close_after_a_backward_pass_on_one_rank_only() -> None:
    """A backward pass without a step on rank 0 alone: close() has every rank finish those buckets."""
    comm = MPI.COMM_WORLD
    model = mlp()
    algo = algorithms.AllReduceSGD(
        model, torch.optim.SGD(model.parameters(), lr=0.1), comm, overlap=True, bucket_mb=SMALL_BUCKETS
    )
    if comm.Get_rank() == 0:
        x, y = batches(comm, 1)[0]
        loss(model, x, y).backward()
    algo.close()
    assert all_ok(comm, algo.closed)


def test_frozen_parameters_are_in_no_bucket_and_stay_put() -> None:
    comm = MPI.COMM_WORLD
    finals = []
    for overlap in (True, False):
        model = mlp()
        model[0].weight.requires_grad_(False)
        model[2].bias.requires_grad_(False)
        frozen = model[0].weight.detach().clone(), model[2].bias.detach().clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        with algorithms.AllReduceSGD(model, opt, comm, overlap=overlap, bucket_mb=SMALL_BUCKETS) as algo:
            bucketed = {i for b in algo.buckets for i in b.params}
            for x, y in batches(comm, 3):
                algo.zero_grad()
                loss(model, x, y).backward()
                algo.step()
            ok = bucketed == {1, 2, 4, 5} and model[0].weight.grad is None
            ok &= torch.equal(model[0].weight, frozen[0]) and torch.equal(model[2].bias, frozen[1])
            model[0].weight.requires_grad_(True)
            with pytest.raises(RuntimeError, match="frozen when the algorithm was built"):
                algo.step()
        finals.append(algo.params.detach().clone())
    assert all_ok(comm, ok and torch.equal(*finals))


# --- D-PSGD ----------------------------------------------------------------------------


def run_dpsgd(comm: MPI.Comm, overlap: bool, topology: str) -> tuple[torch.Tensor, object]:
    """Different starting models (BatchNorm included), six steps; rank 0 alone evaluates
    under no_grad after step 1 and runs an extra training forward pass before the settle
    after step 3 (a mix in flight there only). Returns the flat state and the algorithm."""
    model = mlp(batchnorm=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * comm.Get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    with algorithms.DPSGD(model, opt, comm, topology=topology, overlap=overlap, broadcast_init=False) as algo:
        for t, (x, y) in enumerate(batches(comm, 6)):
            algo.zero_grad()
            loss(model, x, y).backward()
            algo.step()
            if t == 1 and comm.Get_rank() == 0:
                with torch.no_grad():
                    model(x)
            if t == 3:
                if comm.Get_rank() == 0:
                    model(x)
                algo.settle()
        state = algo.state.detach().clone()
    return state, algo


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("topology", ["ring", "full"])
def test_dpsgd_overlap_gives_the_same_bits(size: int, topology: str) -> None:
    comm = comm_of_size(size)
    on, algo = run_dpsgd(comm, True, topology)
    off, plain = run_dpsgd(comm, False, topology)
    ok = algo.overlap and not plain.overlap and algo.flat.has_buffers
    ok &= torch.equal(on, off)
    assert all_ok(MPI.COMM_WORLD, ok), (topology, size)


def test_dpsgd_half_precision_overlap() -> None:
    """bfloat16 parameters mix in float32 into the side buffer: the same bits as in place."""
    comm = MPI.COMM_WORLD
    finals = []
    for overlap in (True, False):
        model = mlp().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with algorithms.DPSGD(model, opt, comm, overlap=overlap) as algo:
            for x, y in batches(comm, 3):
                algo.zero_grad()
                loss(model, x.to(torch.bfloat16), y).backward()
                algo.step()
        finals.append(algo.params.detach().clone())
    assert all_ok(comm, torch.equal(*finals))


# --- the step benchmark ----------------------------------------------------------------


def test_step_bench_times_every_candidate(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("stepbench") / "steps.json"
    # shm named: auto may choose another collective on this machine, and the update fuses with shm only
    args = ["--hidden", "32", "--steps", "2", "--repeat", "2", "--warmup", "1", "--bucket-mb", "0.001"]
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "step-bench", *args, "--collective", "shm", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = on_rank0_quietly(lambda: json.loads(out.read_text()))
    names = [r["name"] for r in data["results"]]
    assert names == [
        *("local", "comm", "allreduce", "allreduce-unfused", "allreduce+overlap", "dpsgd", "dpsgd+overlap", "ddp")
    ]
    assert data["meta"]["fused"] is True and data["meta"]["bucket_collectives"] == ["shm", "shm"]  # one node, SGD
    assert all(r["time"] > 0 and len(r["samples"]) == 2 for r in data["results"])
    assert data["meta"]["model"] == "MLP 64-32-10" and data["meta"]["ranks"] == 2 and data["meta"]["device"] == "cpu"
    assert data["meta"]["buckets"] == [4 * (10 + 320), 4 * (32 + 2048)]  # 0.001 MiB: closed at 262 floats
    assert "vs local" in proc.stdout and "local + comm" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod is not installed")
def test_step_bench_times_horovod_by_name(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("stepbench") / "horovod.json"
    args = ["--hidden", "32", "--steps", "2", "--repeat", "2", "--warmup", "1", "--candidates", "local,horovod"]
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "step-bench", *args, "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = on_rank0_quietly(lambda: json.loads(out.read_text()))
    assert [r["name"] for r in data["results"]] == ["local", "horovod"]
    assert all(r["time"] > 0 and len(r["samples"]) == 2 for r in data["results"])
