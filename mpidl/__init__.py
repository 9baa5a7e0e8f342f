"""mpidl: MPI toolkit for data-parallel deep learning.

The face of the toolkit: :func:`init` and where this rank is (:func:`rank`,
:func:`size`, :func:`local_rank`, :func:`local_size`); the collectives a
Horovod or DDP script reaches for, from :mod:`collectives` (:func:`allreduce`,
:func:`allreduce_async` with :func:`synchronize`, :func:`broadcast`,
:func:`allgather`); Horovod's helpers (:func:`DistributedOptimizer`,
:func:`broadcast_parameters`, :func:`broadcast_optimizer_state`);
:class:`~mpidl.data.ShardSampler` (a worker's shard of a dataset for a torch
``DataLoader``); :mod:`mpidl.timeline` (a trace of every rank's steps); and
the ``mpidl`` command (``python -m mpidl``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import Any

from algorithms import broadcast_optimizer_state, broadcast_parameters
from collectives import (
    COLLECTIVES,
    OPS,
    ArgumentError,
    CollectiveError,
    Handle,
    allgather,
    allreduce,
    allreduce_async,
    broadcast,
    synchronize,
)
from collectives.errors import renamed

from . import timeline
from .data import ShardSampler
from .optimizer import DistributedOptimizer
from .ranks import local_rank, local_size, rank, size
from .runtime import init

__all__ = [
    "COLLECTIVES",
    "OPS",
    "ArgumentError",
    "CollectiveError",
    "DistributedOptimizer",
    "Handle",
    "ShardSampler",
    "__version__",
    "allgather",
    "allreduce",
    "allreduce_async",
    "broadcast",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "size",
    "synchronize",
    "timeline",
]


def __getattr__(name: str) -> Any:
    """``mpidl.ALGORITHMS``, the old name of :data:`COLLECTIVES` (deprecated: a
    ``DeprecationWarning``; the training algorithms are ``algorithms.ALGORITHMS``)."""
    if name == "ALGORITHMS":
        renamed("mpidl", "mpidl.ALGORITHMS (the all-reduce algorithms)", "mpidl.COLLECTIVES")
        return COLLECTIVES
    raise AttributeError(f"module 'mpidl' has no attribute {name!r}")
