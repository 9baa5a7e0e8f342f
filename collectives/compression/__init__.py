"""Compression: gradient and model compressors and the aggregation each needs.

``create("qsgd:127")`` builds a compressor from its spec "NAME[:PARAM]";
:data:`COMPRESSORS` names them, one module each. Every compressor has the
interface of :class:`~.base.Compressor`: ``compress``, ``decompress``,
``payload_nbytes`` and ``allreduce(buf, comm, op, residual=...)``, which
leaves ``buf`` the aggregated (decoded, summed or averaged) value, bitwise
identical on all ranks; :func:`neighbor_exchange` gossips compressed
payloads with graph neighbors (CHOCO-SGD). Compressors know nothing of
training: error-feedback memory lives with the algorithm
(:mod:`algorithms.error_feedback`).

Bytes each rank sends per step, against the ring all-reduce of the float32
vector (2 (n-1)/n 4 d bytes), with the default aggregation:

============== ============== ======== ===== ========================== =========== ===============
spec           sent per elem. unbiased EF    aggregation                vs ring     at n = 4
============== ============== ======== ===== ========================== =========== ===============
``none``       4 B            yes      no    all-reduce                 1           1
``fp16``       2 B            (round)  no    reduce-scatter, f32 sums   1/2         0.50
``bf16``       2 B            (round)  no    reduce-scatter, f32 sums   1/2         0.50
``qsgd:127``   1 B + 4/512    yes      no    reduce-scatter, re-encode  0.252       0.252
``sign``       1/8 B + 4/512  no       yes   reduce-scatter, re-encode  0.033       0.033
``sign:layer`` 1/8 B + 4/layer no       yes   reduce-scatter, re-encode  0.031       0.031
``topk:0.01``  4 x 0.01 B     no       yes   all-gather                 n 0.005     0.020
``randk:0.01`` 4 x 0.01 B     yes      no    all-reduce of k values     0.01        0.01
``powersgd:4`` 4 (r+c) B/mat. no       yes   2 all-reduces (P, Q)       4(r+c)/rc   1/256 (2048^2)
============== ============== ======== ===== ========================== =========== ===============

"vs ring" holds for every n where the aggregation is an all-reduce or a
reduce-scatter (2 (n-1)/n P bytes); an all-gather sends (n-1) P bytes,
n P / (2 x 4 d) of the ring's, growing with n (``qsgd`` and ``sign`` can
all-gather too: ``aggregation="allgather"``, 0.50 and 0.066 at n = 4).
The transport counts every byte (:func:`collectives.transport.p2p.bytes_sent`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ArgumentError
from .base import OPS, Compressor
from .cast import BFloat16, Float16
from .identity import Identity
from .neighbor import neighbor_exchange
from .powersgd import PowerSGD
from .qsgd import QSGD
from .randk import RandomK
from .sign import Sign
from .topk import TopK

#: Compressors by name: the NAME of a spec "NAME[:PARAM]".
COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (Identity, Float16, BFloat16, QSGD, Sign, TopK, RandomK, PowerSGD)
}


def create(spec: str | Compressor, **options: Any) -> Compressor:
    """The compressor a spec "NAME[:PARAM][@AGGREGATION]" names, e.g. "fp16", "qsgd:127",
    "topk:0.01", "powersgd:4", "sign@allgather" (a :class:`Compressor` is returned as it is).

    Args:
        spec: NAME in :data:`COMPRESSORS`, PARAM its parameter (default if left out),
            AGGREGATION one of the class's ``aggregations`` (default: the first).
        options: the class's keyword arguments: ``aggregation`` (the spec's, if it
            has one), ``seed``; ``bucket`` (qsgd, sign); ``shapes`` (powersgd, required; sign and
            topk: scales and selections per layer).

    Raises:
        ArgumentError: unknown name, bad parameter, aggregation or option.
    """
    if isinstance(spec, Compressor):
        return spec
    text, at, aggregation = str(spec).partition("@")
    if at:
        chosen = aggregation.strip().lower()
        if options.get("aggregation", chosen) != chosen:
            raise ArgumentError(f"compressor {spec!r}: the option aggregation={options['aggregation']!r} disagrees")
        options = {**options, "aggregation": chosen}
    name, colon, param = text.partition(":")
    cls = COMPRESSORS.get(name.strip().lower())
    if cls is None:
        raise ArgumentError(f"unknown compressor {name!r}; valid compressors: {', '.join(COMPRESSORS)}")
    try:
        return cls.from_param(param.strip() if colon else None, **options)
    except TypeError as exc:  # an option the class does not take
        raise ArgumentError(f"compressor {spec!r}: {exc}") from None


__all__ = [
    "COMPRESSORS",
    "OPS",
    "QSGD",
    "BFloat16",
    "Compressor",
    "Float16",
    "Identity",
    "PowerSGD",
    "RandomK",
    "Sign",
    "TopK",
    "create",
    "neighbor_exchange",
]
