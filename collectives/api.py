"""The all-reduce entry point and the registry of algorithms."""

from __future__ import annotations

from typing import Any, Callable, Optional

from mpi4py import MPI

from . import butterfly, halving_doubling, reduce_broadcast, ring, validation
from .buffers import DTYPES, FlatBuffer, as_flat
from .context import context
from .errors import ArgumentError
from .ops import OPS, Reduction, reduction

#: An algorithm kernel: reduces a non-empty 1-D array in place across a
#: communicator with a Reduction (``avg`` is finished by the caller).
Kernel = Callable[[Any, MPI.Comm, Reduction], None]

#: Registered all-reduce algorithms by name.
ALGORITHMS: dict[str, Kernel] = {
    "ring": ring.allreduce,
    "halving_doubling": halving_doubling.allreduce,
    "butterfly": butterfly.allreduce,
    "reduce_broadcast": reduce_broadcast.allreduce,
}

DEFAULT_ALGORITHM = "ring"



def allreduce(buf: Any, comm: Optional[MPI.Comm] = None, op: str = "sum",
              algorithm: str = DEFAULT_ALGORITHM, *, validate: Optional[bool] = None) -> Any:
    """Reduce ``buf`` element-wise across all ranks of ``comm``, in place, and return it.

    Args:
        buf: a C-contiguous, writable numpy array or torch tensor of any
            shape, dtype one of float16, bfloat16 (torch), float32, float64,
            int32, int64. Overwritten with the reduction over all ranks;
            every rank ends with bitwise-identical contents.
        comm: the communicator (default ``MPI.COMM_WORLD``). Every rank of it
            must call with the same length, dtype, op and algorithm.
        op: one of "sum", "avg", "min", "max", "prod" ("avg" needs floats).
        algorithm: a name in :data:`ALGORITHMS`.
        validate: check arguments for agreement across ranks first (one small
            all-gather). None reads ``MPIDL_VALIDATE`` (default on).

    Returns:
        ``buf`` itself.

    Raises:
        ArgumentError: invalid or disagreeing arguments; with validation on,
            raised on every rank before any data moved (``buf`` untouched).
    """
    ctx = context(MPI.COMM_WORLD if comm is None else comm)
    flat, red, kernel, problem = _prepare(buf, op, algorithm)
    if validation.enabled(validate):
        signature = (0, 0, 0, 0, 0) if problem else (
            flat.size, DTYPES.index(flat.dtype), validation.code(op), validation.code(algorithm), 0)
        validation.check(ctx, "allreduce", problem, signature, _field_names)
    elif problem:
        raise problem
    if flat.size:
        kernel(flat.data, ctx.comm, red)
        red.finalize(flat.data, ctx.size)
    return buf


def _field_names() -> tuple[dict[int, str], ...]:
    """Readable names of the signature codes, for error messages."""
    return ({}, dict(enumerate(DTYPES)), {validation.code(op): op for op in OPS},
            {validation.code(a): a for a in ALGORITHMS})


def _prepare(buf: Any, op: str, algorithm: str) -> tuple[FlatBuffer, Reduction, Kernel, Optional[ArgumentError]]:
    """Resolve the buffer, op and algorithm; a local problem is returned, not raised."""
    try:
        flat = as_flat(buf)
        red = reduction(op, flat.dtype, _array_module(flat.data))
        kernel = ALGORITHMS.get(algorithm)
        if kernel is None:
            raise ArgumentError(f"unknown algorithm {algorithm!r}; valid algorithms: {', '.join(ALGORITHMS)}")
        return flat, red, kernel, None
    except ArgumentError as exc:
        return None, None, None, exc  # type: ignore[return-value]


def _array_module(data: Any) -> Any:
    import numpy

    if isinstance(data, numpy.ndarray):
        return numpy
    import cupy

    return cupy.get_array_module(data)
