"""``topk:ratio``: the k = round(ratio d) elements of largest magnitude, as (index, value) pairs (biased).

C(x) keeps the k elements of largest |x_i| (ties broken by the lower index)
and zeroes the rest; given the buffer's layout (``shapes``, as training
passes it), it keeps round(ratio d_l) of every layer l of d_l elements, as
Deep Gradient Compression selects (a layer whose gradients are small still
sends its largest), each layer's part of the payload as below. Biased, with error ||x - C(x)||^2 <= (1 - k/d) ||x||^2:
used with error feedback (on by default), without which the small
coordinates would never be updated.

What is sent, per vector of d elements, in a payload of P bytes padded to
8: one scale (work precision, 4 bytes for float32), the k values divided by
it in IEEE half precision (2 bytes each), their indices' low 16 bits in
ascending order (2 bytes each), and how many indices fall in each block of
65,536 elements (4 bytes per block): P = 4 k + 4 + 4 ceil(d / 65536) for
float32, 0.04 bytes per element at ratio 0.01 (int32 indices and float32
values would be twice that). The scale is the power of two just above the
largest kept magnitude, so the halves lie in (-1, 1), cannot overflow, and
a value keeps 11 significant bits (the scale is 1 where a kept value is
infinite or NaN: those travel as they are); what rounding takes off goes
into the error x - C(x) that error feedback carries on, with what was not
kept.
Selection: as in Deep Gradient Compression, a threshold is estimated from a
fixed random sample of about 1 % of the layer (at least 64 / ratio
elements), set a few standard deviations below the sample's estimate of the
k-th largest magnitude, so that some 1.3-1.8 k elements lie above it; the
exact k are then chosen among those few (a partition of O(k) elements), so
the result is exactly the k largest, only cheaper: one pass over |x| and
one comparison instead of a partition of d elements. Where the estimate
fails (fewer than k elements above it: a sparse or adversarial vector) or
the layer is small, the candidates are all nonzero elements. Among the
candidates the k-th largest is found by introselect, then the indices above
it and, where ties make up the count, equal to it are taken in index order
(NaNs count as the largest; zeros fill a vector with fewer than k nonzeros
in index order).

Aggregation: ``allgather`` only (:mod:`.aggregate`): sparse vectors of
different ranks have different supports, so their sum is not sparse and
re-encoding it with the same k (a reduce-scatter, as sign does) loses what
the supports do not share: measured, 74.4 % against 82.7 % on
Fashion-MNIST. Each rank sends (n-1) P bytes: n ratio / 2 of the float32
ring all-reduce's 2 (n-1)/n 4 d bytes (0.020 at ratio 0.01 and n = 4),
growing with n. Decoding adds the values at their indices (a scatter-add;
the indices of one payload are distinct).

Reference: Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent", EMNLP 2017; Stich, Cordonnier & Jaggi, "Sparsified SGD with
Memory", NeurIPS 2018 (top-k with error feedback, its convergence); Lin et
al., "Deep Gradient Compression", ICLR 2018.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..transport.buffers import FlatBuffer, array_module
from ..transport.ops import narrow, widen
from ..transport.scratch import scratch
from .base import Compressor, Shapes, layer_bounds, round8
from .memory import CODEC, take

#: Elements per block of the indices' high bits (the low 16 bits are sent per index).
BLOCK = 1 << 16


class TopK(Compressor):
    """Top-k sparsification (module docstring).

    Args:
        ratio: k / d, in (0, 1]; at least one element of a non-empty vector is kept.
        shapes: the layout of the buffers to compress, ``[(offset, shape), ...]`` in
            order (as PowerSGD's): k = ratio d_l elements of every layer l are kept,
            as Deep Gradient Compression selects; None: of the whole vector.
        aggregation, seed: see :class:`~collectives.compression.base.Compressor`.

    Attributes:
        layers: (start, stop) of every layer, or None without a layout.
        selected: the indices the last encoding kept, ascending within each layer
            (an array of this compressor's, rewritten by the next encoding).
    """

    name = "topk"
    param = ("ratio", float)
    feedback = True
    aggregations = ("allgather",)

    def __init__(self, ratio: float = 0.01, *, shapes: Shapes | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.ratio = check_ratio(self.name, ratio)
        self.spec = f"topk:{self.ratio:g}"
        self.layers = None if shapes is None else [(a, b) for a, b, _ in layer_bounds(shapes, "topk")]
        self.selected: Any = np.zeros(0, np.intp)
        self._samples: dict[Any, Any] = {}

    def k(self, length: int) -> int:
        """Elements kept of a vector of ``length`` (the sum over its layers)."""
        return sum(kept(self.ratio, b - a) for a, b in self._regions(length))

    def _check(self, flat: FlatBuffer) -> None:
        self._regions(flat.size)

    def _options(self, algorithm: str) -> str:
        layers = "none" if self.layers is None else f"{zlib.crc32(repr(self.layers).encode()):08x}"
        return f"{super()._options(algorithm)}, layers {layers}"

    def _regions(self, length: int) -> list[tuple[int, int]]:
        """The layers of a vector of ``length`` elements (with a layout, its length must match)."""
        if self.layers is None:
            return [(0, length)]
        covered = self.layers[-1][1] if self.layers else 0
        if length != covered:
            raise ArgumentError(f"topk: the layout covers {covered} elements, the buffer has {length}")
        return self.layers

    def _parts(self, length: int, dtype: np.dtype) -> list[tuple[int, int, int, int]]:
        """(start, stop, payload offset, payload bytes) of every layer of a vector of ``length``."""
        parts, at = [], 0
        for a, b in self._regions(length):
            nbytes = self._layer_nbytes(b - a, dtype)
            parts.append((a, b, at, nbytes))
            at += nbytes
        return parts

    def _layer_nbytes(self, length: int, dtype: np.dtype) -> int:
        """Payload bytes of one layer of ``length`` elements."""
        k = kept(self.ratio, length)
        return round8(dtype.itemsize + 4 * k + 4 * -(-length // BLOCK)) if k else 0

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return sum(nbytes for *_, nbytes in self._parts(length, dtype))

    def _fields(self, payload: Any, length: int, dtype: np.dtype) -> tuple[Any, Any, Any, Any]:
        """A layer's payload's scale (one element), values, low index bits and block counts."""
        k, head = kept(self.ratio, length), dtype.itemsize
        ends = (head, head + 2 * k, head + 4 * k, head + 4 * k + 4 * -(-length // BLOCK))
        return (
            payload[: ends[0]].view(dtype),
            payload[ends[0] : ends[1]].view(np.float16),
            payload[ends[1] : ends[2]].view(np.uint16),
            payload[ends[2] : ends[3]].view(np.uint32),
        )

    def _encode(self, x: Any, out: Any) -> None:
        xp = array_module(x)
        total = self.k(x.shape[0])
        if self.selected.shape[0] != total or array_module(self.selected) is not xp:
            self.selected = xp.zeros(total, np.intp)
        at = 0
        for a, b, offset, nbytes in self._parts(x.shape[0], x.dtype):
            index = self._encode_layer(x[a:b], out[offset : offset + nbytes])
            self.selected[at : at + index.shape[0]] = index
            self.selected[at : at + index.shape[0]] += a
            at += index.shape[0]

    def _encode_layer(self, x: Any, out: Any) -> Any:
        """Write the payload of one layer ``x`` into ``out``; the kept indices (scratch)."""
        xp, n = array_module(x), x.shape[0]
        k = kept(self.ratio, n)
        if k == 0:
            return x[:0].astype(np.intp)
        magnitude = scratch(x, n, CODEC)
        xp.abs(x, out=magnitude)
        index = scratch(x, k, CODEC + 3, np.intp)
        index[:] = self._sampled(magnitude, k)
        scale, values, low, counts = self._fields(out, n, x.dtype)
        chosen = scratch(x, k, CODEC + 4)
        take(x, index, chosen)
        top = float(xp.max(xp.abs(chosen)))
        scale[0] = 2.0 ** math.frexp(top)[1] if math.isfinite(top) and top > 0 else 1.0
        xp.divide(chosen, scale[0], out=chosen)
        narrow(chosen, values, "float16")
        xp.bitwise_and(index, BLOCK - 1, out=low, casting="unsafe")
        counts[:] = xp.bincount(index >> 16, minlength=counts.shape[0])
        return index

    def _sampled(self, magnitude: Any, k: int) -> Any:
        """The ascending indices of the k largest of ``magnitude`` (module docstring),
        among the elements above a threshold estimated from a sample where one fits."""
        xp, n = array_module(magnitude), magnitude.shape[0]
        index = self._sample_index(xp, n)
        if index is not None:
            size = index.shape[0]
            sample = scratch(magnitude, size, CODEC + 1)
            take(magnitude, index, sample)
            expected = k * size / n  # sample elements expected above the k-th largest
            rank = min(size, math.ceil(1.25 * expected + 4 * math.sqrt(expected)) + 1)
            sample.partition(size - rank)
            threshold = float(sample[size - rank])
            if threshold > 0:
                above = scratch(magnitude, n, CODEC + 2, np.bool_)
                xp.less_equal(magnitude, threshold, out=above)  # NaNs compare false: candidates
                xp.logical_not(above, out=above)
                candidates = xp.flatnonzero(above)
                if candidates.shape[0] >= k:
                    return largest(magnitude, candidates, k)
        candidates = xp.flatnonzero(magnitude)  # NaNs are nonzero
        if candidates.shape[0] >= k:
            return largest(magnitude, candidates, k)
        zeros = xp.flatnonzero(magnitude == 0)[: k - candidates.shape[0]]
        return xp.sort(xp.concatenate([candidates, zeros]))

    def _sample_index(self, xp: Any, n: int) -> Any:
        """The sample's random indices into a layer of ``n`` elements, ascending: 64
        expected above the threshold, or 1 % of the layer if more; None where that is over
        a quarter of the layer (drawn once per layer length, from a generator seeded by it)."""
        size = max(math.ceil(64 / self.ratio), n // 100)
        if 4 * size > n:
            return None
        index = self._samples.get((xp, n))
        if index is None:
            drawn = np.sort(np.random.default_rng(n).integers(0, n, size))
            index = self._samples[(xp, n)] = xp.asarray(drawn, dtype=np.intp)
        return index

    def _decode(self, payload: Any, out: Any) -> None:
        out.fill(0)
        self._decode_add(payload, out)

    def _decode_add(self, payload: Any, out: Any) -> None:
        for layer, index, values in self._kept(payload, out):
            layer[index] += values

    def _residual(self, x: Any, payload: Any, out: Any) -> None:
        """x less its decoded encoding, as the base class has it, in one copy of ``x`` and
        O(k) work: only the kept elements differ from ``x``, by their rounding."""
        out[:] = x
        for layer, index, values in self._kept(payload, out):
            values += 0  # as decoding onto zeros has it: a kept -0.0 counts as +0.0
            layer[index] -= values

    def _kept(self, payload: Any, out: Any) -> Iterator[tuple[Any, Any, Any]]:
        """Per layer with kept elements: its part of ``out``, and the positions in it and
        values (scratch, valid until the next layer) that ``payload`` encodes."""
        xp = array_module(out)
        for a, b, offset, nbytes in self._parts(out.shape[0], out.dtype):
            if not nbytes:
                continue
            n = b - a
            scale, values, low, counts = self._fields(payload[offset : offset + nbytes], n, out.dtype)
            index = xp.repeat(xp.arange(counts.shape[0], dtype=np.intp) << 16, counts.astype(np.intp))
            index += low
            chosen = scratch(out, kept(self.ratio, n), CODEC + 4)
            widen(values, chosen, "float16")
            xp.multiply(chosen, scale[0], out=chosen)
            yield out[a:b], index, chosen


def largest(magnitude: Any, candidates: Any, k: int) -> Any:
    """Of the ascending positions ``candidates`` (k or more) into ``magnitude``, the k
    of the largest magnitudes, ascending; ties to the lower position, NaNs the largest."""
    xp, count = array_module(magnitude), candidates.shape[0]
    if count == k:
        return candidates
    values, ordered = scratch(magnitude, count, CODEC + 5), scratch(magnitude, count, CODEC + 6)
    take(magnitude, candidates, values)
    xp.copyto(values, np.inf, where=xp.isnan(values))
    ordered[:] = values
    ordered.partition(count - k)
    kth = ordered[count - k]
    chosen = candidates[values > kth]
    if chosen.shape[0] < k:
        ties = candidates[values == kth][: k - chosen.shape[0]]
        chosen = xp.sort(xp.concatenate([chosen, ties]))
    return chosen


def check_ratio(name: str, ratio: float) -> float:
    """``ratio`` as a float if it is in (0, 1], else ArgumentError."""
    if not 0 < ratio <= 1:
        raise ArgumentError(f"{name}:{ratio:g}: the ratio must be in (0, 1]")
    return float(ratio)


def kept(ratio: float, length: int) -> int:
    """The k of a sparsifier keeping ``ratio`` of ``length`` elements: round(ratio length),
    at least 1 of a non-empty vector."""
    return min(length, max(1, round(ratio * length)))
