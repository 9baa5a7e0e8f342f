"""mpidl: MPI toolkit for data-parallel deep learning.

The face of the toolkit: :func:`init`, the public API of :mod:`collectives`
re-exported, :class:`~mpidl.data.ShardSampler` (a worker's shard of a dataset
for a torch ``DataLoader``), :mod:`mpidl.timeline` (a trace of every rank's
steps), and the ``mpidl`` command (``python -m mpidl``).
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

from . import timeline
from .data import ShardSampler
from .runtime import init

__all__ = [
    "ALGORITHMS",
    "OPS",
    "ArgumentError",
    "CollectiveError",
    "ShardSampler",
    "__version__",
    "allreduce",
    "init",
    "timeline",
]
