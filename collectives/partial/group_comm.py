"""A group of ranks seen as a communicator, without creating one.

The all-reduce kernels use only ``Get_rank``, ``Get_size`` and the
point-to-point calls ``Sendrecv``/``Send``/``Recv`` and ``Isend``/``Irecv``
(through :mod:`collectives.transport.p2p`; the segmented exchange pipelines
its segments with the nonblocking pair; the stall inspector also asks for
``Get_group``). :class:`GroupComm` offers exactly those on a subset
of a parent communicator, translating group ranks to parent ranks, so every
kernel runs unchanged among the members of a P-Reduce group. Creating one is
a few Python attribute stores: no ``MPI_Comm_create``/``Split`` (which are
collective over the parent and would serialize the asynchronous groups).

Message matching stays correct because the parent is a private communicator
and any two ranks run the groups they share in the same order (MPI delivers
messages between a pair in order on one communicator and tag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from ..errors import ArgumentError
from ..transport import p2p


class GroupComm:
    """The ranks ``members`` of ``comm`` as a communicator of ``len(members)`` ranks.

    Group rank i is parent rank ``members[i]``; the calling process must be a
    member. Wildcard sources are not supported (they would match ranks outside
    the group).
    """

    __slots__ = ("_rank", "_world", "comm", "members")

    def __init__(self, comm: MPI.Comm, members: Sequence[int]) -> None:
        self.comm = comm
        self.members = tuple(members)
        me = comm.Get_rank()
        if me not in self.members:
            raise ArgumentError(f"rank {me} is not a member of the group {self.members}")
        self._rank = self.members.index(me)
        self._world: tuple[int, ...] | None = None

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return len(self.members)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
        status: Any = None,
    ) -> None:
        self.comm.Sendrecv(sendbuf, self._parent(dest), sendtag, recvbuf, self._parent(source), recvtag, status)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.comm.Send(buf, self._parent(dest), tag)

    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None) -> None:
        self.comm.Recv(buf, self._parent(source), tag, status)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        return self.comm.Isend(buf, self._parent(dest), tag)

    def Irecv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:
        return self.comm.Irecv(buf, self._parent(source), tag)

    def world_ranks(self) -> tuple[int, ...]:
        """The ``MPI_COMM_WORLD`` rank of every member, in group order (for byte counts by peer)."""
        if self._world is None:
            parent = p2p.world_ranks(self.comm)
            self._world = tuple(parent[m] for m in self.members)
        return self._world

    def Get_group(self) -> MPI.Group:
        return self.comm.Get_group().Incl(list(self.members))

    def _parent(self, rank: int) -> int:
        if not 0 <= rank < len(self.members):
            raise ArgumentError(f"rank {rank} is not a rank of a group of {len(self.members)}")
        return self.members[rank]
