"""Which ranks share a node.

By default the layout comes from ``comm.Split_type(MPI.COMM_TYPE_SHARED)``:
ranks that can share memory are on one node. It can be overridden to emulate
nodes on one machine — an explicit ``ranks_per_node`` argument, or the
``MPIDL_RANKS_PER_NODE`` environment variable — as one number (nodes of that
many consecutive ranks, the last possibly smaller) or a comma-separated list
of node sizes ("3,1"). Nodes are numbered by their lowest rank.

The detected layout is computed once per communicator (on its private
duplicate) and cached on its :class:`~collectives.transport.context.Context`;
:func:`detected` gives it without any override, for what needs real shared
memory (:mod:`collectives.kernels.shm`).
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from mpi4py import MPI

from ..errors import ArgumentError
from ..transport.context import Context, context


@dataclass(frozen=True)
class Layout:
    """Node membership of every rank of a communicator.

    Attributes:
        node_of: the node index of each rank (nodes numbered by lowest rank).
    """

    node_of: tuple[int, ...]

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return max(self.node_of) + 1

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        """Number of ranks on each node."""
        return tuple(self.node_of.count(i) for i in range(self.nodes))

    def members(self, node: int) -> tuple[int, ...]:
        """The ranks on ``node``, ascending."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def __str__(self) -> str:
        return f"{self.nodes} node(s) x ranks {'+'.join(map(str, self.ranks_per_node))}"


#: A layout override: nodes' sizes (one number or a list, see the module
#: docstring), or a resolved :class:`Layout`.
RanksPerNode = Union[int, str, Sequence[int], Layout, None]


def layout(comm: MPI.Comm, ranks_per_node: RanksPerNode = None) -> Layout:
    """The node layout of ``comm`` (collective on first use without an override).

    Args:
        comm: the communicator.
        ranks_per_node: an override (see module docstring), or a
            :class:`Layout` of ``comm``'s size, returned as it is; None reads
            ``MPIDL_RANKS_PER_NODE`` and otherwise detects the real layout.

    Raises:
        ArgumentError: the override is malformed or does not add up to the
            communicator size.
    """
    size = comm.Get_size()
    if isinstance(ranks_per_node, Layout):
        if len(ranks_per_node.node_of) != size:
            raise ArgumentError(
                f"layout {ranks_per_node} has {len(ranks_per_node.node_of)} ranks, the communicator {size}"
            )
        return ranks_per_node
    spec = ranks_per_node if ranks_per_node is not None else os.environ.get("MPIDL_RANKS_PER_NODE") or None
    if spec is not None:
        return _emulated(spec, size)
    return detected(context(comm))


def detected(ctx: Context) -> Layout:
    """The real layout of a context's communicator: which of its ranks can share
    memory (collective on first use, then cached; no override applies)."""
    found = ctx.cache.get("layout")
    if found is None:
        comm = ctx.comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=ctx.rank)
        first = node.allreduce(ctx.rank, op=MPI.MIN)
        node.Free()
        rows = comm.allgather((first, _machine(), _affinity()))
        firsts = sorted({leader for leader, _, _ in rows})
        found = ctx.cache["layout"] = Layout(tuple(firsts.index(leader) for leader, _, _ in rows))
        here = [cores for _, machine, cores in rows if machine == rows[ctx.rank][1]]
        ctx.cache["cores per rank"] = bin(functools.reduce(operator.or_, here)).count("1") / len(here)
    return found


def cores_per_rank(ctx: Context) -> float:
    """The cores that the ranks of ``ctx``'s communicator on this rank's machine may run
    on (the union of their affinity masks: ranks bound to a core each have one each),
    per rank there (collective on :func:`detected`'s first use): below 1 the machine is
    oversubscribed, and a rank waits for a core as often as for a message. A machine is
    a running kernel, which may hold several nodes that cannot share memory (network
    namespaces of an emulated cluster; containers), all of them running on its cores."""
    detected(ctx)
    return ctx.cache["cores per rank"]


def _machine() -> str:
    """This process's machine: the running kernel's boot id where Linux gives it, else
    the processor name MPI gives."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return MPI.Get_processor_name()


def _affinity() -> int:
    """The cores this process may run on, as a bit mask (bit i: core i)."""
    if hasattr(os, "sched_getaffinity"):
        return sum(1 << core for core in os.sched_getaffinity(0))
    return (1 << (os.cpu_count() or 1)) - 1


def _emulated(spec: int | str | Sequence[int], size: int) -> Layout:
    try:
        if isinstance(spec, str):
            parts = [int(p) for p in spec.replace("+", ",").split(",") if p.strip()]
            counts = _uniform(parts[0], size) if len(parts) == 1 else parts
        elif isinstance(spec, int):
            counts = _uniform(spec, size)
        else:
            counts = [int(c) for c in spec]
    except (ValueError, IndexError):
        counts = []
    if not counts or min(counts) < 1 or sum(counts) != size:
        raise ArgumentError(
            f"invalid ranks-per-node layout {spec!r} for {size} rank(s): give one positive "
            f"number (nodes of that many consecutive ranks) or node sizes adding up to {size}"
        )
    return Layout(tuple(i for i, c in enumerate(counts) for _ in range(c)))


def _uniform(per_node: int, size: int) -> list[int]:
    if per_node < 1:
        raise ValueError(per_node)
    return [min(per_node, size - start) for start in range(0, size, per_node)]
