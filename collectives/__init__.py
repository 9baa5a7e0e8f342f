"""collectives: hand-written all-reduce algorithms on mpi4py.

``allreduce(buf, comm, op, algorithm)`` reduces a numpy array or torch tensor
in place; :data:`ALGORITHMS` names the algorithms, each in its own module
(``ring``, ``halving_doubling``, ``butterfly``, ``reduce_broadcast``,
``hierarchical_ring``, ``torus2d``) whose kernel is public for composition, as
are the ring's ``reduce_scatter`` and ``allgather``; "auto" picks one with the
cost model (:mod:`collectives.costmodel`), and :func:`explain` says which and
why.

:class:`GroupGenerator` is the lock service that hands out P-Reduce groups
(policies :data:`POLICIES`).
"""

from .api import ALGORITHMS, DEFAULT_ALGORITHM, allreduce, explain
from .buffers import DTYPES, FlatBuffer, as_flat
from .errors import ArgumentError, CollectiveError
from .group_generator import POLICIES, Group, GroupGenerator, static_group, static_groups
from .ops import OPS, Reduction, reduction
from .ring import allgather, reduce_scatter

__all__ = [
    "ALGORITHMS", "DEFAULT_ALGORITHM", "DTYPES", "OPS", "POLICIES", "ArgumentError", "CollectiveError",
    "FlatBuffer", "Group", "GroupGenerator", "Reduction", "allgather", "allreduce", "as_flat", "explain",
    "reduce_scatter", "reduction", "static_group", "static_groups",
]
