"""``randk:ratio``: k = round(ratio d) elements chosen at random, scaled by d/k (unbiased).

C(x)_i = (d/k) x_i for i in a set S of k indices drawn uniformly without
replacement, 0 elsewhere. Each index is in S with probability k/d, so
E[C(x)] = x, with variance (d/k - 1) x_i^2 per element.

The indices are not sent: every rank draws the same S from a generator
seeded by the compressor's seed and the number of vectors compressed so far
(each ``compress`` or ``allreduce`` call draws anew; all ranks call in the
same order). So what is sent is the k values only (work precision, 4 bytes
for float32): 4 ratio bytes per element. ``decompress`` scatters a payload
over the indices of this rank's latest draw, which are every rank's indices
of the same step.

Aggregation: ``allreduce``: with S shared, sum_j C(x_j) = (d/k) sum_j x_j on
S, so the k values themselves are all-reduced (:func:`collectives.allreduce`,
any algorithm): a ring sends 2 (n-1)/n 4 k bytes per rank, ratio of the
float32 ring all-reduce's for every n (0.01 at ratio 0.01). Error feedback is
off by default (unbiased); with it on, the residual is x - C(x).

Reference: Wangni, Wang, Liu & Zhang, "Gradient Sparsification for
Communication-Efficient Distributed Optimization", NeurIPS 2018; Stich,
Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k,
and its d/k scale).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..api import allreduce
from ..errors import ArgumentError
from ..transport.buffers import array_module
from ..transport.scratch import scratch
from .aggregate import Call
from .base import Compressor
from .memory import PAYLOAD, take
from .topk import check_ratio, kept


class RandomK(Compressor):
    """Random-k sparsification with shared indices (module docstring).

    Args:
        ratio: k / d, in (0, 1]; at least one element of a non-empty vector is kept.
        seed: the seed of the shared index draws (the same on every rank).
        aggregation: see :class:`~collectives.compression.base.Compressor`.
    """

    name = "randk"
    param = ("ratio", float)
    unbiased = True

    def __init__(self, ratio: float = 0.01, **options: Any) -> None:
        super().__init__(**options)
        self.ratio = check_ratio(self.name, ratio)
        self.spec = f"randk:{self.ratio:g}"
        self.draws = 0
        self._index: Any = None
        self._length = -1

    def k(self, length: int) -> int:
        """Elements kept of a vector of ``length``."""
        return kept(self.ratio, length)

    def _draw(self, length: int, xp: Any) -> Any:
        """The next shared index set for a vector of ``length`` (sorted, in ``xp``'s memory)."""
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        index = rng.choice(length, self.k(length), replace=False)
        index.sort()
        self._index = index if xp is np else xp.asarray(index)
        self._length = length
        return self._index

    def _options(self, algorithm: str) -> str:
        return f"{super()._options(algorithm)}, draw {self.draws}"  # the ranks' draws must agree

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return self.k(length) * dtype.itemsize

    def _encode(self, x: Any, out: Any) -> None:
        xp, n = array_module(x), x.shape[0]
        values = out.view(x.dtype)
        take(x, self._draw(n, xp), values)
        xp.multiply(values, n / max(values.shape[0], 1), out=values)

    def _decode(self, payload: Any, out: Any) -> None:
        out.fill(0)
        self._decode_add(payload, out)

    def _decode_add(self, payload: Any, out: Any) -> None:
        if self._length != out.shape[0]:
            raise ArgumentError(
                f"{self.spec}: a payload decodes at the indices of this step's draw, which was "
                + ("not made yet" if self._length < 0 else f"for {self._length} elements, not {out.shape[0]}")
                + ": compress this step's vector first"
            )
        out[self._index] += payload.view(out.dtype)

    def _aggregate(self, x: Any, residual: Any, call: Call) -> None:
        payload = scratch(x, self._nbytes(x.shape[0], x.dtype), PAYLOAD, np.uint8)
        self._encode(x, payload)
        values = payload.view(x.dtype)
        if residual is not None:
            residual[:] = x
            residual[self._index] -= values
        allreduce(values, call.comm, call.op, call.algorithm, validate=False)
        x.fill(0)
        x[self._index] = values
