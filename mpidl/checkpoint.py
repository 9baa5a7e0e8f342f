"""Checkpoints: every worker's state in its own file, written atomically, and the newest one found again.

Layout of a checkpoint folder::

    DIR/step-000120/rank-0.npz ... rank-<n-1>.npz    one file per worker, after 120 steps
    DIR/latest                                      the name of the newest complete checkpoint

Writing (:func:`save`, collective): each worker writes its file under a
temporary name in the step folder, flushes and fsyncs it, and renames it into
place (``os.replace``, atomic on POSIX), so a worker's file is either complete
or absent. After a barrier — every worker's file is in place — rank 0
replaces ``latest`` the same way, then removes the step folders older than
the newest :data:`KEEP` and any newer than the one just written (left by a
run that was resumed from an earlier checkpoint). A job that dies at any point leaves ``latest``
naming a complete checkpoint (or no ``latest`` at all); a half-written step
folder is ignored and overwritten by the next run.

A file is a numpy ``.npz`` archive (no pickle: loading runs no code): the
worker's arrays, plus one JSON document (key ``info``) for everything else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.transport import p2p

#: Checkpoints kept in a folder: the newest and the one before it.
KEEP = 2
_LATEST = "latest"
_INFO = "info"


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or read."""


def step_name(step: int) -> str:
    """The folder of the checkpoint after ``step`` steps."""
    return f"step-{step:06d}"


def _replace_atomically(path: str, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, rename it to ``path``."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save(directory: str, step: int, comm: MPI.Comm, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """Write this worker's ``arrays`` and JSON-able ``info`` as the checkpoint after ``step``
    steps (collective over ``comm``; module docstring for the protocol)."""
    folder = os.path.join(directory, step_name(step))
    os.makedirs(folder, exist_ok=True)
    blob = {**arrays, _INFO: np.array(json.dumps(info))}
    _replace_atomically(os.path.join(folder, f"rank-{comm.Get_rank()}.npz"), lambda f: np.savez(f, **blob))  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    p2p.operation(f"checkpoint.save(step {step})")
    with p2p.waiting(comm):
        comm.Barrier()
    if comm.Get_rank() == 0:
        _replace_atomically(os.path.join(directory, _LATEST), lambda f: f.write(step_name(step).encode()))
        current = step_name(step)
        done = sorted(name for name in os.listdir(directory) if name.startswith("step-"))
        # Newer folders are a run that was resumed from an earlier checkpoint (possibly half
        # written): they are gone. Of the rest, the newest KEEP stay.
        older = [name for name in done if name <= current]
        for old in [name for name in done if name > current] + older[:-KEEP]:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    with p2p.waiting(comm):
        comm.Barrier()


def latest(directory: str) -> str | None:
    """The newest complete checkpoint's folder name in ``directory``, or None."""
    try:
        with open(os.path.join(directory, _LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def load(directory: str, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Worker ``rank``'s (arrays, info) from the newest complete checkpoint in ``directory``."""
    name = latest(directory)
    if name is None:
        raise CheckpointError(f"no checkpoint in {directory} (its '{_LATEST}' file is missing)")
    path = os.path.join(directory, name, f"rank-{rank}.npz")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    return arrays, json.loads(str(arrays.pop(_INFO)))
