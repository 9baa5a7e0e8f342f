"""Compressed aggregation across ranks: the matrix on 1..8 ranks, bytes per step counted
by the transport against the ring all-reduce, error feedback's conservation, PowerSGD's
exactness at rank r, QSGD's unbiased aggregate, compressed gossip (CHOCO), bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from compression_check import CASES, NUMPY_DTYPES, check, rank_input
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, mpiexec, needs_torch, on_rank0_quietly, spread

import collectives
from algorithms.error_feedback import ErrorFeedback, finite
from collectives import ArgumentError, NeighborWeights, as_flat, compression
from collectives.compression.aggregate import chunks
from collectives.compression.timing import mlp_shapes
from collectives.transport import gpu
from collectives.transport.chunks import chunk_bounds
from collectives.transport.p2p import bytes_by_peer, bytes_sent

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_matrix_small_communicators(size: int) -> None:
    """Every compressor on float32, float64 and float16 buffers (numpy alone)."""
    comm = comm_of_size(size)
    failures = gather_failures(comm, check(comm, NUMPY_DTYPES))
    assert all_ok(WORLD, not failures), "\n".join(failures[:20])


@needs_torch
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_matrix_small_communicators_torch(size: int) -> None:
    """The rest of the matrix: every compressor on bfloat16 buffers (torch tensors)."""
    comm = comm_of_size(size)
    failures = gather_failures(comm, check(comm, ["bfloat16"]))
    assert all_ok(WORLD, not failures), "\n".join(failures[:20])


@pytest.mark.parametrize("size", [5, 6, 7, 8])
def test_matrix_large_communicators(size: int) -> None:
    """5..8 ranks do not fit the test launch: run the matrix under its own mpiexec (float32,
    lengths 1, fewer than n, several buckets; every compressor but bf16, whose torch import
    costs 8 ranks on 2 cores more than the rest)."""
    specs = ",".join(sorted({spec for spec, _ in CASES} - {"bf16"}))
    args = ["tests/compression_check.py", "--dtypes", "float32", "--lengths", f"1,{size - 2},1100", "--specs", specs]
    proc = on_rank0_quietly(mpiexec, size, args, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" in proc.stdout


@pytest.mark.skipif(not gpu.available(), reason="no CUDA device (or no CuPy)")
def test_device_matrix() -> None:
    proc = on_rank0_quietly(mpiexec, 2, ["tests/compression_check.py", "--device", "cuda"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# --- bytes --------------------------------------------------------------------------------


def ring_bytes(length: int, itemsize: int, n: int, r: int) -> int:
    """Bytes rank r sends in a ring all-reduce of ``length`` elements: every chunk but
    its own in the reduce-scatter, every chunk but its right neighbour's in the all-gather."""
    if n == 1:
        return 0
    b = chunk_bounds(length, n)
    size = [b[j + 1] - b[j] for j in range(n)]
    return itemsize * (2 * length - size[r] - size[(r + 1) % n])


def expected_bytes(c: compression.Compressor, d: int, n: int, r: int) -> int:
    """What ``c.allreduce`` of d float32 elements sends from rank r, by the module docstrings."""
    f32 = np.dtype(np.float32)
    if c.aggregation == "allgather":
        return (n - 1) * c.payload_nbytes(d)
    if c.aggregation == "reduce_scatter":
        _, offsets = chunks(c, d, n, f32)
        sizes = [offsets[j + 1] - offsets[j] for j in range(n)]
        return sum(sizes) - sizes[r] + (n - 1) * sizes[r]
    if c.name == "randk":
        return ring_bytes(c.k(d), 4, n, r)
    if c.name == "powersgd":
        p = sum(rows * c.rank for _, rows, _ in c.layers) + sum(b - a for a, b in c.plain)
        return ring_bytes(p, 4, n, r) + ring_bytes(sum(cols * c.rank for _, _, cols in c.layers), 4, n, r)
    return ring_bytes(d, 4, n, r)


#: The MLP 784-2048-2048-10's layout: 5 824 522 parameters, 22.2 MiB in float32.
MLP = [(784, 2048), (2048, 2048), (2048, 10)]


def mlp_layout() -> tuple[list[tuple[int, tuple[int, ...]]], int]:
    layout, at = [], 0
    for fan_in, fan_out in MLP:
        layout += [(at, (fan_out, fan_in)), (at + fan_in * fan_out, (fan_out,))]
        at += fan_in * fan_out + fan_out
    return layout, at


#: (spec, options, the largest ratio to the ring all-reduce's bytes allowed at n = 4).
BYTES = [
    ("none", {}, 1.0),
    ("fp16", {}, 0.5),
    ("bf16", {}, 0.5),
    ("qsgd:127", {}, 0.27),
    ("qsgd:127", {"aggregation": "allgather"}, 0.51),
    ("sign", {}, 0.04),
    ("sign", {"aggregation": "allgather"}, 0.07),
    ("topk:0.01", {}, 0.021),
    ("randk:0.01", {}, 0.01),
    ("powersgd:4", {"shapes": "mlp"}, 0.01),
]


@pytest.mark.parametrize("spec, options, most", BYTES)
def test_bytes_per_step_against_the_ring_allreduce(spec: str, options: dict, most: float) -> None:
    """Every byte is counted by the transport; the count is the one the module docstrings
    give, and at n = 4 the ratio to the uncompressed ring all-reduce (2 (n-1)/n 4 d bytes)
    is within the bound (the ratios at other n follow from the same formulas)."""
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    d = 400 * 512  # 100 buckets of 512 per rank for n = 4
    if options.get("shapes") == "mlp":
        options = {**options, "shapes": mlp_layout()[0]}
        d = mlp_layout()[1]
    c = compression.create(spec, **options)
    x = np.random.default_rng(r).standard_normal(d, dtype=np.float32)
    c.allreduce(x.copy(), comm, collective="ring")  # first use: plans, calibration, memory
    before = bytes_sent()
    c.allreduce(x, comm, residual=np.empty_like(x), collective="ring", validate=False)
    sent = bytes_sent() - before
    assert sent == expected_bytes(c, d, n, r)
    total = comm.allreduce(sent)
    ring = 2 * (n - 1) * 4 * d  # all ranks' bytes in a ring all-reduce
    if n == 4:
        assert total / ring <= most, f"{c}: {total / ring:.4f} of the ring all-reduce's bytes"
    if spec == "fp16":  # the same bytes as a ring all-reduce of the cast buffer
        assert total == 2 * (n - 1) * 2 * d


@pytest.mark.parametrize("spec", ["fp16", "bf16", "qsgd:127", "sign"])
def test_hierarchical_sends_the_compressed_slices_across_nodes(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of two ranks (``MPIDL_RANKS_PER_NODE=2``; one node at n = 2, nodes of different
    sizes at n = 3, where it is reduce_scatter): every rank ends with the same bits; the
    bytes to other nodes are each rank's reduce-scatter of its slice among the k nodes;
    fp16's result is the one the module docstring describes, bit for bit."""
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "2")
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    d = 64 * 512 + 77
    c = compression.create(f"{spec}@hierarchical")
    inputs = [np.random.default_rng(i).standard_normal(d, dtype=np.float32) * (i + 1) for i in range(n)]
    x = inputs[r].copy()
    c.allreduce(x.copy(), comm, collective="ring")  # first use: communicators, memory
    peers_before = dict(bytes_by_peer())
    c.allreduce(x, comm, "avg", collective="ring", validate=False)
    sent = {p: b - peers_before.get(p, 0) for p, b in bytes_by_peer().items()}
    ok = spread(comm, x) == 0
    k, q = -(-n // 2), 2
    across = sum(b for p, b in sent.items() if p >= 0 and p // q != r // q)
    if n % 2 == 0 and n >= 4:
        slices, _ = chunks(c, d, q, np.dtype(np.float32))
        mine = slices[r % q + 1] - slices[r % q]
        ok &= across == expected_bytes(compression.create(spec, aggregation="reduce_scatter"), mine, k, r // q)
    if spec == "fp16" and n % 2 == 0 and n >= 4:

        def fp16(v: np.ndarray) -> np.ndarray:
            return v.astype(np.float16).astype(np.float32)

        nodes = [(inputs[2 * a] + inputs[2 * a + 1]) / np.float32(n) for a in range(k)]
        ok &= bool(np.array_equal(x, fp16(sum(fp16(v) for v in nodes))))
    assert all_ok(comm, ok), (across, sent)


def test_the_ring_formula_is_the_ring() -> None:
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    for length in (1, 7, 1000):
        x = np.ones(length, np.float32)
        before = bytes_sent()
        collectives.allreduce(x, comm, collective="ring", validate=False)
        assert bytes_sent() - before == ring_bytes(length, 4, n, r)


# --- error feedback ------------------------------------------------------------------------------

SPECS = ["none", "fp16", "qsgd:31", "sign", "topk:0.05", "randk:0.1", "powersgd:2"]


def build(spec: str, length: int, **options) -> compression.Compressor:
    if spec.startswith("powersgd"):
        options["shapes"] = mlp_shapes(length, width=16)
    return compression.create(spec, **options)


@pytest.mark.parametrize(
    "spec, aggregation",
    [(s, a) for s in SPECS for a in compression.COMPRESSORS[s.partition(":")[0]].aggregations],
)
def test_error_feedback_conserves_the_signal(spec: str, aggregation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Summed over steps and ranks, what the aggregates applied plus the final residuals
    (and n times the server memories of the reduce-scatter compressors) is the sum of the
    gradients (float64, to a few rounding errors per term); the memory is split into two
    buckets of one gradient (``offset=``). ``hierarchical`` runs on nodes of two ranks
    (``MPIDL_RANKS_PER_NODE=2``: two nodes at n = 4)."""
    if aggregation == "hierarchical":
        monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "2")
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    d, steps, half = 700, 12, 300
    c = build(spec, d, aggregation=aggregation)
    grads = np.zeros(d)
    ef = ErrorFeedback(c, grads, enabled=True)
    applied, given, magnitude = np.zeros(d), np.zeros(d), np.zeros(d)
    for t in range(steps):
        g = np.random.default_rng([r, t]).standard_normal(d) * (1 + np.arange(d) % 5)
        given += g
        grads[:] = g
        if spec.startswith("powersgd"):
            ef.allreduce(grads, comm, collective="ring")
        else:
            ef.allreduce(grads[:half], comm, collective="ring")
            ef.allreduce(grads[half:], comm, offset=half, collective="ring")
        applied += grads
        magnitude += (np.abs(g) + n * np.abs(grads)) / getattr(c, "ratio", 1)  # random-k scales by d/k
    assert ef.residual is not None and (ef.server is not None) == (c.aggregation in ("reduce_scatter", "hierarchical"))
    server = np.zeros(d) if ef.server is None else ef.server
    total = comm.allreduce(given)
    kept = n * applied + comm.allreduce(ef.residual) + n * comm.allreduce(server)
    scale = comm.allreduce(magnitude + np.abs(ef.residual) + n * np.abs(server))
    assert all_ok(comm, bool(np.all(np.abs(total - kept) <= 64 * 2.0**-53 * scale))), np.abs(total - kept).max()
    assert all_ok(comm, spread(comm, applied) == 0)  # bitwise identical on all ranks


@pytest.mark.parametrize("spec", ["topk:0.05", "sign", "powersgd:2", "fp16"])
def test_a_non_finite_step_leaves_error_feedback_as_it_was(spec: str) -> None:
    """The last rank's gradient holds an inf at step 2, rank 0's a NaN at step 4 (overflows,
    which a GradScaler answers by skipping the step): those steps' aggregates are NaN on every
    rank, and the memories (residual, server) and the compressor's state (PowerSGD's warm
    start) stay as they were, so every other step's aggregate is finite and bitwise what a
    run without the two steps gives, and so are the final memories."""
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    d, steps, skipped = 700, 7, {2: (n - 1, np.inf), 4: (0, np.nan)}

    def run(skip: bool) -> tuple[list[np.ndarray], ErrorFeedback]:
        ef = ErrorFeedback(build(spec, d), np.zeros(d, np.float32), enabled=True)
        out = []
        for t in range(steps):
            if skip and t in skipped:
                continue
            g = (np.random.default_rng([r, t]).standard_normal(d) * (1 + np.arange(d) % 5)).astype(np.float32)
            rank, value = skipped.get(t, (-1, 0.0))
            if r == rank:
                g[d // 3] = value
            ef.allreduce(g, comm, collective="ring")
            out.append(g)
        return out, ef

    (poisoned, ef), (clean, reference) = run(False), run(True)
    ok = all(bool(np.isnan(poisoned[t]).all()) for t in skipped)
    kept = [a for t, a in enumerate(poisoned) if t not in skipped]
    ok &= all(bool(np.isfinite(a).all()) and np.array_equal(a, b) for a, b in zip(kept, clean))
    for key in ("residual", "server"):
        mine, theirs = getattr(ef, key), getattr(reference, key)
        ok &= (mine is None) == (theirs is None) and (mine is None or np.array_equal(mine, theirs))
    ok &= ef.server is not None or spec != "fp16"  # fp16 aggregates by reduce-scatter: a server memory
    assert all_ok(comm, ok)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_finite_tells_every_non_finite_value(dtype: str) -> None:
    """error_feedback.finite on buffers of every float dtype (bfloat16 as its bits): the
    largest and smallest finite values, zeros of both signs and subnormals are finite; an
    inf, a -inf or a NaN of either sign anywhere is not."""
    torch = pytest.importorskip("torch")
    kind = getattr(torch, dtype)
    info = torch.finfo(kind)
    finite_values = [info.max, -info.max, 0.0, -0.0, info.tiny / 2, -info.tiny / 2, 1.0]
    ok = finite(as_flat(torch.tensor(finite_values, dtype=kind))) and finite(as_flat(torch.zeros(0, dtype=kind)))
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(kind, torch.int16)
    for bad, negative in ((math.inf, False), (-math.inf, False), (math.nan, False), (math.nan, True)):
        for at in (0, 3, 6):
            values = torch.tensor(finite_values, dtype=kind)
            values[at] = bad
            if negative:  # the sign bit set on the NaN (torch's arithmetic would drop it for bfloat16)
                values.view(bits)[at] |= torch.iinfo(bits).min
            ok &= bool(torch.isnan(values[at]) or torch.isinf(values[at])) and not finite(as_flat(values))
            ok &= not negative or bool(torch.signbit(values[at]))
    assert ok


def test_error_feedback_refuses_before_it_changes_anything() -> None:
    """Calls the compressor refuses (an op it has not, an unknown all-reduce algorithm, a
    buffer of another dtype than the memory; one rank's op, checked across ranks) raise
    ArgumentError on every rank and leave the caller's buffer and the memory as they were."""
    comm, r = WORLD, WORLD.Get_rank()
    ef = ErrorFeedback("topk:0.25", np.zeros(8), enabled=True)
    ef.allreduce(np.arange(8.0) - 3, MPI.COMM_SELF)  # a memory to keep
    residual = ef.residual.copy()
    calls = [
        (np.ones(8), {"comm": MPI.COMM_SELF, "op": "max"}, "supports ops sum, avg"),
        (np.ones(8), {"comm": MPI.COMM_SELF, "collective": "nope"}, "unknown collective 'nope'"),
        (np.ones(8, np.float32), {"comm": MPI.COMM_SELF}, "the residual .* must match"),
        (np.ones(8), {"comm": comm, "op": "max" if r == 0 else "avg", "validate": True}, "disagree|not 'max'"),
    ]
    ok = bool(np.any(residual))
    for buf, options, match in calls:
        before = buf.copy()
        with pytest.raises(ArgumentError, match=match):
            ef.allreduce(buf, **options)
        ok &= np.array_equal(buf, before) and buf.dtype == before.dtype and np.array_equal(ef.residual, residual)
    assert all_ok(comm, ok)


def test_error_feedback_defaults_switch_and_reset() -> None:
    torch = pytest.importorskip("torch")
    for name, cls in compression.COMPRESSORS.items():
        spec = f"{name}:2" if name == "powersgd" else name
        ef = ErrorFeedback(spec, np.zeros(16), **({"shapes": [(0, (4, 4))]} if name == "powersgd" else {}))
        assert ef.enabled == cls.feedback and (ef.residual is not None) == cls.feedback
    ef = ErrorFeedback("topk:0.25", torch.zeros(4, 2), enabled=True)
    assert isinstance(ef.residual, torch.Tensor) and ef.residual.shape == (4, 2)
    g = torch.tensor([[4.0, -1.0], [0.5, 2.0], [0.0, 3.0], [1.0, 1.0]])
    ef.allreduce(g, MPI.COMM_SELF)
    assert torch.equal(g, torch.tensor([[4.0, 0], [0, 0], [0, 3.0], [0, 0]]))
    assert torch.equal(ef.residual, torch.tensor([[0, -1.0], [0.5, 2.0], [0, 0], [1.0, 1.0]]))
    ef.allreduce(torch.zeros(4, 2), MPI.COMM_SELF)  # the memory alone: 2.0, then -1.0 of the ties at 1
    assert torch.equal(ef.residual, torch.tensor([[0, 0], [0.5, 0], [0, 0], [1.0, 1.0]]))
    ef.reset()
    assert not torch.any(ef.residual)
    off = ErrorFeedback("sign", np.zeros(8), enabled=False)
    x = np.arange(8.0) - 3
    off.allreduce(x, MPI.COMM_SELF)
    assert off.residual is None and np.array_equal(x, np.where(np.arange(8) >= 3, 2.0, -2.0))
    with pytest.raises(ArgumentError, match="elements 6 to 10 lie outside the memory of 8"):
        ErrorFeedback("sign", np.zeros(8), enabled=True).allreduce(np.zeros(4), MPI.COMM_SELF, offset=6)


# --- PowerSGD, QSGD ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_powersgd_reproduces_a_rank_r_mean_exactly(size: int, dtype: str) -> None:
    """Each rank's layers are U V_i^T with U shared: the mean is of rank r, and PowerSGD at
    rank r returns it to rounding, at the first step and after the warm start (the biases
    and the small matrix are sent as they are)."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    shapes = [(0, (48, 40)), (1920, (48,)), (1968, (30, 2, 8)), (2448, (3, 5))]
    c = compression.create("powersgd:3", shapes=shapes)
    ok = True
    for step in range(2):
        x = np.random.default_rng([r, step]).standard_normal(2463)
        for (offset, (rows, *rest)), seed in ((shapes[0], 1), (shapes[2], 2)):
            cols = math.prod(rest)
            u = np.random.default_rng([seed, step]).standard_normal((rows, 3))  # the same on every rank
            x[offset : offset + rows * cols] = (u @ np.random.default_rng([r, seed]).standard_normal((3, cols))).ravel()
        x = x.astype(dtype)
        mean = np.mean(comm.allgather(x), axis=0)
        y = x.copy()
        c.allreduce(y, comm, collective="ring")
        tolerance = (1e-5 if dtype == "float32" else 1e-13) * np.abs(mean).max()
        ok &= bool(np.allclose(y, mean, rtol=0, atol=tolerance))
        ok &= len(set(comm.allgather(y.tobytes()))) == 1
    assert all_ok(WORLD, ok)


@pytest.mark.parametrize("aggregation", ["reduce_scatter", "allgather"])
def test_qsgd_aggregate_is_unbiased(aggregation: str) -> None:
    """Over 300 steps on fixed inputs, the mean aggregate lies within 5 standard errors
    (estimated from the samples) of the mean input; it is quantised twice (reduce_scatter)
    with independent draws on every rank, so the errors of the ranks do not cancel by design."""
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    c = compression.create("qsgd:2", bucket=8, aggregation=aggregation, seed=5)
    x = rank_input(r, 24, "float64")
    mean = np.mean(comm.allgather(x), axis=0)
    samples = np.empty((300, 24))
    for t in range(300):
        y = x.copy()
        c.allreduce(y, comm, validate=False)
        samples[t] = y
    error = np.abs(samples.mean(axis=0) - mean)
    bound = 5 * samples.std(axis=0, ddof=1) / math.sqrt(300) + 1e-12
    assert all_ok(comm, bool(np.all(error <= bound))), (error / bound).max()
    assert all_ok(comm, bool(np.all(samples.std(axis=0) > 0) or n == 1))


# --- compressed gossip (CHOCO) -----------------------------------------------------------------------


def ring_row(r: int, n: int) -> NeighborWeights:
    """A ring's row of W, 1/3 each (1/2 with one neighbour), or a lone rank's."""
    others = sorted({(r - 1) % n, (r + 1) % n} - {r})
    return NeighborWeights(1 / (len(others) + 1), {j: 1 / (len(others) + 1) for j in others})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", ["none", "fp16", "sign", "topk:0.2", "randk:0.5", "powersgd:2"])
def test_neighbor_exchange_decodes_the_neighbours_payloads(spec: str, dtype: str) -> None:
    """public += C(delta_i); mixed += w_ii C(delta_i) + sum_j w_ij C(delta_j), with each
    C(delta_j) rebuilt here from rank j's input (the codecs are deterministic given the
    seed); one payload per out-neighbour is sent."""
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    d = 300
    row = ring_row(r, n)
    work = np.float32
    deltas = [rank_input(i, d, dtype) for i in range(n)]
    public = np.full(d, 0.5, dtype)
    mixed = np.full(d, -1.0, dtype)
    c = build(spec, d)
    before = bytes_sent()
    compression.neighbor_exchange(c, deltas[r].astype(dtype), row, comm, public=public, mixed=mixed)
    assert bytes_sent() - before == len(row.destinations) * c.payload_nbytes(d, dtype)

    def decoded(i: int) -> np.ndarray:
        fresh = build(spec, d)
        return fresh.decompress(fresh.compress(deltas[i].astype(dtype)), np.empty(d, work))

    own = decoded(r)
    expected_mixed = np.full(d, -1.0, work) + own * work(row.self_weight)
    for j, w in row.sources:
        expected_mixed += decoded(j) * work(w)
    ok = np.array_equal(public, (np.float32(0.5) + own).astype(dtype))
    ok &= np.array_equal(mixed, expected_mixed.astype(dtype))
    assert all_ok(comm, bool(ok))


@pytest.mark.parametrize("spec, gamma", [("fp16", 1.0), ("qsgd:15", 0.5), ("topk:0.3", 0.3), ("sign", 0.2)])
def test_choco_gossip_reaches_consensus_and_keeps_the_mean(spec: str, gamma: float) -> None:
    """CHOCO-SGD's gossip without gradients (the intended use of neighbor_exchange): the
    models' mean stays put and their disagreement shrinks on a ring."""
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    if n < 3:
        pytest.skip("a ring of at least 3 ranks")
    d = 64
    x = np.random.default_rng(r).standard_normal(d) * 10
    mean = np.mean(comm.allgather(x), axis=0)
    start = spread(comm, x)
    public, mixed = np.zeros(d), np.zeros(d)
    c, row = compression.create(spec, seed=1), ring_row(r, n)
    for _ in range(150):
        compression.neighbor_exchange(c, x - public, row, comm, public=public, mixed=mixed, validate=False)
        x += gamma * (mixed - public)
    drift = np.abs(np.mean(comm.allgather(x), axis=0) - mean).max()
    assert all_ok(comm, drift < 1e-9 * np.abs(mean).max() + 1e-12)
    assert all_ok(comm, spread(comm, x) < 0.05 * start), spread(comm, x) / start


# --- arguments ----------------------------------------------------------------------------------


def raises_everywhere(comm: MPI.Comm, action, words: str) -> bool:
    """Whether ``action()`` raises an ArgumentError with ``words`` on every rank."""
    try:
        action()
    except ArgumentError as exc:
        return all_ok(comm, words in str(exc))
    return all_ok(comm, False)


def test_bad_arguments_raise_on_every_rank_and_move_nothing() -> None:
    comm, n, r = WORLD, WORLD.Get_size(), WORLD.Get_rank()
    x = np.arange(10, dtype=np.float32) + r
    keep = x.copy()
    qsgd = compression.create("qsgd:127")
    local = [  # a problem on rank 0 (or everywhere)
        (
            lambda: qsgd.allreduce(x if r else x.astype(np.int32), comm),
            "[0]: qsgd:127 allreduce needs a floating-point",
        ),
        (lambda: qsgd.allreduce(x, comm, op="max"), "supports ops sum, avg, not 'max'"),
        (lambda: qsgd.allreduce(x, comm, collective="fastest"), "unknown collective 'fastest'"),
        (lambda: qsgd.allreduce(x, comm, residual=np.zeros(10 + (r == 0), np.float32)), "must match the buffer"),
        (lambda: qsgd.allreduce(x, comm, server=np.zeros(10, np.float64)), "the server memory (10 float64) must"),
        (lambda: build("powersgd:1", 10 if r else 12).allreduce(x, comm), "[0]: powersgd: the layout covers 12"),
    ]
    disagreeing = [  # fine on each rank, but not alike
        (lambda: qsgd.allreduce(x if r else x[:9], comm), "length differs across ranks (rank 0: 9, rank 1: 10"),
        (
            lambda: compression.create("qsgd:127" if r else "sign").allreduce(x, comm),
            "algorithm differs across ranks (rank 0: sign/reduce_scatter, rank 1: qsgd/reduce_scatter",
        ),
        (lambda: compression.create("qsgd:127" if r else "qsgd:63").allreduce(x, comm), "options differs"),
        (lambda: compression.create("randk:0.5", seed=r).allreduce(x, comm), "options differs"),
        (
            lambda: compression.create("powersgd:1", shapes=[(0, (3, 3)), (9, (1,))] if r else [(0, (10,))]).allreduce(
                x, comm
            ),
            "options differs",
        ),
    ]
    ok = True
    for action, words in local + (disagreeing if n > 1 else []):
        ok &= raises_everywhere(comm, action, words)
        ok &= np.array_equal(x, keep)
    assert all_ok(comm, ok)


def test_torch_tensors_any_shape_in_place() -> None:
    torch = pytest.importorskip("torch")
    comm, r = WORLD, WORLD.Get_rank()
    for spec in ["fp16", "sign", "topk:0.5", "randk:0.5", "qsgd:127"]:
        weight = torch.nn.Parameter(torch.arange(15.0).reshape(3, 5) * (r + 1))
        out = compression.create(spec).allreduce(weight, comm)
        assert out is weight
        assert all_ok(comm, len(set(comm.allgather(weight.detach().numpy().tobytes()))) == 1)
