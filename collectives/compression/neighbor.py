"""Compressed gossip: send C(delta) to the out-neighbors, add the decoded payloads of the in-neighbors.

What compressed decentralized averaging needs from the library. CHOCO-SGD
(Koloskova, Stich & Jaggi, "Decentralized Stochastic Optimization and Gossip
Algorithms with Compressed Communication", ICML 2019) keeps, on worker i, a
public copy x^_i of its model, which its neighbors rebuild from the same
payloads, and (the memory-efficient form) s_i = sum_j w_ij x^_j over its
in-neighbors and itself. One gossip step, after the local SGD step on x_i:

    q_i = C(x_i - x^_i)                        the change of the public copy
    x^_i += q_i;  s_i += w_ii q_i + sum_j w_ij q_j  (:func:`neighbor_exchange`)
    x_i += gamma (s_i - x^_i)                  the consensus step (gamma <= 1)

Since x^_j is built on every holder from the same q_j, the copies agree
without ever being sent; with C the identity and gamma = 1 this is D-PSGD's
x_i <- sum_j w_ij x_j. The algorithm owns x^_i, s_i and gamma; an unbiased
or biased compressor both work (CHOCO needs no error feedback: x - x^ plays
its part), and stateful ones work too: random-k draws the same indices on
every rank at the same step, PowerSGD's payload carries its factors.

Phases of :func:`neighbor_exchange` (rank i, d_out out-neighbors, d_in
in-neighbors, payload P bytes for d elements):

1. encode ``delta`` once (``compressor.compress``);
2. post a receive of P bytes from every in-neighbor and a send of the
   payload to every out-neighbor, all in flight together; wait for all;
3. decode this rank's payload: ``public += q_i``; then, in a fixed order,
   ``mixed += w_ii q_i``, and ``mixed += w_ij q_j`` for the in-neighbors in
   ascending rank order (half-precision buffers are accumulated in float32
   and rounded once).

Cost: alpha + d_out P beta + (d_in + 1) d gamma_decode; payload sent
d_out P bytes (``payload_nbytes`` of the compressor), against d_out m for
uncompressed neighbor averaging. The graph and arguments are checked as
:func:`collectives.neighbor_allreduce` checks them (``validate=``), and every
rank must use the same compressor spec.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import validation
from ..errors import ArgumentError
from ..partial.neighbor import NeighborWeights, _check, _prepare
from ..transport import gpu, p2p
from ..transport.buffers import FlatBuffer, array_module
from ..transport.context import context
from ..transport.ops import narrow, widen
from ..transport.p2p import irecv, isend, waitall
from ..transport.scratch import scratch
from .base import HALF, Compressor, float_buffer, work_dtype
from .memory import ACCUMULATOR, DECODED, EXTRA, RECEIVED


def neighbor_exchange(
    compressor: Compressor,
    delta: Any,
    weights: NeighborWeights,
    comm: MPI.Comm | None = None,
    *,
    public: Any,
    mixed: Any,
    validate: bool | None = None,
) -> None:
    """Send ``compressor``'s payload of ``delta`` to ``weights.destinations``, then set
    ``public += C(delta)`` and ``mixed += w_ii C(delta) + sum_j w_ij C_j(delta_j)``
    over ``weights.sources`` (module docstring).

    Args:
        compressor: the same spec on every rank.
        delta: the float buffer to compress (e.g. x_i - x^_i); only read.
        weights: this rank's row of the mixing matrix (its self weight included).
        comm: the communicator (default ``MPI.COMM_WORLD``); every rank calls.
        public, mixed: float buffers of ``delta``'s length, kind and dtype, updated
            in place (x^_i and s_i).
        validate: check the graph and arguments across ranks first (None: the
            default, on unless ``MPIDL_VALIDATE=0``).

    Raises:
        ArgumentError: bad or inconsistent arguments; with validation on, on
            every rank before any data moved.
    """
    ctx = context(MPI.COMM_WORLD if comm is None else comm)
    p2p.operation(f"neighbor_exchange ({compressor.spec})")
    flat, problem = _prepare(delta, weights, ctx.size, ctx.rank)
    targets: list[FlatBuffer] = []
    nbytes = 0
    if problem is None:
        try:
            flat = float_buffer(delta, "neighbor_exchange")
            targets = [_like(flat, buf, what) for buf, what in ((public, "public"), (mixed, "mixed"))]
            nbytes = compressor.payload_nbytes(flat.size, flat.dtype)
        except ArgumentError as exc:
            problem = exc
    if validation.enabled(validate):
        _check(ctx, weights, flat, problem)
        agreed = (nbytes, 0, 0, validation.code(compressor.spec), 0)
        validation.check(ctx, "neighbor_exchange", None, agreed, lambda: ({}, {}, {}, {agreed[3]: compressor.spec}))
    elif problem is not None:
        raise problem
    if type(flat.data) is not np.ndarray:
        gpu.ensure(ctx.comm, flat)
    if flat.size:
        _exchange(compressor, flat, weights, ctx.comm, *targets)


def _like(flat: FlatBuffer, buf: Any, what: str) -> FlatBuffer:
    """``buf`` resolved, if it matches ``flat`` in length, dtype and kind; else ArgumentError."""
    target = float_buffer(buf, f"neighbor_exchange's {what}")
    if (target.size, target.dtype, type(target.data)) != (flat.size, flat.dtype, type(flat.data)):
        raise ArgumentError(
            f"neighbor_exchange's {what} ({target.size} {target.dtype}) must match delta ({flat.size} {flat.dtype})"
        )
    return target


def _exchange(
    compressor: Compressor,
    flat: FlatBuffer,
    weights: NeighborWeights,
    comm: MPI.Comm,
    public: FlatBuffer,
    mixed: FlatBuffer,
) -> None:
    """Send, receive and decode (module docstring)."""
    payload = compressor.compress(flat.owner)
    size = payload.shape[0]
    received = scratch(payload, size * len(weights.sources), RECEIVED)
    slots = [received[k * size : (k + 1) * size] for k in range(len(weights.sources))]
    pending = [irecv(comm, slot, j) for slot, (j, _) in zip(slots, weights.sources)]
    pending += [isend(comm, payload, j) for j in weights.destinations]
    waitall(pending, comm, tuple(sorted({j for j, _ in weights.sources} | set(weights.destinations))))
    n, half = flat.size, flat.dtype in HALF
    xp = array_module(flat.data)
    term = scratch(flat.data, n, DECODED, work_dtype(flat.dtype))
    compressor._decode(payload, term)
    own, acc = public.data, mixed.data
    if half:
        own, acc = scratch(term, n, EXTRA), scratch(term, n, ACCUMULATOR)
        widen(public.data, own, flat.dtype)
        widen(mixed.data, acc, flat.dtype)
    xp.add(own, term, out=own)
    for w, part in [(weights.self_weight, None), *((w, slot) for slot, (_, w) in zip(slots, weights.sources))]:
        if part is not None:
            compressor._decode(part, term)
        xp.multiply(term, w, out=term)
        xp.add(acc, term, out=acc)
    if half:
        narrow(own, public.data, flat.dtype)
        narrow(acc, mixed.data, flat.dtype)
