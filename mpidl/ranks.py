"""This process's place in the job: its rank and the number of ranks, in the job and on its node.

Horovod's ``hvd.rank()``, ``size()``, ``local_rank()`` and ``local_size()``
after :func:`mpidl.init`: the rank in ``MPI.COMM_WORLD``, and the rank among
the ranks of its node, by the node layout the collectives use
(:func:`collectives.topology.layout.layout`): the ranks that share memory, or
the nodes that ``MPIDL_RANKS_PER_NODE`` emulates (so that a run emulating two
nodes on one machine gives each emulated node local ranks 0, 1, ..., as two
real nodes would). ``local_rank()`` picks the rank's GPU
(``torch.cuda.set_device(mpidl.local_rank())``).
"""

from __future__ import annotations

from mpi4py import MPI

from collectives.topology.layout import layout

_place: tuple[int, int, int, int] | None = None  # rank, size, local rank, local size (locate())


def locate(comm: MPI.Comm) -> None:
    """Find this rank's place on ``comm``'s node layout (collective on first use: the
    layout is detected; ``mpidl.init()`` calls it).

    Raises:
        ArgumentError: ``MPIDL_RANKS_PER_NODE`` is malformed (on every rank).
    """
    global _place
    lay = layout(comm)
    rank = comm.Get_rank()
    node = lay.members(lay.node_of[rank])
    _place = (rank, comm.Get_size(), node.index(rank), len(node))


def rank() -> int:
    """This process's rank in the job (``MPI.COMM_WORLD``), 0 to :func:`size` - 1."""
    return _located()[0]


def size() -> int:
    """The number of ranks in the job."""
    return _located()[1]


def local_rank() -> int:
    """This process's rank among the ranks of its node (module docstring), 0 to
    :func:`local_size` - 1."""
    return _located()[2]


def local_size() -> int:
    """The number of ranks on this process's node (module docstring)."""
    return _located()[3]


def _located() -> tuple[int, int, int, int]:
    if _place is None:
        raise RuntimeError("call mpidl.init() first (every rank): it finds this rank's place in the job")
    return _place
