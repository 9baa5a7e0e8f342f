"""Deep Gradient Compression's techniques around top-k: local clipping, momentum factor masking, sparsity warm-up.

Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training", ICLR 2018. Top-k with error
feedback (the residual v_i, :mod:`algorithms.error_feedback`) and local
momentum (u_i, DGC's *momentum correction*: :mod:`algorithms.local_momentum`)
make worker i's step

    g_i <- g_i min(1, c / ||g_i||), per tensor   local gradient clipping (``clip_norm`` c)
    u_i <- beta u_i + g_i                        momentum correction
    v_i <- v_i + u_i; send the top k of v_i; v_i <- v_i - C(v_i)
    u_i[sent] <- 0                               momentum factor masking
    k = ratio_t d, ratio_t = max(ratio, 4^-(1 + floor(t / K)))   sparsity warm-up (K steps a stage)

* **Local gradient clipping** bounds each tensor's gradient before it enters
  the momentum and the residual, where an outlier would otherwise stay for
  many steps. DGC clips per worker with the global threshold times
  N^-1/2 (the worker's share of the sum of N gradients); here ``clip_norm``
  is the per-worker, per-tensor threshold itself.
* **Momentum factor masking**: an element just sent carried its whole
  accumulated momentum; its velocity would go on pushing the same way,
  so that the stale momentum of a coordinate arrives again with its next
  selection. Zeroing the velocity of the sent elements stops that.
* **Sparsity warm-up**: the first steps' gradients change fastest; sending
  25 %, then 6.25 %, 1.5625 %, ... of the elements (K steps each) before
  the target ratio keeps the residual from piling up while they do.

:class:`DGC` holds the three switches; :class:`~algorithms.allreduce_sgd.AllReduceSGD`
applies them around each bucket's compressed aggregation
(``clip_norm=``, ``momentum_masking=``, ``sparsity_warmup=``). The
techniques keep no state of their own: the warm-up's stage follows the
step count, so a resumed run goes on where it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from collectives import ArgumentError
from collectives.transport.buffers import array_module

#: The warm-up divides the kept fraction by this at each stage (25 %, 6.25 %, 1.5625 %, ...).
STAGE_FACTOR = 4


class DGC:
    """The switches of Deep Gradient Compression around top-k (module docstring).

    Args:
        clip_norm: the l2 norm each tensor of a worker's gradient is clipped to
            before momentum and compression, or None.
        masking: zero the local momentum of the elements sent.
        warmup: steps of each warm-up stage (0: none).
        ratio: the target ratio of the top-k compressor.

    Raises:
        ArgumentError: a clip norm that is not a positive number, a negative warm-up.
    """

    def __init__(self, clip_norm: float | None, masking: bool, warmup: int, ratio: float) -> None:
        if clip_norm is not None and (
            isinstance(clip_norm, bool)
            or not isinstance(clip_norm, (int, float))
            or not (math.isfinite(clip_norm) and clip_norm > 0)
        ):
            raise ArgumentError(f"clip_norm must be a positive number, got {clip_norm!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ArgumentError(f"sparsity_warmup must be a number of steps >= 0, got {warmup!r}")
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.masking, self.warmup, self.target = bool(masking), warmup, ratio

    def ratio(self, step: int) -> float:
        """The fraction top-k keeps at compressed step ``step`` (counted from 0)."""
        if not self.warmup:
            return self.target
        return max(self.target, float(STAGE_FACTOR) ** -(1 + step // self.warmup))

    def clip(self, grads: Any, bounds: Sequence[tuple[int, int]]) -> None:
        """Scale each tensor ``grads[a:b]`` of ``bounds`` whose l2 norm exceeds the clip norm
        down to it, in place (nothing without a clip norm)."""
        if self.clip_norm is None:
            return
        for a, b in bounds:
            g = grads[a:b]
            norm = float(g.norm()) if hasattr(g, "norm") else float(array_module(g).linalg.norm(g))
            if norm > self.clip_norm:
                g *= self.clip_norm / norm
