"""``mpidl info``: one report on the MPI environment, printed by rank 0 (``--json``: as JSON).

What it reports: mpidl, Python, numpy, mpi4py; the MPI library, its
standard and thread level; ranks, nodes and their hosts; the optional
packages (torch and the CUDA it was built for, CuPy, Horovod: a version, or
null where not installed); the GPUs each node's first rank sees; whether the
MPI library says it is GPU-aware (``MPIX_Query_cuda_support``; null where it
has no such call), and the path device buffers take
(:func:`collectives.transport.gpu.configure`, which confirms a GPU-aware
library with a probe).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import platform
from typing import Any

import mpi4py
import numpy as np

from collectives.topology.layout import layout
from collectives.transport import gpu

from . import __version__
from .runtime import init, thread_level

#: The report's keys (as in ``--json``) and their labels in the text report, in order.
LABELS = {
    "mpidl": "mpidl",
    "python": "python",
    "numpy": "numpy",
    "mpi4py": "mpi4py",
    "mpi_library": "MPI library",
    "mpi_standard": "MPI standard",
    "thread_level": "thread level",
    "ranks": "ranks",
    "nodes": "nodes",
    "ranks_per_node": "ranks per node",
    "hosts": "hosts",
    "torch": "torch",
    "cuda": "CUDA",
    "cupy": "CuPy",
    "horovod": "Horovod",
    "gpus_per_node": "GPUs per node",
    "mpi_gpu_aware": "GPU-aware MPI",
    "gpu_transport": "GPU transport",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl info`` options."""
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _packages() -> dict[str, Any]:
    """This process's torch, CUDA, CuPy and Horovod versions (None: not installed), and GPU count."""
    found: dict[str, Any] = {"torch": None, "cuda": None, "cupy": None, "horovod": None, "gpus": 0}
    if importlib.util.find_spec("torch") is not None:
        import torch

        found["torch"] = torch.__version__
        found["cuda"] = torch.version.cuda
        found["gpus"] = torch.cuda.device_count()
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            found["cupy"] = cupy.__version__
            if found["cuda"] is None:
                version = cupy.cuda.runtime.runtimeGetVersion()
                found["cuda"] = f"{version // 1000}.{version % 1000 // 10}"
            found["gpus"] = found["gpus"] or cupy.cuda.runtime.getDeviceCount()
        except Exception:  # CuPy installed without a usable CUDA: none of it counts
            pass
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found["horovod"] = importlib.metadata.version("horovod")
    return found


def report() -> dict[str, Any]:
    """Collect the report (collective over COMM_WORLD); every rank gets it, keyed as :data:`LABELS`."""
    from mpi4py import MPI

    comm = init()
    hosts = comm.allgather(MPI.Get_processor_name())
    lay = layout(comm)
    major, minor = MPI.Get_version()
    packages = _packages()
    gpus = comm.allgather(packages.pop("gpus"))
    return {
        "mpidl": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "mpi_standard": f"{major}.{minor}",
        "thread_level": thread_level(),
        "ranks": comm.Get_size(),
        "nodes": lay.nodes,
        "ranks_per_node": list(lay.ranks_per_node),
        "hosts": sorted(set(hosts)),
        **packages,
        "gpus_per_node": [gpus[lay.members(node)[0]] for node in range(lay.nodes)],
        "mpi_gpu_aware": gpu.query_cuda_support(),
        "gpu_transport": str(gpu.configure(comm)),
    }


def _text(value: Any) -> str:
    """A report value as the text report shows it."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return (", " if value and isinstance(value[0], str) else " ").join(map(str, value))
    return str(value)


def main(args: argparse.Namespace) -> int:
    """Print the report on rank 0."""
    from mpi4py import MPI

    rows = report()
    if MPI.COMM_WORLD.Get_rank() == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            width = max(map(len, LABELS.values()))
            for key, label in LABELS.items():
                print(f"{label:<{width}}  {_text(rows[key])}")
    return 0
