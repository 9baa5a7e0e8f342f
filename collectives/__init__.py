"""collectives: hand-written all-reduce algorithms on mpi4py.

``allreduce(buf, comm, op, collective)`` reduces a numpy array or torch tensor
in place; :data:`COLLECTIVES` names its algorithms (the collectives), each in its own module
(``ring``, ``halving_doubling``, ``butterfly``, ``reduce_broadcast``,
``hierarchical_ring``, ``torus2d``, ``shm``, and ``mpi``: the MPI library's own)
whose kernel is public for composition, as are the ring's ``reduce_scatter``
(here) and ``allgather`` (:mod:`collectives.kernels.ring`); "auto" picks the
one measured fastest for each size (:mod:`collectives.tuning`: calibration at
the sizes used, a persisted cache, online tuning; :func:`set_tuning` switches),
and :func:`explain` says which, from where and why.
``allreduce_init(buf, comm, op, collective)`` resolves those arguments once and returns
a :class:`PersistentAllreduce` that reduces ``buf`` each time it is called, as MPI-4's
persistent collectives do (less time per call for small vectors).
``allreduce_async(buf, comm, op, collective)`` runs it on a service thread and returns
a :class:`Handle` to ``wait()`` for (:mod:`collectives.nonblocking`).
``broadcast(buf, comm, root=0)`` copies rank ``root``'s buffer to every rank;
``allgather(buf, comm)`` concatenates every rank's array along its first dimension,
which may differ between ranks (:mod:`collectives.gather`).

``neighbor_allreduce(buf, weights, comm)`` averages each rank's buffer with its
in-neighbors' over a graph (:mod:`collectives.partial.neighbor`), one row of a mixing
matrix per rank (:class:`NeighborWeights`).

:class:`PReduce` averages a buffer among a group of ranks handed out by the
group generator lock service (:class:`GroupGenerator`, policies
:data:`POLICIES`); :class:`GroupComm` runs a kernel on a group of ranks.

:mod:`collectives.compression` holds the gradient compressors
(:data:`COMPRESSORS`, built from a spec "NAME[:PARAM]" by
:func:`compressor`), each with its aggregation (``Compressor.allreduce``),
and :func:`neighbor_exchange`, compressed gossip with graph neighbors.
"""

from typing import Any

from . import compression
from .api import (
    COLLECTIVES,
    DEFAULT_COLLECTIVE,
    PersistentAllreduce,
    allreduce,
    allreduce_init,
    broadcast,
    cost_params,
    explain,
)
from .compression import COMPRESSORS, Compressor, neighbor_exchange
from .compression import create as compressor
from .errors import ArgumentError, CollectiveError, renamed
from .gather import allgather
from .kernels.ring import reduce_scatter
from .nonblocking import Handle, allreduce_async, synchronize
from .partial.group_comm import GroupComm
from .partial.group_generator import POLICIES, Group, GroupGenerator, static_group, static_groups
from .partial.neighbor import NeighborWeights, neighbor_allreduce
from .partial.preduce import GROUP_KERNELS, PReduce, PReduceStats
from .transport.buffers import DTYPES, FlatBuffer, as_flat
from .transport.ops import OPS, Reduction, reduction
from .tuning.settings import TuningSettings, set_tuning

__all__ = [
    "COLLECTIVES",
    "COMPRESSORS",
    "DEFAULT_COLLECTIVE",
    "DTYPES",
    "GROUP_KERNELS",
    "OPS",
    "POLICIES",
    "ArgumentError",
    "CollectiveError",
    "Compressor",
    "FlatBuffer",
    "Group",
    "GroupComm",
    "GroupGenerator",
    "Handle",
    "NeighborWeights",
    "PReduce",
    "PReduceStats",
    "PersistentAllreduce",
    "Reduction",
    "TuningSettings",
    "allgather",
    "allreduce",
    "allreduce_async",
    "allreduce_init",
    "as_flat",
    "broadcast",
    "compression",
    "compressor",
    "cost_params",
    "explain",
    "neighbor_allreduce",
    "neighbor_exchange",
    "reduce_scatter",
    "reduction",
    "set_tuning",
    "static_group",
    "static_groups",
    "synchronize",
]

#: Old names of this module's attributes (deprecated), and their new names.
_RENAMED = {"ALGORITHMS": "COLLECTIVES", "DEFAULT_ALGORITHM": "DEFAULT_COLLECTIVE"}


def __getattr__(name: str) -> Any:
    """The deprecated names of :data:`_RENAMED`, with a ``DeprecationWarning``."""
    if name in _RENAMED:
        renamed("collectives", f"collectives.{name}", f"collectives.{_RENAMED[name]}")
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'collectives' has no attribute {name!r}")
