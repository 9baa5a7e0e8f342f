"""All-gather of arrays whose first dimension differs between ranks.

:func:`allgather` concatenates every rank's array along the first dimension,
in rank order, into a new array of the same kind on every rank, as Horovod's
``allgather`` does (MPI's ``MPI_Allgatherv``).

Phases (p ranks, rank r contributing n_r bytes of N in all):

1. the description of every rank's array (dtype, memory, shape, or its local
   problem) reaches every rank (``MPI_Allgather`` of a small pickled tuple);
   every rank checks them alike and raises the same
   :class:`~collectives.errors.ArgumentError` where the dtypes, the memory
   (host or device) or the dimensions after the first disagree, or some rank's
   array is refused, before any data moved;
2. a ring all-gather of the blocks, each of its owner's size
   (:func:`collectives.kernels.ring.allgather` with those bounds): p-1 steps,
   each rank receiving every other block once.

Cost: (p-1) alpha + (N - n_r) beta, plus the description's exchange, on every
call (the sizes are needed anyway, so the check costs no extra message).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import ArgumentError
from .kernels.ring import allgather as ring_allgather
from .transport import gpu, p2p
from .transport.buffers import DTYPES, NUMPY_DTYPES, as_flat
from .transport.context import context

_WORLD = MPI.COMM_WORLD


def allgather(buf: Any, comm: MPI.Comm | None = None) -> Any:
    """Every rank's ``buf`` concatenated along the first dimension, in rank order: a new
    array of ``buf``'s kind (numpy array, torch tensor on ``buf``'s device, CuPy
    array), dtype and later dimensions, on every rank of ``comm``. ``buf`` is only read.

    Args:
        buf: a numpy array, torch tensor or CuPy array of at least one dimension,
            dtype one of :data:`~collectives.transport.buffers.DTYPES`; any
            layout (read-only or strided too). The first dimension may differ
            between ranks, the dtype, the memory (host or device) and the other
            dimensions must not.
        comm: the communicator (default ``MPI.COMM_WORLD``).

    Raises:
        ArgumentError: on every rank, before any data moved, where some rank's
            ``buf`` is refused (type, dtype, no dimension) or the ranks disagree
            on the dtype, the memory or the dimensions after the first; naming
            the ranks and their values.
    """
    ctx = context(_WORLD if comm is None else comm)
    p2p.operation("allgather")
    mine: tuple[str | None, str, tuple[int, ...]]
    try:
        mine = (None, _describe(buf), tuple(int(d) for d in buf.shape))
    except ArgumentError as problem:
        mine = (str(problem), "", ())
    with p2p.waiting(ctx.comm):
        rows = ctx.comm.allgather(mine)
    _check(rows)
    shapes = [shape for _, _, shape in rows]
    out = _empty(buf, (sum(s[0] for s in shapes), *shapes[0][1:]))
    per_row = int(np.prod(shapes[0][1:], dtype=np.int64))
    bounds = tuple(int(b) for b in np.cumsum([0] + [s[0] * per_row for s in shapes]))
    first = sum(s[0] for s in shapes[: ctx.rank])
    _copy(out[first : first + shapes[ctx.rank][0]], buf)
    flat = as_flat(out)
    if bounds[-1]:
        if type(flat.data) is not np.ndarray:
            gpu.ensure(ctx.comm, flat)
        ring_allgather(flat.data, ctx.comm, bounds)
    return out


def _describe(buf: Any) -> str:
    """``buf``'s dtype and memory ("float32", "float32 (device)"), for the ranks to compare.

    Raises:
        ArgumentError: an unsupported type or dtype, or no dimension.
    """
    torch = sys.modules.get("torch")
    if isinstance(buf, np.ndarray) or type(buf).__module__.startswith("cupy"):
        name, device, names = buf.dtype.name, not isinstance(buf, np.ndarray), NUMPY_DTYPES
    elif torch is not None and isinstance(buf, torch.Tensor) and buf.device.type in ("cpu", "cuda"):
        name, device, names = str(buf.dtype).removeprefix("torch."), buf.device.type == "cuda", DTYPES
    else:
        raise ArgumentError(
            f"allgather: unsupported buffer {type(buf).__module__}.{type(buf).__qualname__}; "
            "expected a numpy.ndarray, a torch.Tensor (CPU or CUDA) or a CuPy array"
        )
    what = f"allgather's buffer (dtype {name}, shape {tuple(buf.shape)})"
    if name not in names:
        raise ArgumentError(f"unsupported dtype {name} of {what}; supported: {', '.join(names)}")
    if not len(buf.shape):
        raise ArgumentError(f"{what} has no dimension to concatenate along; give it one (e.g. x.reshape(1))")
    return name + (" (device)" if device else "")


def _check(rows: list[tuple[str | None, str, tuple[int, ...]]]) -> None:
    """Raise the same ArgumentError on every rank unless every rank's array was accepted
    and all agree on the dtype, the memory and the dimensions after the first."""
    bad = [r for r, (problem, _, _) in enumerate(rows) if problem is not None]
    if bad:
        by_problem: dict[str, list[int]] = {}
        for r in bad:
            by_problem.setdefault(str(rows[r][0]), []).append(r)
        detail = "; ".join(f"rank(s) {ranks}: {problem}" for problem, ranks in by_problem.items())
        raise ArgumentError(f"allgather: invalid arguments on {detail} (no data moved)", bad)
    fields: tuple[tuple[str, list[Any]], ...] = (
        ("dtype", [kind for _, kind, _ in rows]),
        ("shape after the first dimension", [shape[1:] for _, _, shape in rows]),
    )
    diffs, odd = [], set()
    for name, values in fields:
        if any(v != values[0] for v in values):
            common = max(values, key=values.count)
            odd |= {r for r, v in enumerate(values) if v != common}
            diffs.append(f"{name} differs across ranks ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))})")
    if diffs:
        raise ArgumentError(f"allgather: ranks disagree: {'; '.join(diffs)} (no data moved)", sorted(odd))


def _empty(like: Any, shape: tuple[int, ...]) -> Any:
    """A new uninitialised array of ``like``'s kind, dtype and device, of ``shape``."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, like.dtype.newbyteorder("="))
    if hasattr(like, "new_empty"):  # a torch tensor
        return like.new_empty(shape, requires_grad=False)
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.empty(shape, like.dtype)


def _copy(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` (same kind and shape), without autograd."""
    dst[...] = src.detach() if hasattr(src, "detach") else src
