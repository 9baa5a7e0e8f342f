"""Error feedback: the part of a compressed gradient that was not sent, carried into the next step.

A biased compressor (top-k, sign, PowerSGD) drops part of every gradient;
without a memory, some coordinates would never be updated and the bias
would not average out. Error feedback keeps, per worker, the residual e of
everything compressed so far and adds it back before the next compression:

    p = g + e            the corrected gradient
    aggregate C(p)       e.g. compressor.allreduce(p, comm, "avg", residual=e)
    e = p - C(p)         what this worker's contribution lost

A step whose corrected gradient p holds an inf or a NaN on any rank (an
overflow, which a ``GradScaler`` expects early in training and answers by
skipping the step) would make e, and through the aggregate every later step,
non-finite for good. So every rank first learns whether any rank's p is
finite (a one-element all-reduce); if one is not, the aggregate is NaN on
every rank (the scaler skips the step on all of them) and the compressor does
not run: the memories, and the compressor's own state, stay as they were,
and the next steps go on as if this one had not been taken.

Compressors that aggregate by reduce-scatter and encode the chunks of the
aggregate a second time (fp16, bf16, qsgd, sign) lose something there too:
its error is kept in a second memory s, the *server memory*, by the rank that
owns the chunk, and added to the chunk's aggregate before it is encoded again
at the next step (DoubleSqueeze; :mod:`collectives.compression.base`). So
the worker's residual holds its own encoding's error only: folded into the
owner's residual instead, n times the second error would go through the
owner's first encoding at the next step, and sign, whose scale follows the
largest values, lost the owner's gradient under it (67 % instead of 96 %
accuracy on digits). Summed over steps and workers, nothing is lost: sum_t
sum_i g_i(t) = n sum_t gbar(t) + sum_i e_i(T) + n sum_i s_i(T) for
averages, to rounding, and the sum of the applied updates trails the sum of
the gradients by the bounded memories.

The memory is per worker and per training run, so it lives here, with the
algorithm, not in the compressor (:mod:`collectives.compression` knows
nothing of training): :class:`ErrorFeedback` owns one residual buffer the
size of the gradient (same kind and dtype), and a server memory of that size
for the reduce-scatter compressors, updated in place, and
:meth:`ErrorFeedback.reset` zeroes them when the algorithm wants to forget
(a new run). Error feedback is on by default for the
compressors that need it (:attr:`Compressor.feedback`: the biased ones) and
can be switched on or off.

Reference: Seide et al., Interspeech 2014 (1-bit SGD with error
feedback); Karimireddy, Rebjock, Stich & Jaggi, ICML 2019 (EF-SGD); Stich,
Cordonnier & Jaggi, NeurIPS 2018 (memory); Zheng, Huang & Kwok, NeurIPS
2019.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ArgumentError, Compressor, FlatBuffer, as_flat, reduction
from collectives.transport import p2p
from collectives.transport.buffers import array_module
from collectives.transport.context import context


class ErrorFeedback:
    """One worker's compressed aggregation with error feedback (module docstring).

    Args:
        compressor: a :class:`~collectives.compression.Compressor` or a spec
            ("topk:0.01"; further options go to
            :func:`collectives.compression.create` through ``options``).
        like: the gradient buffer (numpy, torch, CuPy) whose shape the memory
            takes.
        enabled: keep the memory (None: the compressor's default,
            :attr:`~collectives.compression.Compressor.feedback`).
        options: compressor options when ``compressor`` is a spec.

    Attributes:
        compressor: the compressor.
        enabled: whether the memory is kept.
        residual: the memory, a zeroed buffer like ``like`` (None when disabled).
        server: the server memory, a zeroed buffer like ``like`` where the compressor
            aggregates by reduce-scatter (else None; None when disabled).
    """

    def __init__(self, compressor: Compressor | str, like: Any, *, enabled: bool | None = None, **options: Any) -> None:
        self.compressor = collectives.compressor(compressor, **options)
        self.enabled = self.compressor.feedback if enabled is None else bool(enabled)
        self.residual = zeros_like(like) if self.enabled else None
        second = self.enabled and self.compressor.aggregation in ("reduce_scatter", "hierarchical")
        self.server = zeros_like(like) if second else None
        self._flat = as_flat(self.residual) if self.residual is not None else None
        self._flag = np.zeros(1, np.int32)  # whether some rank's gradient is not finite

    def allreduce(
        self,
        buf: Any,
        comm: MPI.Comm | None = None,
        op: str = "avg",
        *,
        offset: int = 0,
        collective: str = collectives.DEFAULT_COLLECTIVE,
        validate: bool | None = False,
    ) -> Any:
        """Aggregate ``buf`` compressed, with error feedback, in place, and return it.

        With the memory on: ``buf += e``, then the compressor's
        ``allreduce(buf, comm, op, residual=e, server=s)`` (``e`` and ``s`` the
        memories' elements ``offset`` to ``offset + len(buf)``, so that buckets
        of one gradient share one memory), unless ``buf + e`` is not finite on
        some rank: then ``buf`` is set to NaN on every rank and the memories stay
        as they were (module docstring); without the memory, the compressor's
        ``allreduce`` alone. ``buf`` ends bitwise identical on all ranks. The
        arguments are checked before ``buf`` changes: a call refused with an
        ArgumentError leaves ``buf`` and the memories as they were. ``validate``
        defaults to off: a training step's arguments are the same every step.
        """
        if self._flat is None:
            return self.compressor.allreduce(buf, comm, op, collective=collective, validate=validate)
        flat = as_flat(buf)
        memory = self._slice(self.residual, offset, flat.size)
        server = None if self.server is None else self._slice(self.server, offset, flat.size)
        self.compressor.check(buf, comm, op, residual=memory, server=server, collective=collective, validate=validate)
        reduction("sum", flat.dtype, array_module(flat.data)).combine(flat.data, as_flat(memory).data)
        if self._any_rank(comm, not finite(flat)):
            _fill_nan(flat)
            return buf
        return self.compressor.allreduce(
            buf, comm, op, residual=memory, server=server, collective=collective, validate=False
        )

    def reset(self) -> None:
        """Forget the memories (zero them)."""
        for memory in (self.residual, self.server):
            if memory is not None:
                as_flat(memory).data.fill(0)

    def _any_rank(self, comm: MPI.Comm | None, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of ``comm`` (collective: a one-element
        all-reduce on the collectives' own communicator, waited for as
        :func:`collectives.transport.p2p.waitall` waits: seen by the stall inspector,
        polling on a service thread)."""
        ctx = context(MPI.COMM_WORLD if comm is None else comm)
        self._flag[0] = flag
        if ctx.size > 1:
            p2p.operation("error feedback: whether every rank's gradient is finite")
            request = ctx.comm.Iallreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
            p2p.waitall([request], ctx.comm, tuple(r for r in range(ctx.size) if r != ctx.rank))
        return bool(self._flag[0])

    def _slice(self, memory: Any, offset: int, size: int) -> Any:
        """``memory``'s elements ``offset`` to ``offset + size``, as the buffer's kind."""
        total = self._flat.size if self._flat is not None else 0
        if not 0 <= offset <= offset + size <= total:
            raise ArgumentError(
                f"error feedback: elements {offset} to {offset + size} lie outside the memory of {total}"
            )
        return memory.reshape(-1)[offset : offset + size]


def finite(flat: FlatBuffer) -> bool:
    """Whether every element of the float buffer ``flat`` is finite, in two passes that
    allocate nothing: its largest and smallest values are (NaN propagates through
    both); bfloat16, carried as its bits, by the exponent: the largest bits read as
    int16 (the positive values) stay below inf's 0x7F80, and as uint16 (the negative
    values) below -inf's 0xFF80."""
    data = flat.data
    if not flat.size:
        return True
    if flat.dtype == "bfloat16":
        return bool(data.view("int16").max() < 0x7F80 and data.max() < 0xFF80)
    xp = array_module(data)
    return bool(xp.isfinite(data.max()) and xp.isfinite(data.min()))


def _fill_nan(flat: FlatBuffer) -> None:
    """Set every element of the float buffer ``flat`` to NaN (bfloat16: its quiet NaN's bits)."""
    flat.data.fill(0x7FC0 if flat.dtype == "bfloat16" else np.nan)


def zeros_like(like: Any) -> Any:
    """A zeroed buffer of ``like``'s kind, shape and dtype."""
    if isinstance(like, np.ndarray):
        return np.zeros_like(like)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.zeros_like(like, memory_format=torch.contiguous_format)
    return array_module(as_flat(like).data).zeros_like(like)
