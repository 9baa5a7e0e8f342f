"""algorithms: data-parallel training algorithms on the collectives.

Each algorithm wraps a local optimizer and owns the model's flat parameter
and gradient buffers (:mod:`algorithms.flat`); :class:`~algorithms.base.Algorithm`
documents the common API (``step()``, ``close()``, the ``params``/``grads``
buffers, the ``iterations``/``bytes_sent``/``comm_wait_s`` counters).

=============== ====================== ==============================================
name            class                  communication per step
=============== ====================== ==============================================
``allreduce``   :class:`AllReduceSGD`  all-reduce (average) of the gradients
``dpsgd``       :class:`DPSGD`         neighbor averaging of the models over a graph
``lsgd``        :class:`LSGD`          all-reduce in groups; among groups overlapped,
                                       one step late
``adpsgd``      :class:`ADPSGD`        asynchronous: atomic averaging with one random
                                       neighbor of a bipartite graph, overlapped
``grsgd``       :class:`GRSGD`         asynchronous: gossip exchanges with the ring
                                       neighbors, each worker's lead bounded
``prague``      :class:`Prague`        asynchronous: local steps, then P-Reduce in a
                                       group from the group generator
=============== ====================== ==============================================

The asynchronous ones never wait for every worker; in AD-PSGD and Prague
(random or smart groups) workers may take different numbers of steps
(:attr:`Algorithm.uneven_steps`). :meth:`Algorithm.settle` finishes what is in
flight, e.g. before the models are evaluated.

:func:`create` builds one by name, e.g. for a command line::

    algo = algorithms.create("dpsgd", model, opt, topology="ring")

Graphs and mixing matrices are in :mod:`algorithms.topology`; a numpy SGD
optimizer with torch's semantics in :mod:`algorithms.optim`;
:func:`broadcast_optimizer_state` gives every worker one worker's optimizer
state and :func:`broadcast_parameters` one worker's tensors (:mod:`algorithms.broadcast`);
``AllReduceSGD.join()`` lets workers run out of data at different steps
(:mod:`algorithms.join`).
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .adpsgd import ADPSGD
from .allreduce_sgd import AllReduceSGD
from .base import Algorithm, StateError
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .dpsgd import DPSGD
from .flat import FlatParams, flatten
from .grsgd import GRSGD
from .lsgd import LSGD
from .optim import SGD
from .prague import Prague
from .topology import TOPOLOGIES, Topology, TopologyError

#: Training algorithms by name.
ALGORITHMS: dict[str, type[Algorithm]] = {
    "allreduce": AllReduceSGD,
    "dpsgd": DPSGD,
    "lsgd": LSGD,
    "adpsgd": ADPSGD,
    "grsgd": GRSGD,
    "prague": Prague,
}


def create(name: str, model: Any, optimizer: Any, comm: MPI.Comm | None = None, **options: Any) -> Algorithm:
    """Construct the algorithm called ``name`` (collective over ``comm``).

    ``options`` are the class's keyword arguments (common ones:
    ``broadcast_init``, ``validate``; see each class).

    Raises:
        ValueError: unknown name.
    """
    cls = ALGORITHMS.get(name)
    if cls is None:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(ALGORITHMS)}")
    return cls(model, optimizer, comm, **options)


__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "DPSGD",
    "GRSGD",
    "LSGD",
    "SGD",
    "TOPOLOGIES",
    "Algorithm",
    "AllReduceSGD",
    "FlatParams",
    "Prague",
    "StateError",
    "Topology",
    "TopologyError",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "create",
    "flatten",
]
