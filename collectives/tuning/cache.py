"""``auto``'s measurements kept between processes, per machine, MPI library and shape.

One JSON file per key in the cache directory (``MPIDL_CACHE_DIR``, else
``$XDG_CACHE_HOME/mpidl``, else ``~/.cache/mpidl``), named by a digest of the
key. The key (:func:`describe`) is everything the measurements depend on:

* every rank's host name and network namespace (the inode of
  ``/proc/self/ns/net``: the emulated cluster's nodes are namespaces of one
  host, with shaped links between them);
* the MPI library (``MPI_Get_library_version``) and the thread level (MPICH
  picks other collective algorithms at other levels);
* mpidl's code: a digest of the ``collectives`` package's source files, so
  that a changed algorithm is measured anew;
* the communicator's size, node layout and 2D-torus grid;
* the memory (host, or device with its transport, direct or staged);
* rank 0's environment variables that tune the MPI library or malloc
  (:data:`ENVIRONMENT`).

The file holds its key; a file whose key is not the job's (edited, or a
digest collision) is never used. Rank 0 reads the file and sends what it
holds to every rank (:func:`load`), so every rank decides from the same
numbers even where the directory is a node-local path. Rank 0 writes it
(:func:`save`, when the communicator is freed or the program ends),
atomically, after merging what the file holds by then (another job may have
measured other sizes). The cache only saves time and makes choices
repeatable: a file that cannot be read or parsed is ignored, one that cannot
be written is not, each with a warning; ``MPIDL_TUNING_CACHE=0`` (or
:func:`~collectives.tuning.settings.set_tuning`) switches it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ..topology.layout import Layout
from . import settings
from .costmodel import save_json
from .table import Table
from .waits import waiting

#: Prefixes of environment variables that change what the measurements measure.
ENVIRONMENT = ("MPIR_CVAR_", "MPICH_", "I_MPI_", "OMPI_MCA_", "UCX_", "FI_", "PSM2_", "GLIBC_TUNABLES", "MPIDL_GPU_")
#: The format of the files: a file of another format is not used.
FORMAT = 1
_DURING = "auto's cache"


def directory() -> Path:
    """The cache directory (module docstring)."""
    explicit = os.environ.get("MPIDL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpidl"


def describe(comm: MPI.Comm, lay: Layout, grid: Any, memory: str) -> dict[str, Any] | None:
    """The key of ``comm``'s measurements of ``memory`` (module docstring), on rank 0;
    None on the other ranks (collective)."""
    with waiting(comm, "Gather of the host names", _DURING):
        ranks = comm.gather(machine(), root=0)
    if ranks is None:
        return None
    return {
        "format": FORMAT,
        "hosts": [host for host, _ in ranks],
        "network_namespaces": [ns for _, ns in ranks],
        "mpi": library(),
        "thread_level": MPI.Query_thread(),
        "code": code_digest(),
        "size": comm.Get_size(),
        "layout": list(lay.node_of),
        "grid": list(grid) if grid is not None else None,
        "memory": memory,
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENVIRONMENT)},
    }


def path(key: dict[str, Any]) -> Path:
    """The file of ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return directory() / f"allreduce-{digest}.json"


def load(comm: MPI.Comm, key: dict[str, Any] | None) -> Table | None:
    """The table saved under ``key`` (rank 0's; the others pass None), on every rank;
    None where there is none, it is not usable, or rank 0 has the cache switched
    off (collective)."""
    table = _read(key) if key is not None and settings.current().cache else None
    with waiting(comm, "Bcast of the cached measurements", _DURING):
        return comm.bcast(table, root=0)


def save(key: dict[str, Any] | None, table: Table) -> None:
    """On rank 0 (``key`` not None) with the cache on: write ``table`` under ``key``,
    merged with what the file holds now (no communication)."""
    if key is None or not settings.current().cache:
        return
    on_disk = _read(key)
    if on_disk is not None:
        table.merge(on_disk)
    target = path(key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_json(str(target), {"key": key, "table": table.to_json()})
    except OSError as exc:
        warnings.warn(f"mpidl: cannot write auto's measurements to {target}: {exc}", stacklevel=2)


def _read(key: dict[str, Any]) -> Table | None:
    """The table in ``key``'s file if it exists and was saved under this very key."""
    source = path(key)
    try:
        with open(source, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or raw.get("key") != key:
            return None
        return Table.from_json(raw.get("table"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not a table
        warnings.warn(f"mpidl: ignoring auto's measurements in {source}: {exc}", stacklevel=2)
        return None


def machine() -> tuple[str, int | None]:
    """This rank's host name and network namespace (None where there is no /proc)."""
    try:
        namespace: int | None = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = None
    return MPI.Get_processor_name(), namespace


def library() -> str:
    """The MPI library's version text."""
    return MPI.Get_library_version().strip()


@cache
def code_digest() -> str:
    """A digest of the ``collectives`` package's source files."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for source in sorted(root.rglob("*.py")):
        h.update(str(source.relative_to(root)).encode())
        h.update(source.read_bytes())
    return h.hexdigest()[:24]
