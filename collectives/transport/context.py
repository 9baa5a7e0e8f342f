"""Per-communicator private state, cached on the communicator itself.

Collectives never send on the caller's communicator: like an MPI library, they
use a private duplicate (its own context id), so their messages cannot match
the user's point-to-point messages. The duplicate and everything derived from
it (validation scratch, node layout, sub-communicators) live in a
:class:`Context` attached to the caller's communicator as an MPI attribute;
it is built on first use — collectively, so every rank must make that first
call (a wait the stall inspector sees) — and freed with the communicator,
or at the latest when the interpreter exits, before mpi4py finalizes MPI:
a shared-memory window still allocated at ``MPI_Finalize`` makes MPICH's ofi
netmod fail to close its fabric ("fabricclose failed ... Device or resource
busy", exit status 15) after the program's work is done. The contexts of
communicators that a dead process belongs to (ULFM, :mod:`~collectives.transport.faults`)
are left to the process's end instead (:func:`abandon`): freeing their windows
and duplicates is collective, and would wait for the dead.
"""

from __future__ import annotations

import atexit
from collections.abc import Collection
from typing import Any

from mpi4py import MPI

from . import p2p


class Context:
    """What the collectives keep for one communicator.

    Attributes:
        comm: the private duplicate the algorithms communicate on.
        rank: this process's rank in it.
        size: its number of ranks.
        cache: derived objects (layouts, sub-communicators, scratch),
            keyed by whoever builds them; freed newest first (a later
            object may use an earlier one, e.g. a window on a cached
            sub-communicator).
        calls: the entry points' resolved calls, by their arguments
            (:mod:`collectives.api`).
        aliases: ids of the Python objects it was looked up with.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        p2p.operation("the set-up of the collectives on a communicator (MPI_Comm_dup at its first collective call)")
        with p2p.waiting(comm):
            self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cache: dict[Any, Any] = {}
        self.calls: dict[Any, Any] = {}
        self.aliases: list[int] = []
        self.abandoned = False
        self.freed = False

    def free(self) -> None:
        """Free every cached object (newest first), then the private communicator
        (nothing, once :func:`abandon` left it to the process's end)."""
        if self.abandoned:
            return
        for value in reversed(list(self.cache.values())):
            if isinstance(value, MPI.Comm) and value != MPI.COMM_NULL:
                value.Free()
            elif hasattr(value, "free"):
                value.free()
        self.cache.clear()
        self.calls.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.freed = True


def _delete(comm: MPI.Comm, keyval: int, ctx: Context) -> None:
    for key in ctx.aliases:
        _known.pop(key, None)
    if not MPI.Is_finalized():
        ctx.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete)

# Contexts by id() of the Python communicator objects they were looked up
# with (the object is kept, so its id cannot be reused): a dictionary lookup
# instead of MPI_Comm_get_attr on every call. Entries go when the
# communicator is freed.
_known: dict[int, tuple[MPI.Comm, Context]] = {}
_ALIASES = 8


def _free_all() -> None:
    """Free every context still known (module docstring). Registered with ``atexit`` after
    mpi4py.MPI was imported, so it runs before mpi4py's own finalization."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for _, ctx in list(_known.values()):
            ctx.free()


atexit.register(_free_all)


def abandon(dead: Collection[int]) -> None:
    """Never free the contexts of the communicators that any of the ``dead`` processes
    (``MPI_COMM_WORLD`` ranks) belongs to: their windows and duplicates would wait
    for the dead at the process's end (Open MPI's shared-memory window spins in
    ``MPI_Win_free``)."""
    for _, ctx in list(_known.values()):
        if not ctx.abandoned and ctx.comm != MPI.COMM_NULL and set(p2p.world_ranks(ctx.comm)) & set(dead):
            ctx.abandoned = True


def context(comm: MPI.Comm) -> Context:
    """The :class:`Context` of ``comm``, created (collectively) on first use."""
    found = _known.get(id(comm))
    if found is not None and found[0] is comm:
        return found[1]
    ctx: Context | None = comm.Get_attr(_KEYVAL)  # type: ignore[assignment]  # mpi4py types attributes loosely
    if ctx is None:
        ctx = Context(comm)
        comm.Set_attr(_KEYVAL, ctx)
    if len(ctx.aliases) < _ALIASES:  # a caller wrapping the handle anew each time stays uncached
        ctx.aliases.append(id(comm))
        _known[id(comm)] = (comm, ctx)
    return ctx
