"""The all-reduce correctness matrix: algorithm x op x dtype x length.

Used by the pytest suite on communicators of 1..4 ranks and, as a script, under
a separate ``mpiexec`` for 5..8 ranks::

    mpiexec -n 6 python tests/allreduce_matrix.py [--collectives ring,butterfly]

Inputs differ per rank (identical inputs hide bugs) and are a function of the
rank, so every rank computes every rank's input, and the references, itself:
the only collective a case runs is the all-reduce under test (the cases' bytes
are compared across ranks once, at the end, by digest). Integer results must
equal the exact result; float results equal a float64 reference within the
dtype's rounding; every rank must end with bitwise-identical bytes. "mpi" (the
MPI library's own all-reduce) must refuse float16 and bfloat16, and min and
max on floats, on every rank, naming them, with the buffer untouched.

The suite runs the full product on 1..4 ranks. The script's ``--design pairs``
(its runs on 5..8 ranks) keeps every algorithm x length and takes op, dtype and
length in an all-pairs design: every op-dtype, op-length and dtype-length pair
at least once (some 50 cases per algorithm instead of 224); what the rank
count changes, the split of each length among the ranks, is still tried for
every algorithm and length.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Iterable, Sequence

import numpy as np
from mpi4py import MPI

import collectives
from collectives.kernels import native

INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-14}
REDUCE = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max, "prod": np.prod}


def lengths_for(n: int) -> list[int]:
    """Lengths worth testing on n ranks: empty, one, fewer than n, around n, odd, larger."""
    return sorted({0, 1, max(n - 1, 1), n, n + 1, 2 * n + 3, 31, 257})


def rank_input(rank: int, length: int, op: str) -> np.ndarray:
    """float64 values, exact in every tested dtype, that differ per rank."""
    i = np.arange(length)
    v = ((i * 7 + rank * 13 + 5) % 9) - 4.0
    if op == "prod":  # keep products exact in float16 and in range for int32
        v = np.where(v == 0, 1.0, np.sign(v) * (1 + (np.abs(v) > 2)))
    elif op in ("min", "max"):
        v = v + 0.25 * rank
    return v


def make_buffer(values: np.ndarray, dtype: str, device: str = "cpu"):
    """A buffer of ``dtype`` holding ``values``: numpy (CuPy on "cuda"), or a torch
    tensor for bfloat16; on "cuda" every fourth float32 case is a CUDA tensor."""
    if dtype == "bfloat16" or (device == "cuda" and dtype == "float32" and len(values) % 4 == 1):
        import torch

        t = torch.from_numpy(values.astype(np.float32)).to(getattr(torch, dtype))
        return t.to(device) if device == "cuda" else t
    if device == "cuda":
        import cupy

        return cupy.asarray(values.astype(dtype))
    return values.astype(dtype)


def to_host(buf) -> np.ndarray:
    """The buffer's values as a float64 numpy array."""
    if isinstance(buf, np.ndarray):
        return buf.astype(np.float64)
    if type(buf).__module__.startswith("cupy"):
        return buf.get().astype(np.float64)
    return buf.float().cpu().numpy().astype(np.float64)


def raw_bytes(buf) -> bytes:
    data = collectives.as_flat(buf).data
    return (data if isinstance(data, np.ndarray) else data.get()).tobytes()


def available_dtypes() -> list[str]:
    """Every supported dtype; bfloat16 only where torch is installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return [d for d in collectives.DTYPES if d != "bfloat16"]
    return list(collectives.DTYPES)


def product(dtypes: Iterable[str], ops: Iterable[str], lengths: Iterable[int]) -> list[tuple[str, str, int]]:
    """Every valid (dtype, op, length): avg is not an integer op."""
    return [
        (dtype, op, length)
        for dtype in dtypes
        for op in ops
        if not (op == "avg" and dtype in INT_DTYPES)
        for length in lengths
    ]


def all_pairs(dtypes: Iterable[str], ops: Iterable[str], lengths: Iterable[int]) -> list[tuple[str, str, int]]:
    """A subset of :func:`product` that holds every valid dtype-op, dtype-length and
    op-length pair at least once (greedy: the case that covers the most pairs not yet
    covered, first in the product's order on ties; deterministic)."""
    cases = product(dtypes, ops, lengths)
    uncovered = set().union(*map(_pairs, cases)) if cases else set()
    chosen = []
    while uncovered:
        best = max(cases, key=lambda case: len(_pairs(case) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def _pairs(case: tuple[str, str, int]) -> set[tuple[str, object, object]]:
    """The dtype-op, dtype-length and op-length pairs of a case."""
    dtype, op, length = case
    return {("dtype-op", dtype, op), ("dtype-length", dtype, length), ("op-length", op, length)}


def check(
    comm: MPI.Comm,
    algorithms: Iterable[str],
    dtypes: Iterable[str],
    ops: Iterable[str] = collectives.OPS,
    lengths: Sequence[int] | None = None,
    device: str = "cpu",
    design: str = "full",
    **options,
) -> list[str]:
    """Run the matrix on ``comm``; return this rank's failure messages (collective).

    ``device`` "cuda" uses CuPy arrays and CUDA tensors; ``design`` "full" runs every
    dtype x op x length, "pairs" :func:`all_pairs` of them; ``options`` (layout=,
    grid=) are passed to every all-reduce.
    """
    failures: list[str] = []
    results: list[tuple[str, bytes]] = []  # (case, digest of the result's bytes)
    n, rank = comm.Get_size(), comm.Get_rank()
    cases = (all_pairs if design == "pairs" else product)(dtypes, ops, lengths or lengths_for(n))
    for algorithm in algorithms:
        for dtype, op, length in cases:
            failures += _one(comm, algorithm, dtype, op, length, n, rank, device, options, results)
    digests = comm.allgather([digest for _, digest in results])
    failures += [
        f"{case}: ranks disagree bitwise" for i, (case, _) in enumerate(results) if len({d[i] for d in digests}) > 1
    ]
    return failures


def _one(
    comm: MPI.Comm,
    algorithm: str,
    dtype: str,
    op: str,
    length: int,
    n: int,
    rank: int,
    device: str,
    options: dict,
    results: list[tuple[str, bytes]],
) -> list[str]:
    """One case; appends (case, digest of the result) to ``results``; returns its failures."""
    case = f"{algorithm} {op} {dtype} {device} n={n} len={length} {options or ''}"
    mine = rank_input(rank, length, op)
    buf = make_buffer(mine, dtype, device)
    if algorithm == "mpi" and native.unsupported(dtype, op):  # refused on every rank, the buffer untouched
        before = raw_bytes(buf)
        try:
            collectives.allreduce(buf, comm, op=op, collective=algorithm, **options)
        except collectives.ArgumentError as exc:
            return [] if raw_bytes(buf) == before and dtype in str(exc) else [f"{case}: {exc}"]
        return [f"{case}: reduced what MPI cannot reduce as the other algorithms do"]
    out = collectives.allreduce(buf, comm, op=op, collective=algorithm, **options)
    got = to_host(buf)
    results.append((case, hashlib.sha1(raw_bytes(buf)).digest()))
    problems = [] if out is buf else [f"{case}: did not return the caller's buffer"]
    everyone = np.array([rank_input(r, length, op) for r in range(n)]).reshape(n, length)
    if dtype in INT_DTYPES:  # exact: the inputs and every partial result are small integers
        ref = REDUCE[op](everyone.astype(dtype), axis=0)
        if not np.array_equal(got, ref):
            problems.append(f"{case}: {got.tolist()} != {ref.tolist()}")
    else:
        ref = REDUCE[op](everyone, axis=0)
        if not np.allclose(got, ref, rtol=RTOL[dtype], atol=RTOL[dtype]):
            problems.append(f"{case}: {got.tolist()} != reference {ref.tolist()}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", default=",".join(collectives.COLLECTIVES))
    parser.add_argument("--layout", help="ranks per node override, e.g. 2 or 3,1")
    parser.add_argument("--grid", help="X,Y for torus2d")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shm-piece", type=int, help="shm: pieces of this many bytes, always sliced")
    parser.add_argument(
        "--design", choices=["full", "pairs"], default="full", help="every dtype x op x length, or all pairs of them"
    )
    parser.add_argument(
        "--sizes",
        help="run on the first K ranks for each K of this comma list, in turn (one launch, one import "
        "of torch, for several sizes; default: every rank)",
    )
    args = parser.parse_args(argv)
    if args.shm_piece:
        collectives.kernels.shm.SEGMENT, collectives.kernels.shm.REPLICATE = args.shm_piece, 0
    world = MPI.COMM_WORLD
    options = {
        k: v
        for k, v in (("layout", args.layout), ("grid", tuple(map(int, args.grid.split(","))) if args.grid else None))
        if v
    }
    dtypes, failed = available_dtypes(), False
    for size in map(int, args.sizes.split(",")) if args.sizes else [world.Get_size()]:
        comm = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
        everyone: list[str] = []  # every rank's failures, on rank 0 of comm (world's rank 0)
        if comm != MPI.COMM_NULL:
            failures = check(
                comm, args.collectives.split(","), dtypes, device=args.device, design=args.design, **options
            )
            everyone = [f"rank {r}: {f}" for r, fs in enumerate(comm.gather(failures) or []) for f in fs]
            if comm.Get_rank() == 0:
                passed = f"all-reduce matrix ({args.design}) passed on {size} ranks ({args.device})"
                print("\n".join(everyone[:50]) or passed, flush=True)
            comm.Free()
        request = world.Ibarrier()  # the ranks left out wait without spinning on a core
        while not request.Test():
            time.sleep(0.01)
        failed |= bool(world.bcast(bool(everyone)))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
