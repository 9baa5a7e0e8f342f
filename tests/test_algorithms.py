"""Training algorithms on 1..4 ranks: convergence to a known optimum, consensus at the
rate the spectral gap predicts, exact byte counts, numpy and torch paths alike, and
configuration errors raised on every rank."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
import collectives
from algorithms import SGD, topology
from collectives import ArgumentError

pytestmark = pytest.mark.mpi

DIM = 12  # divisible by 1..4: ring chunks are equal, so byte counts are exact

#: (algorithm, options) pairs exercised on every communicator size.
CONFIGS = {
    "allreduce-ring": ("allreduce", {"collective": "ring"}),
    "allreduce-halving_doubling": ("allreduce", {"collective": "halving_doubling"}),
    "dpsgd-ring": ("dpsgd", {"topology": "ring"}),
    "dpsgd-exponential-metropolis": ("dpsgd", {"topology": "exponential", "weights": "metropolis"}),
    "lsgd-pairs": ("lsgd", {"layout": 2, "collective": "ring"}),
    "lsgd-singletons": ("lsgd", {"layout": 1, "collective": "butterfly"}),
    "grsgd-synchronous": ("grsgd", {"max_lead": 0}),
    "prague-static-everyone": ("prague", {"policy": "static", "group_size": 4}),
}

#: Asynchronous configurations: workers may be at different steps at any moment.
ASYNC_CONFIGS = {
    "adpsgd": ("adpsgd", {}),
    "grsgd": ("grsgd", {"max_lead": 2}),
    "prague-smart": ("prague", {"policy": "smart"}),
    "prague-random-local2": ("prague", {"policy": "random", "local_steps": 2}),
}


def targets(comm: MPI.Comm) -> tuple[np.ndarray, np.ndarray]:
    """Worker i minimises f_i(x) = 0.5 ||x - a_i||^2; the optimum of the sum is mean_i a_i."""
    a = [np.sin(np.arange(DIM) * (i + 1)) * (i + 2) for i in range(comm.Get_size())]
    return a[comm.Get_rank()], np.mean(a, axis=0)


def gathered(comm: MPI.Comm, x: np.ndarray) -> np.ndarray:
    return np.array(comm.allgather(np.array(x, dtype=np.float64).reshape(-1)))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_converges_to_the_optimum(config: str, size: int) -> None:
    """Constant lr 0.5, then a geometric decay (decentralized models only agree as lr -> 0)."""
    comm = comm_of_size(size)
    name, options = CONFIGS[config]
    if "group_size" in options:
        options = {**options, "group_size": min(options["group_size"], comm.Get_size())}
    a, optimum = targets(comm)
    x = np.full(DIM, 3.0 * comm.Get_rank())  # different starts; broadcast_init makes them equal
    opt = SGD(x, lr=0.5, momentum=0.0)
    with algorithms.create(name, x, opt, comm, **options) as algo:
        for t in range(90):
            if t >= 45:
                opt.lr *= 0.7
            algo.step(x - a)
        err = float(np.max(np.abs(x - optimum)))
        assert algo.iterations == 90
    assert all_ok(MPI.COMM_WORLD, err < 1e-6), f"{config} on {size} ranks: max error {err:.3g}"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(ASYNC_CONFIGS))
def test_asynchronous_algorithms_converge_to_the_optimum(config: str, size: int) -> None:
    """Workers from different random starts minimise the same f(x) = 0.5 ||x - a||^2
    without a global clock (random sleeps make their speeds differ): each ends at a.
    The step size stays 0.3 (a decaying one left a lagging worker's error, averaged in
    late, barely contracted: 1.5e-6 on a loaded machine).

    With different targets per worker the point asynchronous SGD reaches depends on
    how the workers' steps happened to interleave (a gradient taken just before an
    averaging on one worker and just after it on another moves the mean by lr
    times their disagreement), so it is only near the optimum; that case is
    covered by training on real data (test_train.py), the averaging itself by
    the sum-preservation checks (async_check.py)."""
    comm = comm_of_size(size)
    name, options = ASYNC_CONFIGS[config]
    rng = np.random.default_rng(comm.Get_rank())
    a = np.sin(np.arange(DIM)) * 3
    x = rng.standard_normal(DIM) * 5
    opt = SGD(x, lr=0.3, momentum=0.0)
    with algorithms.create(name, x, opt, comm, broadcast_init=False, **options) as algo:
        for t in range(120):
            time.sleep(rng.uniform(0, 5e-4))
            algo.step(x - a)
            if t == 59:
                algo.settle()
    err = float(np.max(np.abs(x - a)))
    assert all_ok(MPI.COMM_WORLD, err < 1e-6 and algo.iterations == 120), f"{config} on {size} ranks: {err=:.3g}"


@pytest.mark.parametrize("config", ["allreduce-ring", "dpsgd-ring", "lsgd-pairs"])
def test_numpy_and_torch_paths_agree(config: str) -> None:
    """The same problem as a torch model (one float64 parameter) with torch.optim.SGD
    and momentum, and as a numpy array with algorithms.SGD: the same trajectory."""
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    name, options = CONFIGS[config]
    a, _ = targets(comm)
    x = np.full(DIM, float(comm.Get_rank()))
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(torch.tensor(x))
    np_algo = algorithms.create(name, x, SGD(x, lr=0.1, momentum=0.9), comm, broadcast_init=False, **options)
    torch_algo = algorithms.create(
        name, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm, broadcast_init=False, **options
    )
    target = torch.tensor(a)
    for _ in range(20):
        np_algo.step(x - a)
        torch_algo.zero_grad()
        (0.5 * (model.x - target).pow(2).sum()).backward()
        torch_algo.step()
    np_algo.close()
    torch_algo.close()
    assert torch_algo.params.data_ptr() == model.x.data_ptr()
    assert all_ok(comm, np.allclose(model.x.detach().numpy(), x, rtol=0, atol=1e-12))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", ["allreduce-ring", "dpsgd-ring", "lsgd-pairs"])
def test_half_precision_torch_models(config: str, dtype: str) -> None:
    """Half-precision parameters train too (averaging in float32, rounded once): the mean
    model reaches the optimum, and the synchronous algorithms keep the models identical."""
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    name, options = CONFIGS[config]
    a, optimum = targets(comm)
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(torch.zeros(DIM, dtype=getattr(torch, dtype)))
    target = torch.tensor(a, dtype=model.x.dtype)
    with algorithms.create(name, model, torch.optim.SGD(model.parameters(), lr=0.25), comm, **options) as algo:
        for _ in range(40):
            algo.zero_grad()
            (0.5 * (model.x - target).pow(2).sum()).backward()
            algo.step()
    X = gathered(comm, model.x.detach().float().numpy())
    tolerance = {"bfloat16": 0.08, "float16": 0.01}[dtype]  # a few units in the last place near 2.5
    same = len({v.tobytes() for v in X}) == 1 or name == "dpsgd"  # D-PSGD: only the mean is at the optimum
    assert all_ok(comm, same and np.allclose(X.mean(axis=0), optimum, rtol=0, atol=tolerance)), X


def consensus_distance(comm: MPI.Comm, x: np.ndarray) -> tuple[float, np.ndarray]:
    X = gathered(comm, x)
    return float(np.linalg.norm(X - X.mean(axis=0))), X.mean(axis=0)


GRAPHS = {
    "ring": lambda n: topology.ring(n),
    "path-metropolis": lambda n: (
        topology.from_edges(n, [(i, i + 1) for i in range(n - 1)]) if n > 1 else topology.ring(1)
    ),
}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_dpsgd_step_is_mixing_minus_local_gradient(size: int) -> None:
    """One step: x_i <- sum_j W_ij x_j - lr g_i, with g_i taken at the pre-averaging x_i."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    x = np.random.default_rng(r).standard_normal(DIM)
    g = np.cos(x)  # a gradient evaluated at x(t)
    X, G = gathered(comm, x), gathered(comm, g)
    algo = algorithms.DPSGD(x, SGD(x, lr=0.25), comm, topology="ring", broadcast_init=False)
    algo.step(g)
    expected = algo.topology.W[r] @ X - 0.25 * G[r]
    assert all_ok(MPI.COMM_WORLD, np.allclose(x, expected, rtol=0, atol=1e-13))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_dpsgd_zero_lr_consensus_at_the_spectral_rate(graph: str, size: int) -> None:
    """lr = 0: the mean is preserved; the disagreement shrinks by at most |lambda_2| per
    step, and by exactly |lambda_2| when it lies along lambda_2's eigenvector."""
    comm = comm_of_size(size)
    n, r = comm.Get_size(), comm.Get_rank()
    topo = GRAPHS[graph](n)
    lam = topo.lambda2
    eigvals, eigvecs = np.linalg.eigh(topo.W)
    slow = eigvecs[:, int(np.argmax(np.where(np.isclose(eigvals, 1.0), -1, np.abs(eigvals))))]
    direction = np.random.default_rng(7).standard_normal(DIM)
    failures = []
    for start in ("random", "eigenvector"):
        x = np.random.default_rng(r).standard_normal(DIM) if start == "random" else 1.0 + slow[r] * direction
        algo = algorithms.DPSGD(x, SGD(x, lr=0.0), comm, topology=topo, broadcast_init=False)
        dist, mean = consensus_distance(comm, x)
        mean0, ratios = mean, []
        for _ in range(8):
            algo.step(np.zeros(DIM))
            new, mean = consensus_distance(comm, x)
            ratios.append(new / dist if dist > 1e-12 else 0.0)
            dist = new
            if not np.allclose(mean, mean0, rtol=0, atol=1e-12):
                failures.append(f"{start}: mean moved by {np.max(np.abs(mean - mean0)):.3g}")
        if max(ratios) > lam + 1e-9:
            failures.append(f"{start}: contraction {max(ratios):.6f} > |lambda_2| = {lam:.6f}")
        if start == "eigenvector" and lam > 0 and not np.allclose(ratios, lam, atol=1e-9):
            failures.append(f"eigenvector: contractions {ratios} != |lambda_2| = {lam:.6f}")
        if lam == 0 and dist > 1e-12:
            failures.append(f"{start}: |lambda_2| = 0 but distance {dist:.3g} after a step")
    assert all_ok(MPI.COMM_WORLD, not failures), failures


def test_dpsgd_consensus_rate_on_a_slow_graph() -> None:
    """A 4-path has |lambda_2| ~ 0.8: from a random start the measured rate approaches it."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        pytest.skip("needs four ranks")
    topo = topology.from_edges(4, [(0, 1), (1, 2), (2, 3)])
    x = np.random.default_rng(comm.Get_rank()).standard_normal(DIM)
    algo = algorithms.DPSGD(x, SGD(x, lr=0.0), comm, topology=topo, broadcast_init=False)
    first, _ = consensus_distance(comm, x)
    for _ in range(25):
        algo.step(np.zeros(DIM))
    last, _ = consensus_distance(comm, x)
    rate = (last / first) ** (1 / 25)
    assert all_ok(comm, 0.95 * topo.lambda2 < rate <= topo.lambda2 + 1e-9), (rate, topo.lambda2)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_bytes_sent_allreduce_and_dpsgd(size: int) -> None:
    """AllReduce-SGD with the ring: 2(n-1)/n model bytes per step; D-PSGD: degree x model bytes."""
    comm = comm_of_size(size)
    n = comm.Get_size()
    model_bytes, steps = DIM * 8, 5
    x, y = np.zeros(DIM), np.zeros(DIM)
    ring_sgd = algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, collective="ring")
    dpsgd = algorithms.DPSGD(y, SGD(y, lr=0.1), comm, topology="ring")
    for _ in range(steps):
        ring_sgd.step(np.ones(DIM))
        dpsgd.step(np.ones(DIM))
    degree = dpsgd.topology.degree(comm.Get_rank())
    ok = (
        ring_sgd.bytes_sent == steps * 2 * (n - 1) * model_bytes // n
        and dpsgd.bytes_sent == steps * degree * model_bytes
        and degree == min(n - 1, 2)
        and ring_sgd.comm_wait_s > 0
        and dpsgd.iterations == steps
    )
    assert all_ok(MPI.COMM_WORLD, ok), (n, ring_sgd.bytes_sent, dpsgd.bytes_sent, degree)


def test_bytes_sent_lsgd_two_groups_of_two() -> None:
    """Per step: each non-representative sends its reduce message (m), each representative
    broadcasts to its one group peer (m, from the second step on) and runs a ring
    all-reduce with the other representative (2 (2-1)/2 m = m)."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        pytest.skip("needs four ranks")
    m, steps = DIM * 8, 6
    x = np.zeros(DIM)
    algo = algorithms.LSGD(x, SGD(x, lr=0.1), comm, layout="2,2", collective="ring")
    for _ in range(steps):
        algo.step(np.ones(DIM))
    algo.close()
    expected = (steps - 1) * m + steps * m if algo.representative else steps * m
    assert all_ok(comm, algo.bytes_sent == expected and algo.groups == 2), (algo.bytes_sent, expected)


@pytest.mark.parametrize("config", ["allreduce-ring", "lsgd-pairs", "lsgd-singletons"])
def test_synchronous_models_stay_bitwise_identical(config: str) -> None:
    comm = MPI.COMM_WORLD
    name, options = CONFIGS[config]
    a, _ = targets(comm)
    x = np.random.default_rng(comm.Get_rank()).standard_normal(DIM).astype(np.float32)
    identical = True
    with algorithms.create(name, x, SGD(x, lr=0.3, momentum=0.5), comm, **options) as algo:
        for _ in range(10):
            algo.step(x - a)
            identical &= len({v.tobytes() for v in comm.allgather(x)}) == 1
    assert all_ok(comm, identical)


def test_lsgd_applies_the_global_gradient_one_step_late() -> None:
    """Several groups: x(t+1) = x(t) - lr (x(t-1) - mean a) on these quadratics, from the
    second step on; with one group LSGD is AllReduce-SGD, bit for bit."""
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    a, optimum = targets(comm)
    lr = 0.3
    x = np.zeros(DIM)
    with algorithms.LSGD(x, SGD(x, lr=lr), comm, layout=2 if n > 2 else 1, collective="ring") as algo:
        history = [x.copy()]
        for _ in range(6):
            algo.step(x - a)
            history.append(x.copy())
    expected = [np.zeros(DIM), np.zeros(DIM)]  # the first step fills the pipeline
    for _t in range(1, 6):
        expected.append(expected[-1] - lr * (expected[-2] - optimum))
    staleness_ok = n == 1 or (algo.groups > 1 and np.allclose(history, expected, rtol=0, atol=1e-12))

    y, z = np.zeros(DIM), np.zeros(DIM)
    one_group = algorithms.LSGD(y, SGD(y, lr=lr), comm, layout=comm.Get_size(), collective="ring")
    baseline = algorithms.AllReduceSGD(z, SGD(z, lr=lr), comm, collective="ring")
    for _ in range(6):
        one_group.step(y - a)
        baseline.step(z - a)
    assert all_ok(comm, staleness_ok and one_group.groups == 1 and y.tobytes() == z.tobytes())


def test_lsgd_groups_from_the_node_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: the nodes (Split_type; one machine here); MPIDL_RANKS_PER_NODE emulates nodes."""
    comm = MPI.COMM_WORLD
    monkeypatch.delenv("MPIDL_RANKS_PER_NODE", raising=False)
    x = np.zeros(DIM)
    detected = algorithms.LSGD(x, SGD(x, lr=0.1), comm, collective="ring")
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "1")
    emulated = algorithms.LSGD(x, SGD(x, lr=0.1), comm, collective="ring")
    emulated.step(np.ones(DIM))
    emulated.close()
    with pytest.raises(RuntimeError, match="closed"):
        emulated.step(np.ones(DIM))
    ok = (
        detected.groups == 1
        and detected.group_size == comm.Get_size()
        and not detected.representative
        and emulated.groups == comm.Get_size()
        and emulated.representative == (comm.Get_size() > 1)
    )
    assert all_ok(comm, ok)


def test_default_allreduce_algorithm_is_the_collectives_default() -> None:
    """ "auto" is resolved (the cost model calibrated) at construction, not in a step."""
    import collectives

    comm = MPI.COMM_WORLD
    x = np.zeros(DIM)
    algo = algorithms.AllReduceSGD(x, SGD(x, lr=0.5), comm)
    assert algo.collective == collectives.DEFAULT_COLLECTIVE
    a, optimum = targets(comm)
    for _ in range(40):
        algo.step(x - a)
    chosen = algo.choice is None or algo.choice.algorithm in collectives.COLLECTIVES
    assert all_ok(comm, chosen and np.allclose(x, optimum, atol=1e-9))


def test_mismatched_configuration_raises_on_every_rank() -> None:
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    if n < 2:
        pytest.skip("needs two ranks")
    last = comm.Get_rank() == n - 1
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError) as info:
        algorithms.create("dpsgd" if last else "allreduce", x, SGD(x, lr=0.1), comm)
    text = str(info.value)
    assert all_ok(
        comm,
        len(set(comm.allgather(text))) == 1 and "algorithm differs" in text and "dpsgd" in text and "allreduce" in text,
    ), text
    y = np.zeros(DIM + last)
    with pytest.raises(ArgumentError, match="length differs"):
        algorithms.AllReduceSGD(y, SGD(y, lr=0.1), comm)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"topology": "moebius"}, "unknown topology"),
        ({"topology": topology.ring(9)}, "has 9 ranks"),
        ({"topology": "hypercube"}, "power-of-two"),
    ],
)
def test_bad_topology_raises_on_every_rank(options: dict, match: str) -> None:
    comm = MPI.COMM_WORLD
    if options["topology"] == "hypercube" and comm.Get_size() & (comm.Get_size() - 1) == 0:
        options = {"topology": topology.from_edges(3, [(0, 1), (1, 2)])}
        match = "has 3 ranks"
    x = np.zeros(DIM)
    with pytest.raises(ArgumentError, match=match) as info:
        algorithms.DPSGD(x, SGD(x, lr=0.1), comm, **options)
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1)


def test_registry_and_factory() -> None:
    assert set(algorithms.ALGORITHMS) == {"allreduce", "dpsgd", "lsgd", "adpsgd", "grsgd", "prague"}
    assert all(cls.name == name for name, cls in algorithms.ALGORITHMS.items())
    with pytest.raises(ValueError, match="unknown algorithm 'gossip'"):
        algorithms.create("gossip", np.zeros(2), SGD(np.zeros(2), lr=0.1))


@pytest.mark.parametrize("name", ["allreduce", "adpsgd"])
def test_an_argument_error_leaving_a_with_block_closes_the_algorithm(name: str) -> None:
    """mpidl raises an ArgumentError on every rank alike, so the ranks close together
    (another exception leaves the algorithm open: tests/test_failures.py)."""
    comm = comm_of_size(4)
    x = np.zeros(3)
    with (
        pytest.raises(ArgumentError, match="unknown collective 'nope'"),
        algorithms.create(name, x, SGD(x, lr=0.1), comm) as algo,
    ):
        collectives.allreduce(np.zeros(2), comm, collective="nope")
    assert all_ok(comm, algo.closed)


#: One configuration of every algorithm, for the BatchNorm statistics test.
EVERY_ALGORITHM = {
    "allreduce": {"collective": "ring"},
    "lsgd": {"layout": 2, "collective": "ring"},
    "dpsgd": {"topology": "full"},
    "adpsgd": {},
    "grsgd": {"max_lead": 0},
    "prague": {"policy": "static", "group_size": 4},
}


@pytest.mark.parametrize("name", list(EVERY_ALGORITHM))
def test_batchnorm_statistics_follow_what_the_algorithm_averages(name: str) -> None:
    """BatchNorm's running statistics live in the flat state after the parameters. Rank r
    gives them the value r (and its parameters, with lr 0, stay put): the model-averaging
    algorithms mix them like the parameters, so the sum over workers is kept and the
    synchronous full graph (D-PSGD) reaches the mean in one step; the gradient-averaging
    ones leave every worker's own. The int64 batch counter stays out of the state."""
    torch = pytest.importorskip("torch")
    comm = comm_of_size(4)
    rank, n = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
    bn = model[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    options = dict(EVERY_ALGORITHM[name], **({"group_size": n} if name == "prague" else {}))
    with algorithms.create(name, model, opt, comm, **options) as algo:
        flat = algo.flat
        n_params = sum(p.numel() for p in model.parameters())
        ok = flat.has_buffers and algo.state.numel() == n_params + 8 and torch.equal(algo.state[:n_params], algo.params)
        ok &= bn.running_mean.data_ptr() == algo.state[n_params:].data_ptr()  # re-pointed, still registered
        ok &= "running_mean" in dict(bn.named_buffers()) and bn.num_batches_tracked.dtype == torch.int64
        with torch.no_grad():
            bn.running_mean.fill_(rank)
            bn.running_var.fill_(10 * rank)
        comm.Barrier()  # every worker's statistics are set before any averaging (AD-PSGD's servers answer at once)
        steps = 4 if algo.uneven_steps else 1
        for _ in range(steps):
            algo.zero_grad()
            algo.step()
        algo.settle()
        means = np.array(comm.allgather(bn.running_mean.numpy().copy()))
        variances = np.array(comm.allgather(bn.running_var.numpy().copy()))
    own = np.arange(float(n))
    if name in ("allreduce", "lsgd"):
        ok &= np.array_equal(means[:, 0], own) and np.array_equal(variances[:, 0], 10 * own)
    else:
        ok &= np.isclose(means.sum(), 4 * own.sum()) and np.isclose(variances.sum(), 40 * own.sum())  # the sum is kept
        ok &= n == 1 or not np.array_equal(means[:, 0], own)  # and they were averaged
        if name == "dpsgd":
            ok &= np.allclose(means, own.mean()) and np.allclose(variances, 10 * own.mean())
    assert all_ok(comm, ok), (means[:, 0], variances[:, 0])
