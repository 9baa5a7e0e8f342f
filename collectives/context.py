"""Per-communicator private state, cached on the communicator itself.

Collectives never send on the caller's communicator: like an MPI library, they
use a private duplicate (its own context id), so their messages cannot match
the user's point-to-point messages. The duplicate and everything derived from
it (validation scratch, node layout, sub-communicators) live in a
:class:`Context` attached to the caller's communicator as an MPI attribute;
it is built on first use — collectively, so every rank must make that first
call — and freed with the communicator.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI


class Context:
    """What the collectives keep for one communicator.

    Attributes:
        comm: the private duplicate the algorithms communicate on.
        rank: this process's rank in it.
        size: its number of ranks.
        cache: derived objects (layouts, sub-communicators, scratch),
            keyed by whoever builds them.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cache: dict[Any, Any] = {}

    def free(self) -> None:
        """Free the private communicator and every cached communicator."""
        for value in self.cache.values():
            if isinstance(value, MPI.Comm) and value != MPI.COMM_NULL:
                value.Free()
            elif hasattr(value, "free"):
                value.free()
        self.cache.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _delete(comm: MPI.Comm, keyval: int, ctx: Context) -> None:
    if not MPI.Is_finalized():
        ctx.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete)


def context(comm: MPI.Comm) -> Context:
    """The :class:`Context` of ``comm``, created (collectively) on first use."""
    ctx = comm.Get_attr(_KEYVAL)
    if ctx is None:
        ctx = Context(comm)
        comm.Set_attr(_KEYVAL, ctx)
    return ctx
