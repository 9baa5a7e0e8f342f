"""Folding a non-power-of-two communicator onto a power of two.

Algorithms that pair ranks by XOR (recursive halving-doubling, butterfly) need
p' = 2^floor(lg p) ranks. With rem = p - p', the first 2*rem ranks pair up
(MPICH's scheme, Thakur, Rabenseifner & Gropp 2005): each even rank 2i sends
its whole vector to rank 2i+1, which combines it and takes part as new rank i;
the even ranks sit out. Ranks >= 2*rem take part as new rank r - rem. When the
core algorithm is done, every odd rank sends the result back to its even
partner.

Cost of the fold: 2 alpha + 2 n beta + n gamma on the paired ranks.
"""

from __future__ import annotations

from typing import Any, Optional

from mpi4py import MPI

from .ops import Reduction
from .p2p import recv, send
from .scratch import scratch


class Fold:
    """The fold of ``comm`` onto ``pof2`` ranks.

    Attributes:
        pof2: the largest power of two <= comm size.
        rem: comm size - pof2.
        newrank: this rank's rank among the pof2 participants, or None if it
            sits out.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        size = comm.Get_size()
        self.pof2 = 1 << (size.bit_length() - 1)
        self.rem = size - self.pof2
        if self.rank < 2 * self.rem:
            self.newrank: Optional[int] = None if self.rank % 2 == 0 else self.rank // 2
        else:
            self.newrank = self.rank - self.rem

    def real(self, newrank: int) -> int:
        """The rank in ``comm`` of participant ``newrank``."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem

    def fold_in(self, x: Any, red: Reduction) -> None:
        """Fold the extra ranks' vectors into their partners' ``x``."""
        if self.rank >= 2 * self.rem:
            return
        if self.newrank is None:
            send(self.comm, x, self.rank + 1)
        else:
            tmp = scratch(x, x.shape[0])
            recv(self.comm, tmp, self.rank - 1)
            red.combine(x, tmp, src_first=True)

    def fold_out(self, x: Any) -> None:
        """Give the extra ranks the result their partners computed."""
        if self.rank >= 2 * self.rem:
            return
        if self.newrank is None:
            recv(self.comm, x, self.rank + 1)
        else:
            send(self.comm, x, self.rank - 1)
