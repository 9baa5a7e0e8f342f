"""Balanced partition of a vector into contiguous chunks.

Chunk ``i`` of a vector of ``length`` elements split ``parts`` ways is
``[bounds[i], bounds[i + 1])`` with ``bounds[i] = i * length // parts``: sizes
differ by at most one element and may be zero when ``length < parts``. Every
algorithm that splits a vector (ring, halving-doubling, 2D-torus) uses this one
rule, so chunk ``i`` means the same elements everywhere.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=256)
def chunk_bounds(length: int, parts: int) -> tuple[int, ...]:
    """Return the ``parts + 1`` chunk boundaries of a vector of ``length``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return tuple(i * length // parts for i in range(parts + 1))
