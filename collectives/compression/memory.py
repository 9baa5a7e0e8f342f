"""The compressors' reusable memory: scratch slots, and array calls that allocate nothing.

Every buffer a step needs comes from :func:`collectives.transport.scratch.scratch`
(per thread, grown once, reused), under one of the slots below, so that a
steady-state step allocates nothing of the vector's size. :func:`take` is
numpy's ``take`` without its hidden copy: with ``out=`` and the default
``mode="raise"`` numpy gathers into a temporary of the output's size first,
and it converts indices of another type than ``intp`` into a new array.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transport.buffers import array_module
from ..transport.scratch import scratch

# Scratch slots of this package; a codec's own temporaries take CODEC, CODEC + 1, ...
WORK, RESIDUAL, DECODED, PAYLOAD, RECEIVED, ACCUMULATOR, EXTRA, TABLE, INDEX, SERVER = range(100, 110)
CODEC = 110


def take(a: Any, index: Any, out: Any, axis: int | None = None) -> None:
    """Set ``out`` to ``a``'s elements (rows, with ``axis=0``) at ``index``, which must be
    in range (numpy or CuPy)."""
    if isinstance(a, np.ndarray):
        if index.dtype != np.intp:  # numpy would convert the indices into a new array
            wide = scratch(index, index.shape[0], INDEX, np.intp)
            np.copyto(wide, index)
            index = wide
        np.take(a, index, axis=axis, out=out, mode="clip")  # "raise" would buffer the whole output
    else:
        array_module(a).take(a, index, axis=axis, out=out)
