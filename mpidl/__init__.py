"""mpidl: MPI toolkit for data-parallel deep learning.

The face of the toolkit: :func:`init`, the public API of :mod:`collectives`
re-exported, and the ``mpidl`` command (``python -m mpidl``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from collectives import (
    ALGORITHMS,
    OPS,
    ArgumentError,
    CollectiveError,
    allreduce,
)

from .runtime import init

__all__ = ["ALGORITHMS", "OPS", "ArgumentError", "CollectiveError", "__version__", "allreduce", "init"]
