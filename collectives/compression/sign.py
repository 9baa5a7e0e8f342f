"""``sign[:b]``, ``sign:layer``: 1-bit compression, one bit per element and one scale per bucket or layer (biased).

For each bucket v of b elements (default 512), C(v) = (||v||_1 / b) sign(v):
the sign of every element (sign(0) = +1) times the bucket's mean absolute
value, the scale under which the 1-bit vector keeps the bucket's l1 norm.
Biased, with error ||v - C(v)||^2 = ||v||^2 - ||v||_1^2 / b <= (1 - 1/b) ||v||^2.
Error feedback, as in EF-signSGD, is off by default: in training at momentum
0.9 (with local momentum, :mod:`algorithms.local_momentum`) sign trained
within a point of uncompressed without it and lost 8-10 points with it on
Fashion-MNIST's MLP, and without it trained LeNet-5, which diverged with it
(3 seeds each; docs/performance.rst, "Compression", says why the memory
grows); ``error_feedback=True`` turns it on.
Given the layout of the buffer (``shapes``, as training passes it), the
buckets restart at every layer; ``sign:layer`` has one scale per layer,
||v||_1 / d over the layer's d elements, as EF-signSGD scales it
(Karimireddy et al. apply it per layer). The fraction of ||v||^2 a scale
keeps, ||v||_1^2 / (b ||v||^2), is smaller over a whole layer whose
magnitudes vary than over 512 of its elements: error feedback's memory then
holds more (docs/performance.rst, "Compression", measures both).

What is sent, per chunk of L elements: the scales (one work precision
float per bucket, or per layer's part of the chunk, 4 bytes for float32), then the sign bits packed eight to
a byte (:mod:`.bits`), padded to 8 bytes: 1/8 + 4/b bytes per element
(0.133 for b = 512), 1/30 of float32.

Aggregation: ``reduce_scatter`` by default (:mod:`.aggregate`): 2 (n-1)/n P
bytes per rank, 0.033 of the float32 ring all-reduce's for every n; the
chunk owner compresses the sum again (its error goes into its residual, so
error feedback carries it on). ``allgather``: (n-1) P bytes per rank,
n x 0.0166 of the ring all-reduce's (0.066 at n = 4), the exact sum of every
rank's 1-bit vector.

Reference: Seide, Fu, Droppo, Li & Yu, "1-Bit Stochastic Gradient Descent
and its Application to Data-Parallel Distributed Training of Speech DNNs",
Interspeech 2014 (1 bit per element with error feedback); Bernstein, Wang,
Azizzadenesheli & Anandkumar, "signSGD: Compressed Optimisation for
Non-Convex Problems", ICML 2018; Karimireddy, Rebjock, Stich & Jaggi, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019
(the l1 scale and error feedback); Zheng, Huang & Kwok, NeurIPS 2019 (seed
001's [51]: blockwise scales with error feedback).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..transport.buffers import FlatBuffer, array_module
from ..transport.scratch import scratch
from .base import Compressor, Shapes, bucket_rows, bucket_views, layer_bounds, round8
from .bits import pack_bits, packed_nbytes, unpack_bits
from .memory import CODEC

#: Elements per scale by default.
BUCKET = 512


class Sign(Compressor):
    """Scaled sign (module docstring).

    Args:
        bucket: elements per scale (default :data:`BUCKET`); None: one scale per
            layer (the spec's parameter: ``sign:512``, ``sign:layer``).
        shapes: the layout of the buffers to compress, ``[(offset, shape), ...]``
            in order (as PowerSGD's): buckets then lie inside layers; None: the
            buffer is one layer.
        aggregation, seed: see :class:`~collectives.compression.base.Compressor`.

    Attributes:
        block: elements per scale, or None for one scale per layer.
        layers: (start, stop) of every layer, or None without a layout.
    """

    name = "sign"
    param = ("bucket", int)
    aggregations = ("reduce_scatter", "allgather", "hierarchical")

    def __init__(self, bucket: int | None = BUCKET, *, shapes: Shapes | None = None, **options: Any) -> None:
        super().__init__(**options)
        if bucket is not None and bucket < 1:
            raise ArgumentError(f"sign: the bucket must be at least 1 element, got {bucket}")
        self.block = None if bucket is None else int(bucket)
        self.layers = None if shapes is None else [(a, b) for a, b, _ in layer_bounds(shapes, "sign")]
        if self.block != BUCKET:
            self.spec = f"sign:{'layer' if self.block is None else self.block}"
        # Chunks of reduce_scatter fall on whole buckets where the buckets tile the buffer.
        self.bucket = self.block if self.block is not None and self.layers is None else 1
        self._pieces: dict[tuple[int, int], Sign] = {}

    @classmethod
    def from_param(cls, text: str | None, **options: Any) -> Compressor:
        """As :meth:`Compressor.from_param`; ``layer`` is one scale per layer."""
        if text is not None and text.strip().lower() == "layer":
            return cls(None, **options)
        if text is not None and not text.strip().isdigit():
            raise ArgumentError(f"sign:{text}: the bucket must be a number of elements or 'layer', got {text!r}")
        return super().from_param(text, **options)

    def piece(self, start: int, stop: int) -> Compressor:
        """The codec of elements ``start`` to ``stop``: its scales per bucket inside each
        layer's part of that range (itself where scales do not depend on the layers)."""
        if self.layers is None:
            return self
        found = self._pieces.get((start, stop))
        if found is None:
            found = Sign(self.block, aggregation=self.aggregation, seed=self.seed)
            found.spec, found.bucket = self._spec, self.bucket
            found.layers = [
                (max(a, start) - start, min(b, stop) - start) for a, b in self.layers if a < stop and b > start
            ]
            self._pieces[start, stop] = found
        return found

    def _check(self, flat: FlatBuffer) -> None:
        if self.layers is not None and flat.size != self._length():
            raise ArgumentError(f"sign: the layout covers {self._length()} elements, the buffer has {flat.size}")

    def _options(self, algorithm: str) -> str:
        layers = "none" if self.layers is None else f"{zlib.crc32(repr(self.layers).encode()):08x}"
        return f"{super()._options(algorithm)}, layers {layers}"

    def _length(self) -> int:
        """The elements the layout covers."""
        return self.layers[-1][1] if self.layers else 0

    def _regions(self, length: int) -> list[tuple[int, int]]:
        """The layers of a vector of ``length`` elements (with a layout, its length must match)."""
        if self.layers is None:
            return [(0, length)]
        if length != self._length():
            raise ArgumentError(f"sign: the layout covers {self._length()} elements, not {length}")
        return self.layers

    def _scales(self, length: int) -> int:
        """How many scales a vector of ``length`` elements has."""
        return sum(-(-(b - a) // (self.block or b - a or 1)) for a, b in self._regions(length))

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return round8(self._scales(length) * dtype.itemsize + packed_nbytes(length))

    def _fields(self, payload: Any, length: int, dtype: np.dtype) -> tuple[Any, Any]:
        """The payload's scales and packed bits."""
        head = self._scales(length) * dtype.itemsize
        return payload[:head].view(dtype), payload[head : head + packed_nbytes(length)]

    def _blocks(self, a: Any, scales: Any) -> list[tuple[Any, Any]]:
        """(block rows, scale column) pairs over every layer of ``a`` (1-D), buckets
        inside layers, matched with ``scales`` in order."""
        pairs: list[tuple[Any, Any]] = []
        at = 0
        for lo, hi in self._regions(a.shape[0]):
            if hi == lo:
                continue
            views = bucket_views(a[lo:hi], self.block or hi - lo)
            count = sum(v.shape[0] for v in views)
            pairs += zip(views, bucket_rows(views, scales[at : at + count]))
            at += count
        return pairs

    def _encode(self, x: Any, out: Any) -> None:
        xp, n = array_module(x), x.shape[0]
        scales, bits = self._fields(out, n, x.dtype)
        magnitude = scratch(x, n, CODEC)
        xp.abs(x, out=magnitude)
        for v, scale in self._blocks(magnitude, scales):
            xp.mean(v, axis=1, out=scale[:, 0])
        flags = scratch(x, n, CODEC + 1, np.bool_)
        xp.greater_equal(x, 0, out=flags)
        pack_bits(flags, bits)

    def _decode(self, payload: Any, out: Any) -> None:
        xp = array_module(out)
        scales, bits = self._fields(payload, out.shape[0], out.dtype)
        unpack_bits(bits, out, (-1, 1))
        for o, scale in self._blocks(out, scales):
            xp.multiply(o, scale, out=o)
