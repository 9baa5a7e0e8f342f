"""2D-torus all-reduce: reduce-scatter along rows, all-reduce along columns,
all-gather along rows.

Phases (ranks on an X x Y grid; with the default grid a row is a node):

1. ring reduce-scatter inside each row: the rank at row position i holds
   chunk i (of X) reduced over its row;
2. ring all-reduce of chunk i down each column (Y ranks, n/X bytes);
3. ring all-gather inside each row.

Cost: 2(X-1) alpha_row + 2 n (X-1)/X beta_row + n (X-1)/X gamma
+ 2(Y-1) alpha_col + 2 (n/X)(Y-1)/Y beta_col + (n/X)(Y-1)/Y gamma, i.e.
2(X+Y-2) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma on a uniform network:
bandwidth-optimal with fewer latency terms than the flat ring, and the slow
column links carry only 1/X of the data.
Reference: Mikami et al., "Massively Distributed SGD:
ImageNet/ResNet-50 Training in a Flash" (2018).
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..transport.chunks import chunk_bounds
from ..transport.ops import Reduction
from . import ring


def allreduce(x: Any, row: MPI.Comm, col: MPI.Comm, red: Reduction) -> None:
    """Reduce ``x`` in place over the grid.

    Args:
        row: this rank's row communicator (X ranks).
        col: this rank's column communicator (Y ranks, all at the same row position).
    """
    ring.reduce_scatter(x, row, red)
    bounds = chunk_bounds(x.shape[0], row.Get_size())
    i = row.Get_rank()
    ring.allreduce(x[bounds[i] : bounds[i + 1]], col, red)
    ring.allgather(x, row)
