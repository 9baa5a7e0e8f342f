"""Reusable receive buffers for the algorithms' hot loops.

Each thread keeps, per (array module, dtype, slot), one grow-only 1-D buffer;
:func:`scratch` returns a view of its first ``n`` elements. A collective asks
for its scratch once per call and reuses it across steps, so steady-state
training allocates nothing. Threads do not share scratch, so a communication
thread and the main thread can run collectives at the same time.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .buffers import array_module

_local = threading.local()


def scratch(like: Any, n: int, slot: int = 0, dtype: Any = None) -> Any:
    """A reusable uninitialised 1-D array of ``n`` elements, same kind as ``like``.

    Its dtype is ``dtype`` if given, else ``like``'s. ``slot`` separates
    buffers that must be live at the same time. The returned view stays valid
    until the next call with the same key on this thread.
    """
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    dtype = like.dtype if dtype is None else np.dtype(dtype)
    key = (type(like), dtype, slot)
    buf = cache.get(key)
    if buf is None or buf.shape[0] < n:
        xp = array_module(like)
        buf = cache[key] = xp.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def release() -> None:
    """Drop this thread's scratch buffers (e.g. after a large benchmark)."""
    _local.buffers = {}
