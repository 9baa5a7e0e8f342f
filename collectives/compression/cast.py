"""``fp16`` and ``bf16``: every element cast to a 16-bit float, summed in float32.

What is sent: each element rounded to nearest even in IEEE half precision
(``fp16``: 5 exponent bits, 10 mantissa bits; overflows to infinity beyond
65504, flushes below 6e-8) or bfloat16 (``bf16``: float32's 8 exponent bits,
7 mantissa bits; float32's range). 2 bytes per element, half of float32's.

Biased in principle (rounding to nearest is deterministic) but the error is
below 2^-11 (fp16) or 2^-8 (bf16) of each element, so error feedback is off
by default.

Aggregation: ``reduce_scatter`` (:mod:`.aggregate`): each chunk's 16-bit
encodings are summed by their owner in float32, in rank order, and the sum
rounded to 16 bits once, so the sum does not lose bits at every hop as a
ring all-reduce of a half-precision buffer would (there, every partial sum
is rounded: :mod:`collectives.transport.ops`). Each rank sends
2 (n-1)/n x 2 d bytes, the same as the ring all-reduce of the cast buffer:
0.5 of the float32 ring all-reduce's bytes for every n. ``allgather`` is
offered too (exact float32 sum of every rank's cast vector; (n-1) 2 d bytes).

Reference: Micikevicius et al., "Mixed Precision Training", ICLR 2018 (fp16
with float32 accumulation); Kalamkar et al., "A Study of BFLOAT16 for Deep
Learning Training", arXiv:1905.12322, 2019. Horovod and PyTorch DDP offer the
same cast as their ``fp16`` compression hook.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..transport.ops import narrow, widen
from .base import Compressor


class Cast(Compressor):
    """Cast to a 16-bit float (module docstring)."""

    aggregations = ("reduce_scatter", "allgather", "hierarchical")
    #: The 16-bit type sent, a name :mod:`collectives.transport.ops` knows.
    half: ClassVar[str]

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return 2 * length

    def _encode(self, x: Any, out: Any) -> None:
        narrow(x, out.view(np.float16 if self.half == "float16" else np.uint16), self.half)

    def _decode(self, payload: Any, out: Any) -> None:
        widen(payload.view(np.float16 if self.half == "float16" else np.uint16), out, self.half)


class Float16(Cast):
    """``fp16``: IEEE half precision."""

    name = "fp16"
    half = "float16"


class BFloat16(Cast):
    """``bf16``: bfloat16."""

    name = "bf16"
    half = "bfloat16"
