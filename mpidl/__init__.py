"""mpidl: MPI toolkit for data-parallel deep learning.

The face of the toolkit: :func:`init`, the public API of :mod:`collectives`
re-exported, :class:`~mpidl.data.ShardSampler` (a worker's shard of a dataset
for a torch ``DataLoader``), and the ``mpidl`` command (``python -m mpidl``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import Any

from collectives import (
    COLLECTIVES,
    OPS,
    ArgumentError,
    CollectiveError,
    allreduce,
)
from collectives.errors import renamed

from .data import ShardSampler
from .runtime import init

__all__ = ["COLLECTIVES", "OPS", "ArgumentError", "CollectiveError", "ShardSampler", "__version__", "allreduce", "init"]


def __getattr__(name: str) -> Any:
    """``mpidl.ALGORITHMS``, the old name of :data:`COLLECTIVES` (deprecated: a
    ``DeprecationWarning``; the training algorithms are ``algorithms.ALGORITHMS``)."""
    if name == "ALGORITHMS":
        renamed("mpidl", "mpidl.ALGORITHMS (the all-reduce algorithms)", "mpidl.COLLECTIVES")
        return COLLECTIVES
    raise AttributeError(f"module 'mpidl' has no attribute {name!r}")
