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
``validate=False`` or set ``MPIDL_VALIDATE=0`` to skip it, after which a
disagreement is undefined behaviour (an MPI error, a hang or a wrong result).
"""

from __future__ import annotations

import os
import zlib
from typing import Optional, Sequence

import numpy as np

from .context import Context
from .errors import ArgumentError

#: Names of the signature fields, in order.
FIELDS = ("error", "length", "dtype", "op", "algorithm", "options")

_FALSE = {"0", "false", "no", "off"}


def enabled(validate: Optional[bool]) -> bool:
    """Resolve a ``validate=`` argument: None means ``MPIDL_VALIDATE`` (default on)."""
    if validate is None:
        return os.environ.get("MPIDL_VALIDATE", "1").strip().lower() not in _FALSE
    return bool(validate)


def code(name: str) -> int:
    """A stable integer code for a name (op, algorithm, option string)."""
    return zlib.crc32(name.encode())


def check(ctx: Context, what: str, problem: Optional[ArgumentError], signature: Sequence[int],
          names: Sequence[dict[int, str]] = ()) -> None:
    """Raise the same ArgumentError on every rank unless all agree and none has a problem.

    Args:
        ctx: the communicator's context; collective over ``ctx.comm``.
        what: the operation, for the message (e.g. ``"allreduce(algorithm='ring')"``).
        problem: this rank's local argument error, if any.
        signature: ints for FIELDS[1:] (ignored where ``problem`` is set).
        names: per field after "error", a map from code to a readable name.
    """
    mine, table = ctx.cache.get("validation", (None, None))
    if mine is None:
        mine = np.zeros((1, len(FIELDS)), dtype=np.int64)
        table = np.zeros((ctx.size, len(FIELDS)), dtype=np.int64)
        ctx.cache["validation"] = (mine, table)
    mine[0, 0] = problem is not None
    mine[0, 1:] = 0 if problem is not None else signature
    ctx.comm.Allgather(mine, table)
    if not table[:, 0].any() and (table == table[0]).all():
        return
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
    odd = _minority(table[:, 1:])
    raise ArgumentError(f"{what}: ranks disagree: {'; '.join(diffs)} (no data moved)", odd)


def _minority(rows: np.ndarray) -> list[int]:
    """Ranks whose signature differs from the most common one."""
    keys = [row.tobytes() for row in rows]
    common = max(keys, key=keys.count)  # first of the most common: same on every rank
    return [r for r, k in enumerate(keys) if k != common]
