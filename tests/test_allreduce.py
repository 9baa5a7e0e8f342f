"""All-reduce correctness: every algorithm x op x dtype x length on 1..8 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from allreduce_matrix import available_dtypes, check
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures, mpiexec, on_rank0_quietly

import collectives
from collectives import GroupComm
from collectives.transport import p2p

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", list(collectives.COLLECTIVES))
def test_matrix_small_communicators(algorithm: str, size: int) -> None:
    comm = comm_of_size(size)
    failures = gather_failures(comm, check(comm, [algorithm], available_dtypes()))
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures[:20])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_segment_boundaries(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large blocks are received and combined in segments: make segments tiny and odd-sized."""
    from collectives.transport import exchange

    monkeypatch.setattr(exchange, "SEGMENT", 24)
    comm = comm_of_size(size)
    failures = gather_failures(
        comm,
        check(
            comm,
            ["ring", "halving_doubling", "butterfly", "torus2d"],
            ["float16", "float64", "int32"],
            ["sum", "max"],
            [0, 1, 5, 17, 100],
        ),
    )
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures[:20])


def test_matrix_large_communicators() -> None:
    """5..8 ranks do not fit the test launch: run the matrix under its own mpiexec of 8,
    on its first 5, 6, 7 and 8 ranks in turn; every algorithm and length, ops and dtypes in
    all pairs (allreduce_matrix.py)."""
    args = ["tests/allreduce_matrix.py", "--design", "pairs", "--sizes", "5,6,7,8"]
    proc = on_rank0_quietly(mpiexec, 8, args, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for size in (5, 6, 7, 8):
        assert f"all-reduce matrix (pairs) passed on {size} ranks" in proc.stdout, proc.stdout[-4000:]


def test_torch_tensor_any_shape_in_place() -> None:
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    weight = torch.nn.Parameter(torch.full((3, 5), float(r + 1)))  # requires grad, like a model's
    out = collectives.allreduce(weight, comm, op="avg")
    expected = (n + 1) / 2
    assert out is weight
    assert all_ok(comm, bool(torch.all(weight.detach() == expected)))


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("algorithm", ["auto", "ring", "shm"])
def test_numpy_subclasses_are_host_arrays(algorithm: str, tmp_path) -> None:
    """np.memmap and np.matrix are host memory (they were taken for device buffers:
    "a device buffer was given but no CUDA device is usable"); reduced in place,
    returned as they are. A read-only memmap and a masked array are refused."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    total = sum(10.0**i for i in range(n))
    mapped = np.memmap(tmp_path / "vector", dtype=np.float64, mode="w+", shape=(3, 4))
    mapped[:] = 10.0**r
    matrix = np.matrix(np.full((2, 5), 10.0**r))
    ok = collectives.allreduce(mapped, comm, collective=algorithm) is mapped and bool(np.all(mapped == total))
    ok &= collectives.allreduce(matrix, comm, collective=algorithm) is matrix and bool(np.all(matrix == total))
    mapped.flush()
    ok &= bool(np.all(np.fromfile(tmp_path / "vector") == total))  # reduced in the file's memory
    assert all_ok(comm, ok)
    with pytest.raises(collectives.ArgumentError, match="read-only"):
        collectives.allreduce(np.memmap(tmp_path / "vector", dtype=np.float64, mode="r"), comm, collective=algorithm)
    with pytest.raises(collectives.ArgumentError, match=r"masked array .* would ignore its mask"):
        collectives.allreduce(np.ma.masked_array(np.ones(4), mask=[0, 1, 0, 0]), comm, collective=algorithm)


def test_bfloat16_rounds_once_per_combine() -> None:
    """bfloat16 sums are computed in float32 and rounded to nearest even per step."""
    torch = pytest.importorskip("torch")
    comm = comm_of_size(2)  # a lone last rank gets a communicator of one
    inputs = [[1.0, 256.0, 3.0], [2.0**-8, 1.0, 2.0**-7]][: comm.Get_size()]
    parts = [torch.tensor(v, dtype=torch.bfloat16) for v in inputs]
    expected = sum(p.float() for p in parts).to(torch.bfloat16)  # 1+2^-8 ties to 1, 3+2^-7 to 3
    x = parts[comm.Get_rank()].clone()
    collectives.allreduce(x, comm, collective="butterfly")
    assert all_ok(MPI.COMM_WORLD, bool(torch.equal(x, expected)))


def nan(payload: int) -> float:
    """A quiet float64 NaN with this payload."""
    return float(np.array(0x7FF8000000000000 + payload, np.uint64).view(np.float64))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("algorithm", list(collectives.COLLECTIVES))
def test_signed_zero_and_nan_agree_bitwise(algorithm: str, size: int) -> None:
    """Order-sensitive IEEE cases (min of -0.0 and 0.0, NaN payloads) agree on all ranks
    (two ranks: the pairwise paths, e.g. shm's, where each rank combines its own vector).
    "mpi" refuses min on floats: MPI's does not return NaN where an operand is NaN."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    x = np.array([0.0 if r % 2 else -0.0, np.nan if r == 0 else 1.0, -np.nan if r == 1 else 2.0])
    if algorithm == "mpi":
        with pytest.raises(collectives.ArgumentError, match="min on float64 does not return NaN"):
            collectives.allreduce(x, comm, op="min", collective=algorithm)
        return
    collectives.allreduce(x, comm, op="min", collective=algorithm)
    assert all_ok(comm, len(set(comm.allgather(x.tobytes()))) == 1)
    assert all_ok(comm, bool(x[0] == 0.0) and (bool(np.isnan(x[1])) or comm.Get_size() == 1))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 3, 1000])
def test_native_short_sums_agree_bitwise(size: int, length: int) -> None:
    """ "mpi" on short vectors (MPICH's MPI_Allreduce runs recursive doubling there,
    which left each rank its own NaN payload): values of many magnitudes, NaNs of
    different payloads and signs meeting, an infinity, end bitwise identical; the NaNs
    where numpy's sum has them, the rest its sum to rounding."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    rng = np.random.default_rng(r)
    x = rng.standard_normal(length) * 10.0 ** rng.integers(-8, 9, length)
    x[::7] = -nan(1 + r) if r % 2 else nan(1 + r)
    x[1::11] = np.inf
    expected = np.sum(comm.allgather(x), axis=0)
    collectives.allreduce(x, comm, collective="mpi")
    assert all_ok(comm, len(set(comm.allgather(x.tobytes()))) == 1)
    assert all_ok(comm, bool(np.array_equal(np.isnan(x), np.isnan(expected))))
    assert all_ok(comm, bool(np.allclose(x, expected, rtol=1e-12, atol=1e-6, equal_nan=True)))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", list(collectives.COLLECTIVES))
def test_long_float_sums_agree_bitwise(algorithm: str, size: int) -> None:
    """Beyond the MPI library's short-vector paths (98 KB, over the 64 KiB up to which
    "mpi" makes NaNs alike after the call): sums of values of many magnitudes, with
    NaNs of different payloads meeting, end bitwise identical on every rank."""
    comm = comm_of_size(size)
    r = comm.Get_rank()
    rng = np.random.default_rng(r)
    x = rng.standard_normal(12289) * 10.0 ** rng.integers(-8, 9, 12289)
    x[::101] = nan(1 + r)
    collectives.allreduce(x, comm, collective=algorithm)
    assert all_ok(comm, len(set(comm.allgather(x.tobytes()))) == 1)


@pytest.mark.parametrize("algorithm", ["auto", "shm", "ring", "butterfly", "mpi"])
@pytest.mark.parametrize("length", [0, 1, 7, 1000])
def test_persistent_allreduce_reduces_its_buffer_on_every_call(algorithm: str, length: int) -> None:
    """A persistent all-reduce gives, call after call, the exact sums that ``allreduce``
    gives, the same bits on every rank, and returns its buffer; a second handle of the
    same buffer agrees."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.zeros((length,), np.int64)
    handle = collectives.allreduce_init(x, comm, "sum", algorithm)
    for call in range(3):
        x[:] = np.arange(length) * (r + 1) + call
        assert handle() is x
        expected = np.arange(length) * (n * (n + 1) // 2) + n * call
        assert all_ok(comm, np.array_equal(x, expected)), (call, x[:5], expected[:5])
    y = np.full(5, r + 0.5, np.float32)
    collectives.allreduce_init(y.reshape(5, 1), comm, "avg", algorithm if algorithm != "mpi" else "ring")()
    gathered = comm.allgather(y.tobytes())
    assert all_ok(comm, len(set(gathered)) == 1 and np.allclose(y, n / 2))


@pytest.mark.parametrize("algorithm", ["auto", "shm", "ring"])
def test_a_repeated_call_sees_what_changed_in_its_array(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point knows a call that repeats the last one's objects (the same array,
    communicator and arguments) without resolving it again; whatever can change in the
    same array object between two calls still counts: its shape, its dtype, its
    writeable flag, the default of ``validate``. The array is not kept alive, and a
    freed communicator's call is not reused."""
    import gc
    import weakref

    from collectives import ArgumentError, validation

    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full(6, r + 1.0)
    for _ in range(2):
        collectives.allreduce(x, comm, "sum", algorithm)
    assert all_ok(comm, bool(np.all(x == (n * (n + 1) // 2) * n)))
    x[:] = r + 1
    x.shape = (2, 3)  # in place: the same object, now 2-D
    collectives.allreduce(x, comm, "sum", algorithm)
    assert all_ok(comm, x.shape == (2, 3) and bool(np.all(x == n * (n + 1) // 2)))

    y = np.ones(4, np.float32)
    collectives.allreduce(y, comm, "avg", algorithm)
    y.dtype = np.int32  # in place: the same bytes, now integers, which have no average
    with pytest.raises(ArgumentError, match="'avg' on integer dtype int32"):
        collectives.allreduce(y, comm, "avg", algorithm)
    y[:] = r + 1
    collectives.allreduce(y, comm, "sum", algorithm)
    y.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        collectives.allreduce(y, comm, "sum", algorithm)
    assert all_ok(comm, bool(np.all(y == n * (n + 1) // 2)))

    z = np.ones(3)
    collectives.allreduce(z, comm, "sum", "ring")
    monkeypatch.setattr(validation, "_default", True)  # put back after the test
    validation.set_default(False)

    def boom(*args, **kwargs):
        raise AssertionError("the check ran after set_default(False)")

    monkeypatch.setattr(validation, "check", boom)
    collectives.allreduce(z, comm, "sum", "ring")
    assert all_ok(comm, bool(np.all(z == n * n)))

    gone = weakref.ref(z)
    del z
    gc.collect()
    assert gone() is None

    dup = comm.Dup()
    w = np.ones(3)
    collectives.allreduce(w, dup, "sum", algorithm)
    dup.Free()
    with pytest.raises(MPI.Exception):
        collectives.allreduce(w, dup, "sum", algorithm)


def test_scratch_reused_across_calls() -> None:
    """The hot loop keeps one receive buffer per dtype, reused by later calls."""
    from collectives.transport.scratch import scratch

    comm = MPI.COMM_WORLD
    collectives.allreduce(np.ones(1000, np.float32), comm, collective="butterfly")
    first = scratch(np.empty(0, np.float32), 10)
    collectives.allreduce(np.ones(500, np.float32), comm, collective="butterfly")
    again = scratch(np.empty(0, np.float32), 10)
    assert np.shares_memory(first, again)


def test_user_messages_do_not_mix_with_collective_messages() -> None:
    """Collectives use a private communicator: a pending user message is not consumed."""
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    req = comm.isend(("user", r), dest=(r + 1) % n, tag=0x6D70)
    x = np.full(8, r, dtype=np.int64)
    collectives.allreduce(x, comm, collective="ring")
    got = comm.recv(source=(r - 1) % n, tag=0x6D70)
    req.wait()
    assert all_ok(comm, got == ("user", (r - 1) % n) and bool(np.all(x == n * (n - 1) // 2)))


def test_bytes_are_counted_by_world_rank_of_the_destination() -> None:
    """On a communicator whose ranks are the world's in reverse order, a ring all-reduce
    sends 2(p-1)/p of the vector to the right neighbour only, counted under that
    neighbour's world rank; a P-Reduce group of two sends to its partner's world rank."""
    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    reverse = world.Split(0, p - me)  # rank r of reverse is world rank p-1-r
    try:
        x = np.ones(12 * p, np.float32)
        before = p2p.bytes_by_peer()
        collectives.allreduce(x, reverse, collective="ring", validate=False)
        after = p2p.bytes_by_peer()
        sent = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        right = p - 1 - ((reverse.Get_rank() + 1) % p)  # the world rank of the ring's right neighbour
        expected = {right: 2 * (p - 1) * x.nbytes // p} if p > 1 else {}
        ok = sent == expected and p2p.world_ranks(reverse)[reverse.Get_rank()] == me
        if p >= 2 and me < 2:  # world ranks 0 and 1 as group ranks 1 and 0
            pair, y = GroupComm(reverse, [p - 2, p - 1]), np.zeros(5, np.float64)
            before = p2p.bytes_by_peer()
            if me == 0:
                p2p.send(pair, y, 0)
            else:
                p2p.recv(pair, y, 1)
            after = p2p.bytes_by_peer()
            ok &= pair.world_ranks() == (1, 0)
            ok &= after.get(1, 0) - before.get(1, 0) == (40 if me == 0 else 0)
    finally:
        reverse.Free()
    assert all_ok(world, ok), (sent, expected)
