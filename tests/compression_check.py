"""The compressed all-reduce matrix: compressor x aggregation x dtype x length.

Used by the pytest suite on communicators of 1..4 ranks and, as a script,
under a separate ``mpiexec`` for 5..8 ranks (and on the device)::

    mpiexec -n 6 python tests/compression_check.py [--device cuda]

Inputs differ per rank and every rank can rebuild every rank's input; the
float64 cases sum, the others average. For
each case every rank must end with bitwise-identical bytes; the sum is
conserved (sum_i x_i = n result + sum_i residual_i, to rounding); and the
result matches a reference built from all inputs: for the deterministic
codecs the same encodings aggregated step by step as the module docstrings
say (bit for bit on the host), for random-k the shared draw, for PowerSGD a
float64 power iteration, for QSGD the error bound of one quantisation step
(unbiasedness is tested apart, in tests/test_compression_codecs.py).

On the device it also checks that after a first step an all-reduce with a
residual allocates nothing of the buffer's size from CuPy's memory pool
(:func:`device_allocations`), as tests/test_compression_codecs.py checks on
the host with tracemalloc.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from allreduce_matrix import make_buffer, raw_bytes, to_host
from mpi4py import MPI

from collectives import compression
from collectives.compression.aggregate import chunks

#: (spec, options) of every case; "shapes" is filled in per length for powersgd, and
#: where a case sets it to True (sign's and top-k's scales and selections per layer).
CASES: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("fp16", {"aggregation": "allgather"}),
    ("qsgd:127", {}),
    ("qsgd:5", {"bucket": 7}),
    ("qsgd:127", {"aggregation": "allgather", "bucket": 16}),
    ("sign", {}),
    ("sign:24", {}),
    ("sign:5@allgather", {}),
    ("sign:4", {"shapes": True}),
    ("sign:layer", {"shapes": True}),
    ("topk:0.1", {}),
    ("topk:0.1", {"shapes": True}),
    ("topk:1", {}),
    ("randk:0.25", {}),
    ("powersgd:2", {}),
]
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: The dtypes of numpy buffers; bfloat16 buffers are torch tensors.
NUMPY_DTYPES = [dtype for dtype in DTYPES if dtype != "bfloat16"]
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def lengths_for(n: int, dtype: str) -> list[int]:
    """float32: empty, one, fewer than n, around n, odd, several buckets with a tail;
    the other dtypes (the same code but for the widening): two of them."""
    if dtype != "float32":
        return [n + 1, 1100]
    return sorted({0, 1, max(n - 1, 1), n + 1, 31, 257, 1100})


def shapes_for(length: int) -> list[tuple[int, tuple[int, ...]]]:
    """A layout of ``length``: a 6 x 10 matrix (compressed at rank 2) and a 5 x 3 x 2
    tensor when they fit, the rest a vector (sent as it is)."""
    layout: list[tuple[int, tuple[int, ...]]] = []
    at = 0
    for shape in ((6, 10), (5, 3, 2)):
        size = int(np.prod(shape))
        if at + size <= length:
            layout.append((at, shape))
            at += size
    if at < length:
        layout.append((at, (length - at,)))
    return layout


def rank_input(rank: int, length: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input: normal values (with repeats, for top-k's ties), exact in ``dtype``."""
    v = np.random.default_rng([rank, length]).standard_normal(length)
    if length:
        v[::7] = v[0]
    return to_host(make_buffer(v, dtype))


def build(spec: str, options: dict[str, Any], length: int) -> compression.Compressor:
    if spec.startswith("powersgd") or options.get("shapes"):
        options = {**options, "shapes": shapes_for(length)}
    return compression.create(spec, **options)


def check(
    comm: MPI.Comm,
    dtypes: Sequence[str] = DTYPES,
    lengths: Sequence[int] | None = None,
    cases: Sequence[tuple[str, dict[str, Any]]] = CASES,
    device: str = "cpu",
) -> list[str]:
    """Run the matrix on ``comm``; return this rank's failure messages (collective)."""
    n = comm.Get_size()
    failures: list[str] = []
    for spec, options in cases:
        for dtype in dtypes:
            for length in lengths or lengths_for(n, dtype):
                failures += _one(comm, spec, options, dtype, length, device)
    return failures


def _one(comm: MPI.Comm, spec: str, options: dict[str, Any], dtype: str, length: int, device: str) -> list[str]:
    n, rank = comm.Get_size(), comm.Get_rank()
    compressor = build(spec, options, length)
    op = "sum" if dtype == "float64" else "avg"
    case = f"{compressor} {op} {dtype} {device} n={n} len={length} {options}"
    inputs = [rank_input(i, length, dtype) for i in range(n)]
    buf = make_buffer(inputs[rank], dtype, device)
    residual = make_buffer(np.zeros(length), dtype, device)
    out = compressor.allreduce(buf, comm, op, residual=residual, collective="ring", validate=True)
    got, res = to_host(buf), to_host(residual)
    problems = [] if out is buf else [f"{case}: did not return the caller's buffer"]
    digests, residuals = zip(*comm.allgather((hashlib.sha1(raw_bytes(buf)).digest(), res)))  # one collective
    if len(set(digests)) != 1:
        problems.append(f"{case}: ranks disagree bitwise")
    scale = sum(np.abs(x) for x in inputs) + n * np.abs(got) + sum(np.abs(r) for r in residuals)
    lost = np.abs(sum(inputs) - (n if op == "avg" else 1) * got - sum(residuals))
    if np.any(lost > 8 * n * EPS[dtype] * scale):
        problems.append(f"{case}: not conserved, off by {lost.max()} (scale {scale.max()})")
    expected, tolerance = reference(compressor, options, inputs, op, dtype, device)
    if expected is not None and np.any(np.abs(got - expected) > tolerance):
        worst = int(np.argmax(np.abs(got - expected) - tolerance))
        bound = np.broadcast_to(tolerance, got.shape)[worst]
        problems.append(f"{case}: element {worst} is {got[worst]}, expected {expected[worst]} +- {bound}")
    return problems


def reference(
    compressor: compression.Compressor,
    options: dict[str, Any],
    inputs: list[np.ndarray],
    op: str,
    dtype: str,
    device: str,
) -> tuple[np.ndarray, Any]:
    """What the aggregate should be (the sum, or the mean for ``op="avg"``), and the
    tolerance (0: bit for bit)."""
    n, length = len(inputs), inputs[0].shape[0]
    work = np.float64 if dtype == "float64" else np.float32
    xs = [x.astype(work) for x in inputs]
    scale = 1 if op == "avg" else n  # the sum is n times the mean
    mean = np.mean(inputs, axis=0) * scale
    eps = EPS[dtype] + 4 * n * EPS["float64" if work == np.float64 else "float32"]  # the result's rounding
    if compressor.name == "none":
        return mean, eps * scale * np.max(np.abs(inputs), initial=0)
    if compressor.name == "qsgd":  # within a unit of each of the two quantisations
        units = np.max([_units(compressor, x) for x in inputs], axis=0)
        return mean, scale * 2 * units + eps * (np.abs(mean) + scale * 2 * units)
    fresh = build(compressor.spec, options, length)
    if compressor.name == "randk":
        out = np.zeros(length)
        if length:
            index = np.sort(np.random.default_rng([fresh.seed, 0]).choice(length, fresh.k(length), replace=False))
            out[index] = np.mean(np.abs(inputs), axis=0)[index] * scale * length / fresh.k(length)
            return np.where(out, mean * length / fresh.k(length), 0), eps * out
        return out, 0
    if compressor.name == "powersgd":
        out = _power_step(fresh, np.array(inputs)) * scale
        return out, 1e-4 * (np.max(np.abs(mean), initial=0) + scale) + eps * np.abs(out)
    if compressor.aggregation == "allgather":
        out = _aggregated(fresh, xs, op)
    else:
        elems, _ = chunks(fresh, length, n, np.dtype(work))
        out = np.zeros(length, work)
        for lo, hi in zip(elems, elems[1:]):
            piece = fresh.piece(lo, hi)  # sign with a layout: the chunk's own scales per layer
            part = _aggregated(piece, [x[lo:hi] for x in xs], op)
            out[lo:hi] = part if n == 1 else piece.decompress(piece.compress(part), np.empty_like(part))
    exact = to_host(make_buffer(out.astype(np.float64), dtype))
    return exact, (0 if device == "cpu" else 8 * eps * np.abs(exact))


def _aggregated(compressor: compression.Compressor, xs: list[np.ndarray], op: str) -> np.ndarray:
    """The sum (avg: mean) of the decoded encodings of ``xs``, summed in order."""
    out = np.empty_like(xs[0])
    for i, x in enumerate(xs):
        compressor.decompress(compressor.compress(x), out, add=i > 0)
    if len(xs) > 1 and op == "avg":
        np.divide(out, len(xs), out=out)
    return out


def _units(compressor: Any, x: np.ndarray) -> np.ndarray:
    """QSGD's quantisation unit ||bucket|| / s of every element of ``x``."""
    b = compressor.bucket
    norms = [np.linalg.norm(x[i : i + b]) / compressor.levels for i in range(0, x.shape[0], b)]
    return np.repeat(norms, b)[: x.shape[0]] if norms else np.zeros(0)


def _power_step(compressor: Any, inputs: np.ndarray) -> np.ndarray:
    """PowerSGD's first step in float64 from the same starting Q: the mean projected onto span(P)."""
    out = inputs.mean(axis=0)
    q = np.random.default_rng(compressor.seed).standard_normal(
        sum(c * compressor.rank for _, _, c in compressor.layers)
    )
    at = 0
    for offset, rows, cols in compressor.layers:
        m = out[offset : offset + rows * cols].reshape(rows, cols)
        p = np.linalg.qr(m @ q[at : at + cols * compressor.rank].reshape(cols, -1))[0]
        m[:] = p @ (p.T @ m)
        at += cols * compressor.rank
    return out


#: Compressors that allocate buffer-sized device memory per step, and why (measured on an
#: H100 with CuPy 14, 2026-11-25); :func:`device_allocations` reports them apart.
DEVICE_ALLOCATES = {
    "topk": "where the sampled threshold misses, CuPy's partition sorts a copy of the magnitudes",
    "powersgd": "cuSOLVER's QR takes a workspace per call",
}


def device_allocations(comm: MPI.Comm, length: int = 400_000) -> tuple[list[str], list[str]]:
    """(failures, known): for every case of :data:`CASES`, the device allocations of at
    least the buffer's bytes that a second compressed all-reduce (float32, with a
    residual) asks CuPy's memory pool for (a first call may allocate its payloads and
    scratch; smaller ones, O(k) indices or per-bucket scales, are allowed as on the
    host); those of :data:`DEVICE_ALLOCATES` go to ``known``."""
    import cupy

    pool = cupy.get_default_memory_pool()
    failures: list[str] = []
    known: list[str] = []
    for spec, options in CASES:
        compressor = build(spec, options, length)
        buf = make_buffer(np.random.default_rng(comm.Get_rank()).standard_normal(length), "float32", "cuda")
        residual = cupy.zeros(length, dtype=cupy.float32)
        seen: list[int] = []

        def watched(nbytes: int, seen: list[int] = seen) -> Any:
            seen.append(nbytes)
            return pool.malloc(nbytes)

        for step in range(2):
            if step:
                cupy.cuda.set_allocator(watched)
            try:
                compressor.allreduce(buf, comm, "avg", residual=residual, validate=False)
            finally:
                cupy.cuda.set_allocator(pool.malloc)
        large = [n for n in seen if n >= 4 * length]
        if large:
            found = f"{compressor}: a second step allocated {len(large)} device buffers of {sorted(set(large))} B"
            why = DEVICE_ALLOCATES.get(compressor.name)
            (known if why else failures).append(f"{found} ({why})" if why else found)
    return failures, known


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--lengths", help="comma-separated (default: lengths_for)")
    parser.add_argument("--specs", help="comma-separated specs of CASES to run (default: all)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    lengths = [int(v) for v in args.lengths.split(",")] if args.lengths else None
    cases = [case for case in CASES if not args.specs or case[0] in args.specs.split(",")]
    failures = check(comm, args.dtypes.split(","), lengths, cases, args.device)
    known: list[str] = []
    if args.device == "cuda":
        allocating, known = device_allocations(comm)
        failures += allocating
    everyone = [f"rank {r}: {f}" for r, fs in enumerate(comm.gather(failures) or []) for f in fs]
    if comm.Get_rank() == 0:
        for k in known:
            print(f"known: {k}")
        print("\n".join(everyone[:50]) or f"compression matrix passed on {comm.Get_size()} ranks ({args.device})")
    return int(bool(comm.bcast(everyone)))


if __name__ == "__main__":
    sys.exit(main())
