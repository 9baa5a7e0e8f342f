"""Checkpoints: every worker's state in its own file, written atomically, and the newest one found again.

Layout of a checkpoint folder::

    DIR/step-000120/rank-0.npz ... rank-<n-1>.npz    one file per worker, after 120 steps
    DIR/latest                                      the name of the newest complete checkpoint

Writing (:func:`save`, collective): each worker writes its file under a
temporary name (``.tmp-*``) in the step folder, flushes and fsyncs it, renames
it into place (``os.replace``, atomic on POSIX) and fsyncs the folder, so a
worker's file is either complete or absent, also after a power loss. After a
barrier — every worker's file is in place, so no writer of this job is
active — rank 0 removes the temporary files that killed writers left in the
step folder and in DIR, replaces ``latest`` the same way (the fsync of DIR
also makes the step folder's own entry durable), then removes the step
folders older than the newest :data:`KEEP` and any newer than the one just
written (left by a run that was resumed from an earlier checkpoint), in
the order of their step numbers. A job that dies at any point leaves
``latest`` naming a complete checkpoint (or no ``latest`` at all); a
half-written step folder is ignored and overwritten by the next run. One
job at a time writes a checkpoint folder. The barriers carry each rank's
outcome: a worker that cannot write its file (a full disk, a permission) makes
:func:`save` raise :class:`CheckpointError` on every rank, naming it, with
``latest`` still naming the checkpoint before.

A file is a numpy ``.npz`` archive (no pickle: loading runs no code): the
worker's arrays, plus one JSON document (key ``info``) for everything else.
A file that cannot be read, is truncated or corrupt is a :class:`CheckpointError`
naming it and the problem (:func:`load`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
_TMP = ".tmp-"
_STEP = re.compile(r"step-([0-9]+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or read."""


def step_name(step: int) -> str:
    """The folder of the checkpoint after ``step`` steps."""
    return f"step-{step:06d}"


def replace_atomically(path: str, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, rename it to
    ``path`` and fsync the folder (so that the rename is durable too)."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_temporaries(folder: str) -> None:
    """Remove the temporary files of :func:`replace_atomically` in ``folder`` (writers killed
    before their rename: call it only when no writer can be active there)."""
    for name in os.listdir(folder):
        if name.startswith(_TMP):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))


def save(directory: str, step: int, comm: MPI.Comm, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """Write this worker's ``arrays`` and JSON-able ``info`` as the checkpoint after ``step``
    steps (collective over ``comm``; module docstring for the protocol).

    Raises:
        CheckpointError: on every rank, where any rank could not write its file or rank 0
            could not name the checkpoint in ``latest`` (naming the ranks and the
            problems); ``latest`` then still names the previous checkpoint.
    """
    folder = os.path.join(directory, step_name(step))
    p2p.operation(f"checkpoint.save(step {step})")

    def write() -> None:
        os.makedirs(folder, exist_ok=True)
        blob = {**arrays, _INFO: np.array(json.dumps(info))}
        replace_atomically(os.path.join(folder, f"rank-{comm.Get_rank()}.npz"), lambda f: np.savez(f, **blob))  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle

    def publish() -> None:
        if comm.Get_rank() != 0:
            return
        _remove_temporaries(folder)
        _remove_temporaries(directory)
        replace_atomically(os.path.join(directory, _LATEST), lambda f: f.write(step_name(step).encode()))
        done = sorted((int(m[1]), name) for name in os.listdir(directory) if (m := _STEP.fullmatch(name)))
        # Newer folders are a run that was resumed from an earlier checkpoint (possibly half
        # written): they are gone. Of the rest, the newest KEEP stay.
        older = [name for s, name in done if s <= step]
        for old in [name for s, name in done if s > step] + older[:-KEEP]:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)

    _together(
        comm,
        write,
        f"the checkpoint after step {step} in {directory} was not written",
        f" ('{_LATEST}' names the one before)",
    )
    _together(comm, publish, f"the checkpoint after step {step} in {directory} was written, but not made the latest")


def _together(comm: MPI.Comm, part: Any, failed: str, after: str = "") -> None:
    """Run ``part()``, then wait for every rank's (a barrier that carries the outcome):
    a failure on any rank raises CheckpointError on every rank, saying ``failed``, the
    ranks' problems, then ``after``."""
    try:
        part()
        problem = None
    except Exception as exc:  # a full disk, a permission, info that is not JSON: every rank must hear of it
        problem = f"{type(exc).__name__}: {exc}"
    with p2p.waiting(comm):
        problems = comm.allgather(problem)
    bad = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
    if bad:
        raise CheckpointError(f"{failed}: {bad}{after}")


def latest(directory: str) -> str | None:
    """The newest complete checkpoint's folder name in ``directory``, or None."""
    try:
        with open(os.path.join(directory, _LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def rank_file(directory: str, rank: int) -> str:
    """The path of worker ``rank``'s file in the newest complete checkpoint in ``directory``.

    Raises:
        CheckpointError: there is no checkpoint in ``directory``.
    """
    name = latest(directory)
    if name is None:
        raise CheckpointError(f"no checkpoint in {directory} (its '{_LATEST}' file is missing)")
    return os.path.join(directory, name, f"rank-{rank}.npz")


def load(directory: str, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Worker ``rank``'s (arrays, info) from the newest complete checkpoint in ``directory``.

    Raises:
        CheckpointError: no checkpoint, or the worker's file unreadable, truncated or
            corrupt (naming the file and the problem).
    """
    path = rank_file(directory, rank)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
        info = json.loads(str(arrays.pop(_INFO)))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # a damaged archive: BadZipFile, EOFError, KeyError, ValueError, NotImplementedError...
        raise CheckpointError(f"{path} is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path} is corrupt (its '{_INFO}' is not a JSON object)")
    return arrays, info
