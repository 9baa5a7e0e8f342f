"""Diagnostics through the standard logging module: nothing configured at import, a
rank-prefixed stderr handler from ``mpidl.init()``, the level from ``MPIDL_LOG_LEVEL``."""

from __future__ import annotations

import re

import pytest
from mpitest import mpiexec, on_rank0_quietly
from test_costmodel import FLAT, shared_path

pytestmark = pytest.mark.mpi

HANDLERS = """
import logging
import algorithms, collectives, mpidl
def count():
    return [len(logging.getLogger(name).handlers) for name in ("collectives", "algorithms", "mpidl")]
print("import", count())
mpidl.init(log_handler=False)
print("init(log_handler=False)", count())
mpidl.init()
mpidl.init()
print("init() twice", count(), [logging.getLogger(n).propagate for n in ("collectives", "algorithms", "mpidl")])
"""

#: An all-reduce with ``auto``, which logs its choice at DEBUG (the cost model comes from a file).
AUTO = """
import numpy as np
import collectives, mpidl
comm = mpidl.init()
collectives.allreduce(np.ones(1000, np.float32), comm)
"""


def test_importing_mpidl_configures_no_logging() -> None:
    """Importing the packages adds no handler; ``init(log_handler=False)`` neither; ``init()``
    adds one to each package's logger, once, which then keeps its records from the root's."""
    proc = on_rank0_quietly(mpiexec, 1, ["-c", HANDLERS], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "import [0, 0, 0]",
        "init(log_handler=False) [0, 0, 0]",
        "init() twice [1, 1, 1] [False, False, False]",
    ]


@pytest.mark.parametrize("level, shown", [("debug", True), ("loud", False)])
def test_diagnostics_are_rank_prefixed_at_the_level_asked(level: str, shown: bool, tmp_path_factory) -> None:
    """``MPIDL_LOG_LEVEL=debug``: every rank logs what ``auto`` chose, after ``mpidl: rank R:``.
    A level that is none: rank 0 says so, once, and the default (WARNING) hides the choice."""
    path = shared_path(tmp_path_factory, "flat.json")
    on_rank0_quietly(FLAT.save, path)
    env = {"MPIDL_COSTMODEL": path, "MPIDL_LOG_LEVEL": level}
    proc = on_rank0_quietly(mpiexec, 2, ["-c", AUTO], timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = re.findall(r"^mpidl: rank (\d): auto: \w+ for 4000 B on 2 ranks", proc.stderr, re.M)
    assert sorted(chosen) == (["0", "1"] if shown else []), proc.stderr[-3000:]
    refused = f"mpidl: rank 0: MPIDL_LOG_LEVEL='{level}' is not a level"
    assert proc.stderr.count(refused) == (0 if shown else 1), proc.stderr[-3000:]
