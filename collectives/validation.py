"""Cross-rank agreement check run before a collective moves any data.

Every rank contributes a small integer signature (local error flag, length,
dtype, op, algorithm, options) to one ``Allgather`` on the private
communicator. If all signatures agree, the collective proceeds. Otherwise
every rank raises the same :class:`ArgumentError` naming the offending ranks
and values — no rank hangs in a collective the others skipped, no rank
computes with a peer whose buffer has another length — and the caller's
buffer is untouched. A local problem (read-only buffer, unknown op) on one
rank is reported on all.

The check costs one small all-gather per call. It is on by default; pass
``validate=False``, call :func:`set_default`, or set ``MPIDL_VALIDATE=0``
before start-up to skip it, after which a
disagreement is undefined behaviour (an MPI error, a hang or a wrong result).
"""

from __future__ import annotations

import os
import zlib
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np

from .context import Context
from .errors import ArgumentError

#: Names of the signature fields, in order.
FIELDS = ("error", "length", "dtype", "op", "algorithm", "options")

_FALSE = {"0", "false", "no", "off"}


_default = os.environ.get("MPIDL_VALIDATE", "1").strip().lower() not in _FALSE


def enabled(validate: Optional[bool]) -> bool:
    """Resolve a ``validate=`` argument; None means the default (see :func:`set_default`)."""
    return _default if validate is None else bool(validate)


def set_default(validate: bool) -> None:
    """Set the default for ``validate=None``.

    The initial default is on unless ``MPIDL_VALIDATE`` is 0/false/no/off when
    :mod:`collectives` is imported (reading the environment on every call
    would cost microseconds).
    """
    global _default
    _default = bool(validate)


@lru_cache(maxsize=1024)
def code(name: str) -> int:
    """A stable integer code for a name (op, algorithm, option string)."""
    return zlib.crc32(name.encode())


def check(ctx: Context, what: str, problem: Optional[ArgumentError], signature: Sequence[int],
          names: Callable[[], Sequence[dict[int, str]]] = tuple) -> None:
    """Raise the same ArgumentError on every rank unless all agree and none has a problem.

    Args:
        ctx: the communicator's context; collective over ``ctx.comm``.
        what: the operation, for the message; must be the same on every rank.
        problem: this rank's local argument error, if any.
        signature: ints for FIELDS[1:] (ignored where ``problem`` is set).
        names: called only to word an error: per field after "error", a map
            from code to a readable name.
    """
    mine, table = ctx.cache.get("validation", (None, None))
    if mine is None:
        mine = np.zeros(len(FIELDS), dtype=np.int64)
        table = np.zeros((ctx.size, len(FIELDS)), dtype=np.int64)
        ctx.cache["validation"] = (mine, table)
    if problem is None:
        mine[0] = 0
        mine[1:] = signature
    else:
        mine[:] = 0
        mine[0] = 1
    ctx.comm.Allgather(mine, table)
    if problem is None and table.tobytes() == mine.tobytes() * ctx.size:
        return
    _raise(ctx, what, problem, table, names())


def _raise(ctx: Context, what: str, problem: Optional[ArgumentError], table: np.ndarray,
           names: Sequence[dict[int, str]]) -> None:
    """Word and raise the error every rank raises alike (collective when a rank has a problem)."""
    if table[:, 0].any():
        messages = ctx.comm.allgather(None if problem is None else str(problem))
        bad = [r for r, m in enumerate(messages) if m is not None]
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in bad)
        raise ArgumentError(f"{what}: invalid arguments on rank(s) {bad}: {detail} (no data moved)", bad)
    diffs = []
    for f in range(1, len(FIELDS)):
        column = table[:, f]
        if (column != column[0]).any():
            lookup = names[f - 1] if f - 1 < len(names) else {}
            values = ", ".join(f"rank {r}: {lookup.get(int(v), int(v))}" for r, v in enumerate(column))
            diffs.append(f"{FIELDS[f]} differs across ranks ({values})")
    raise ArgumentError(f"{what}: ranks disagree: {'; '.join(diffs)} (no data moved)", _minority(table[:, 1:]))


def _minority(rows: np.ndarray) -> list[int]:
    """Ranks whose signature differs from the most common one."""
    keys = [row.tobytes() for row in rows]
    common = max(keys, key=keys.count)  # first of the most common: same on every rank
    return [r for r, k in enumerate(keys) if k != common]
