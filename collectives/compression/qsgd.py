"""``qsgd:s``: stochastic quantisation to s levels per sign, one norm per bucket (unbiased).

For each bucket v of b elements (default 512) with Euclidean norm ||v||, each
element is sent as a signed level

    q_i = sign(v_i) * l_i,  l_i = floor(s |v_i| / ||v|| + u_i),  u_i ~ U[0, 1),

so l_i is s |v_i| / ||v|| rounded up with probability equal to its
fractional part, else down: E[q_i] = s v_i / ||v||, and the decoded value
(||v|| / s) q_i is an unbiased estimate of v_i, with variance
(||v|| / s)^2 p (1 - p) per element (p the fractional part), at most
min(b / s^2, sqrt(b) / s) ||v||^2 per bucket.

What is sent, per chunk of L elements: the bucket units ||v|| / s (one work
precision float per bucket, 4 bytes for float32), then the levels as int8
(s <= 127: sign and level in one byte), padded to 8 bytes: 1 + 4/b bytes per
element (1.008 for b = 512), about a quarter of float32. Nothing smaller
than a byte per element: s <= 7 could pack two levels a byte, and QSGD's
Elias coding of the many small levels would be shorter still, at the price
of variable-length payloads.

Aggregation: ``reduce_scatter`` by default (:mod:`.aggregate`): 2 (n-1)/n P
bytes per rank, 0.252 of the float32 ring all-reduce's for every n; the
chunk owner quantises the sum a second time, with its own random numbers,
so the aggregate stays unbiased. ``allgather``: (n-1) P bytes per rank,
n x 0.126 of the ring all-reduce's (0.50 at n = 4, 1.0 at n = 8), the exact
sum of every rank's quantised vector.

Reference: Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD:
Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS
2017 (buckets of 512 in its experiments).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..transport.buffers import array_module
from ..transport.scratch import scratch
from .base import Compressor, bucket_rows, bucket_views, round8
from .memory import CODEC


class QSGD(Compressor):
    """Stochastic quantisation to ``levels`` levels (module docstring).

    Args:
        levels: s, 1 to 127.
        bucket: elements per norm (default 512).
        aggregation, seed: see :class:`~collectives.compression.base.Compressor`.
    """

    name = "qsgd"
    param = ("levels", int)
    unbiased = True
    aggregations = ("reduce_scatter", "allgather", "hierarchical")

    def __init__(self, levels: int = 127, *, bucket: int = 512, **options: Any) -> None:
        super().__init__(**options)
        if not 1 <= levels <= 127:
            raise ArgumentError(f"qsgd:{levels}: the levels must be 1 to 127 (sign and level fit one byte)")
        if bucket < 1:
            raise ArgumentError(f"qsgd: the bucket must be at least 1 element, got {bucket}")
        self.levels, self.bucket = int(levels), int(bucket)
        self.spec = f"qsgd:{self.levels}"

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return round8(-(-length // self.bucket) * dtype.itemsize + length)

    def _fields(self, payload: Any, length: int, dtype: np.dtype) -> tuple[Any, Any]:
        """The payload's bucket units and levels."""
        head = -(-length // self.bucket) * dtype.itemsize
        return payload[:head].view(dtype), payload[head : head + length].view(np.int8)

    def _encode(self, x: Any, out: Any) -> None:
        xp, n, s = array_module(x), x.shape[0], self.levels
        units, levels = self._fields(out, n, x.dtype)
        scaled = scratch(x, n, CODEC)
        views = bucket_views(scaled, self.bucket)
        xp.multiply(x, x, out=scaled)
        for v, unit in zip(views, bucket_rows(views, units)):
            xp.sum(v, axis=1, out=unit[:, 0])
        xp.sqrt(units, out=units)
        xp.divide(units, s, out=units)  # ||v|| / s
        inverse = scratch(x, units.shape[0], CODEC + 1)
        xp.maximum(units, np.finfo(x.dtype).tiny, out=inverse)  # an all-zero bucket encodes as zeros
        xp.reciprocal(inverse, out=inverse)
        xp.abs(x, out=scaled)
        for v, inv in zip(views, bucket_rows(views, inverse)):
            xp.multiply(v, inv, out=v)  # s |v_i| / ||v||, in [0, s]
        noise = scratch(x, n, CODEC + 2)
        self._random(xp).random(dtype=x.dtype, out=noise)
        xp.add(scaled, noise, out=scaled)
        xp.floor(scaled, out=scaled)
        xp.minimum(scaled, s, out=scaled)  # rounding in the scale could reach s + 1
        xp.copysign(scaled, x, out=scaled)
        xp.copyto(levels, scaled, casting="unsafe")

    def _decode(self, payload: Any, out: Any) -> None:
        xp = array_module(out)
        units, levels = self._fields(payload, out.shape[0], out.dtype)
        views = bucket_views(out, self.bucket)
        for o, q, unit in zip(views, bucket_views(levels, self.bucket), bucket_rows(views, units)):
            xp.multiply(q, unit, out=o)
