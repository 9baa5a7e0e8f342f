"""collectives: hand-written all-reduce algorithms on mpi4py.

``allreduce(buf, comm, op, algorithm)`` reduces a numpy array or torch tensor
in place; :data:`ALGORITHMS` names the algorithms, each in its own module
(``ring``, ``halving_doubling``, ``butterfly``, ``reduce_broadcast``,
``hierarchical_ring``, ``torus2d``, ``shm``, and ``mpi``: the MPI library's own)
whose kernel is public for composition, as are the ring's ``reduce_scatter``
and ``allgather``; "auto" picks the one measured fastest for each size
(:mod:`collectives.tuning`: calibration at the sizes used, a persisted cache,
online tuning; :func:`set_tuning` switches), and :func:`explain` says which,
from where and why. ``broadcast(buf, comm)`` copies rank 0's buffer to every rank.

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

from . import compression
from .api import ALGORITHMS, DEFAULT_ALGORITHM, allreduce, broadcast, cost_params, explain
from .compression import COMPRESSORS, Compressor, neighbor_exchange
from .compression import create as compressor
from .errors import ArgumentError, CollectiveError
from .kernels.ring import allgather, reduce_scatter
from .partial.group_comm import GroupComm
from .partial.group_generator import POLICIES, Group, GroupGenerator, static_group, static_groups
from .partial.neighbor import NeighborWeights, neighbor_allreduce
from .partial.preduce import GROUP_KERNELS, PReduce, PReduceStats
from .transport.buffers import DTYPES, FlatBuffer, as_flat
from .transport.ops import OPS, Reduction, reduction
from .tuning.settings import TuningSettings, set_tuning

__all__ = [
    "ALGORITHMS",
    "COMPRESSORS",
    "DEFAULT_ALGORITHM",
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
    "NeighborWeights",
    "PReduce",
    "PReduceStats",
    "Reduction",
    "TuningSettings",
    "allgather",
    "allreduce",
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
]
