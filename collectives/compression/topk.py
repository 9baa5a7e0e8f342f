"""``topk:ratio``: the k = round(ratio d) elements of largest magnitude, as (index, value) pairs (biased).

C(x) keeps the k elements of largest |x_i| (ties broken by the lower index)
and zeroes the rest. Biased, with error ||x - C(x)||^2 <= (1 - k/d) ||x||^2:
used with error feedback (on by default), without which the small
coordinates would never be updated.

What is sent, per vector of d elements: the k values (work precision, 4
bytes for float32), then their k indices (int32), padded to 8 bytes: 8 k
bytes for float32, 8 ratio bytes per element (0.08 for ratio 0.01).
Selection: |x| is partitioned around the k-th largest (introselect, O(d);
the zeros replaced by distinct negative numbers first, since introselect
crawls through many equal values), then the indices above it and, where
ties make up the count, equal to it are taken in index order (NaNs count
as the largest).

Aggregation: ``allgather`` only (:mod:`.aggregate`): sparse vectors of
different ranks have different supports, so their sum is not sparse and
cannot be re-encoded with the same k. Each rank sends (n-1) P bytes:
n ratio of the float32 ring all-reduce's 2 (n-1)/n 4 d bytes (0.04 at
ratio 0.01 and n = 4), growing with n. Decoding adds the values at their
indices (a scatter-add; the indices of one payload are distinct).

Reference: Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent", EMNLP 2017; Stich, Cordonnier & Jaggi, "Sparsified SGD with
Memory", NeurIPS 2018 (top-k with error feedback, its convergence); Lin et
al., "Deep Gradient Compression", ICLR 2018.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..transport.buffers import FlatBuffer, array_module
from ..transport.scratch import scratch
from .base import Compressor, round8
from .memory import CODEC, take

_INDEX_LIMIT = np.iinfo(np.int32).max


class TopK(Compressor):
    """Top-k sparsification (module docstring).

    Args:
        ratio: k / d, in (0, 1]; at least one element of a non-empty vector is kept.
        aggregation, seed: see :class:`~collectives.compression.base.Compressor`.
    """

    name = "topk"
    param = ("ratio", float)
    feedback = True
    aggregations = ("allgather",)

    def __init__(self, ratio: float = 0.01, **options: Any) -> None:
        super().__init__(**options)
        self.ratio = check_ratio(self.name, ratio)
        self.spec = f"topk:{self.ratio:g}"
        self._ramps: dict[Any, Any] = {}

    def k(self, length: int) -> int:
        """Elements kept of a vector of ``length``."""
        return kept(self.ratio, length)

    def _check(self, flat: FlatBuffer) -> None:
        if flat.size > _INDEX_LIMIT:
            raise ArgumentError(f"topk: indices are int32, so at most {_INDEX_LIMIT} elements, got {flat.size}")

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return round8(self.k(length) * (dtype.itemsize + 4))

    def _fields(self, payload: Any, length: int, dtype: np.dtype) -> tuple[Any, Any]:
        """The payload's values and indices."""
        k = self.k(length)
        head = k * dtype.itemsize
        return payload[:head].view(dtype), payload[head : head + 4 * k].view(np.int32)

    def _encode(self, x: Any, out: Any) -> None:
        xp, n = array_module(x), x.shape[0]
        k = self.k(n)
        if k == 0:
            return
        values, index = self._fields(out, n, x.dtype)
        magnitude, selected = scratch(x, n, CODEC), scratch(x, n, CODEC + 1, np.bool_)
        xp.abs(x, out=magnitude)
        xp.isnan(magnitude, out=selected)
        xp.copyto(magnitude, np.inf, where=selected)
        xp.greater(magnitude, 0, out=selected)
        threshold = 0.0
        if int(xp.count_nonzero(selected)) > k:
            # Introselect crawls through many equal values (20x slower with 60 % zeros, as
            # in the sum of sparse vectors that reduce_scatter encodes again): the zeros
            # become distinct negative numbers first, which leaves the k-th largest alone.
            ordered = scratch(x, n, CODEC + 2)
            ordered[:] = magnitude
            xp.logical_not(selected, out=selected)
            xp.copyto(ordered, self._ramp(xp, n, x.dtype), where=selected)
            ordered.partition(n - k)
            threshold = ordered[n - k]
        xp.greater(magnitude, threshold, out=selected)
        above = xp.flatnonzero(selected)
        index[: above.shape[0]] = above
        if above.shape[0] < k:
            xp.equal(magnitude, threshold, out=selected)
            index[above.shape[0] :] = xp.flatnonzero(selected)[: k - above.shape[0]]
        take(x, index, values)

    def _ramp(self, xp: Any, n: int, dtype: np.dtype) -> Any:
        """-1, -2, ..., -n in ``dtype`` (kept, grown when a longer one is asked for)."""
        ramp = self._ramps.get((xp, dtype))
        if ramp is None or ramp.shape[0] < n:
            ramp = self._ramps[(xp, dtype)] = -xp.arange(1, n + 1, dtype=dtype)
        return ramp[:n]

    def _decode(self, payload: Any, out: Any) -> None:
        out.fill(0)
        self._decode_add(payload, out)

    def _decode_add(self, payload: Any, out: Any) -> None:
        values, index = self._fields(payload, out.shape[0], out.dtype)
        out[index] += values


def check_ratio(name: str, ratio: float) -> float:
    """``ratio`` as a float if it is in (0, 1], else ArgumentError."""
    if not 0 < ratio <= 1:
        raise ArgumentError(f"{name}:{ratio:g}: the ratio must be in (0, 1]")
    return float(ratio)


def kept(ratio: float, length: int) -> int:
    """The k of a sparsifier keeping ``ratio`` of ``length`` elements: round(ratio length),
    at least 1 of a non-empty vector."""
    return min(length, max(1, round(ratio * length)))
