"""``mpidl info``: one report on the MPI environment, printed by rank 0."""

from __future__ import annotations

import argparse
import platform

import mpi4py
import numpy as np

from collectives.topology.layout import layout
from collectives.transport import gpu

from . import __version__
from .runtime import init, thread_level


def report() -> list[tuple[str, str]]:
    """Collect the report (collective over COMM_WORLD); every rank gets it."""
    from mpi4py import MPI

    comm = init()
    hosts = comm.allgather(MPI.Get_processor_name())
    lay = layout(comm)
    major, minor = MPI.Get_version()
    return [
        ("mpidl", __version__),
        ("python", platform.python_version()),
        ("numpy", np.__version__),
        ("mpi4py", mpi4py.__version__),
        ("MPI library", " ".join(MPI.Get_library_version().splitlines()[0].split())),
        ("MPI standard", f"{major}.{minor}"),
        ("thread level", thread_level()),
        ("ranks", str(comm.Get_size())),
        ("nodes", str(lay.nodes)),
        ("ranks per node", " ".join(map(str, lay.ranks_per_node))),
        ("hosts", ", ".join(sorted(set(hosts)))),
        ("GPU transport", str(gpu.configure(comm))),
    ]


def main(args: argparse.Namespace) -> int:
    """Print the report on rank 0."""
    from mpi4py import MPI

    rows = report()
    if MPI.COMM_WORLD.Get_rank() == 0:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    return 0
