"""Folding a non-power-of-two communicator onto a power of two.

Algorithms that pair ranks by XOR (recursive halving-doubling, butterfly, the
argument check) need p' = 2^floor(lg p) ranks. With rem = p - p', the first
2*rem ranks pair up (MPICH's scheme, Thakur, Rabenseifner & Gropp 2005): each
even rank 2i sends its whole vector to rank 2i+1, which combines it and takes
part as new rank i; the even ranks sit out. Ranks >= 2*rem take part as new
rank r - rem. When the core algorithm is done, every odd rank sends the result
back to its even partner.

Cost of the fold: 2 alpha + 2 n beta + n gamma on the paired ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mpi4py import MPI

from ..transport.ops import Reduction
from ..transport.p2p import recv, send
from ..transport.scratch import scratch


@dataclass(frozen=True)
class Fold:
    """The fold of a communicator of ``size`` ranks, seen from ``rank``.

    Attributes:
        rank: this rank.
        pof2: the largest power of two <= size.
        rem: size - pof2.
        newrank: this rank's rank among the pof2 participants, or None if it
            sits out.
        partner: the rank it folds with (None if it does not fold).
        peers: for a participant, the real rank of its partner at each
            XOR step, masks 1, 2, 4, ... (empty otherwise).
    """

    rank: int
    pof2: int
    rem: int
    newrank: int | None
    partner: int | None
    peers: tuple[int, ...]

    def real(self, newrank: int) -> int:
        """The rank in the communicator of participant ``newrank``."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem

    def fold_in(self, x: Any, comm: MPI.Comm, red: Reduction) -> None:
        """Fold the extra ranks' vectors into their partners' ``x``."""
        if self.partner is None:
            return
        if self.newrank is None:
            send(comm, x, self.partner)
        else:
            tmp = scratch(x, x.shape[0])
            recv(comm, tmp, self.partner)
            red.combine(x, tmp, src_first=True)

    def fold_out(self, x: Any, comm: MPI.Comm) -> None:
        """Give the extra ranks the result their partners computed."""
        if self.partner is None:
            return
        if self.newrank is None:
            recv(comm, x, self.partner)
        else:
            send(comm, x, self.partner)


@lru_cache(maxsize=256)
def fold_of(rank: int, size: int) -> Fold:
    """The (cached) :class:`Fold` of ``rank`` in a communicator of ``size``."""
    pof2 = 1 << (size.bit_length() - 1)
    rem = size - pof2
    if rank < 2 * rem:
        newrank = None if rank % 2 == 0 else rank // 2
        partner: int | None = rank + 1 if rank % 2 == 0 else rank - 1
    else:
        newrank, partner = rank - rem, None
    fold = Fold(rank, pof2, rem, newrank, partner, ())
    if newrank is not None:
        peers = tuple(fold.real(newrank ^ (1 << k)) for k in range(pof2.bit_length() - 1))
        fold = Fold(rank, pof2, rem, newrank, partner, peers)
    return fold


def fold(comm: MPI.Comm) -> Fold:
    """The :class:`Fold` of ``comm`` seen from this rank."""
    return fold_of(comm.Get_rank(), comm.Get_size())
