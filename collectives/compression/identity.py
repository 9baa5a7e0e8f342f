"""``none``: no compression, so that "no compressor" goes through the same interface.

What is sent: the buffer as it is (``allreduce``: :func:`collectives.allreduce`
of the buffer in its own dtype, any algorithm: a ring sends 2 (n-1)/n m
bytes per rank); ``compress`` returns the values in work precision (float32
for half-precision buffers, so that nothing is lost). Unbiased and exact:
the residual is zero (and a server memory is left as it is).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..api import DEFAULT_COLLECTIVE, allreduce
from ..errors import renamed_keyword
from ..transport.buffers import as_flat
from .base import Compressor


class Identity(Compressor):
    """No compression (module docstring)."""

    name = "none"
    unbiased = True

    def allreduce(
        self,
        buf: Any,
        comm: MPI.Comm | None = None,
        op: str = "avg",
        *,
        residual: Any = None,
        server: Any = None,
        collective: str = DEFAULT_COLLECTIVE,
        validate: bool | None = None,
        algorithm: str | None = None,
    ) -> Any:
        collective = renamed_keyword(
            "Compressor.allreduce", "algorithm", "collective", algorithm, collective, DEFAULT_COLLECTIVE
        )
        allreduce(buf, comm, op, collective, validate=validate)
        if residual is not None:
            as_flat(residual).data.fill(0)
        return buf

    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        return length * dtype.itemsize

    def _encode(self, x: Any, out: Any) -> None:
        out.view(x.dtype)[:] = x

    def _decode(self, payload: Any, out: Any) -> None:
        out[:] = payload.view(out.dtype)
