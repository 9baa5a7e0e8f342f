"""MPICH's shared-memory segments that a killed job leaves in /dev/shm: finding them and
removing those no live process maps (for the tests' nested jobs and the docs' commands;
no MPI here, so a driver that is not an MPI process can use it)."""

from __future__ import annotations

import contextlib
import os
import time

#: Where MPICH keeps its shared-memory segments, and their names' prefix.
SHM, SEGMENT = "/dev/shm", "mpich_shm_"


def segments() -> set[str]:
    """MPICH's shared-memory segment files now in :data:`SHM`."""
    try:
        return {name for name in os.listdir(SHM) if name.startswith(SEGMENT)}
    except OSError:
        return set()


def _mapped() -> set[str]:
    """The files of :data:`SHM` that some live process maps."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                mapped.update(line.split(SHM + "/", 1)[1].split()[0] for line in maps if SHM + "/" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return mapped


def remove_orphaned_segments(before: set[str], wait: float = 2.0) -> list[str]:
    """Remove MPICH's segments that appeared since ``before`` and that no live process
    maps: a job whose ranks were killed (``MPI_Abort``, SIGKILL) leaves them, as MPICH
    removes them only when its ranks end cleanly. A segment still mapped is looked at
    again for up to ``wait`` seconds (a killed job's ranks may still be ending when its
    launcher has returned). Returns the names removed."""
    removed: list[str] = []
    deadline = time.monotonic() + wait
    while True:
        new = segments() - before
        orphans = sorted(new - _mapped()) if new else []  # reading every process's maps only when needed
        for name in orphans:
            with contextlib.suppress(OSError):  # removed meanwhile
                os.unlink(os.path.join(SHM, name))
        removed += orphans
        if len(orphans) == len(new) or time.monotonic() > deadline:
            return removed
        time.sleep(0.1)


__all__ = ["SEGMENT", "SHM", "remove_orphaned_segments", "segments"]
