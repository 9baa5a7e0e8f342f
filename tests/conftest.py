"""pytest configuration: a temporary root per rank, auto's cache in a temporary
directory, quieter output on ranks other than 0."""

from __future__ import annotations

import os
import tempfile

import pytest
from mpi4py import MPI


def pytest_configure(config: pytest.Config) -> None:
    rank = MPI.COMM_WORLD.rank
    # auto's measurements go to a directory of the test runs (inherited by the
    # programs the tests start), not to the user's cache: every rank the same
    os.environ.setdefault("MPIDL_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"pytest-mpidl-{os.getuid()}-cache"))
    if config.option.basetemp is None:
        # One temporary root per rank: pytest's numbered directories are not
        # safe for several processes creating and pruning them at once.
        config.option.basetemp = os.path.join(tempfile.gettempdir(), f"pytest-mpidl-{os.getuid()}-rank{rank}")
    if rank != 0:
        # Ranks > 0 still report failures (and exit non-zero); they skip the
        # progress dots so that rank 0's report stays readable.
        config.option.verbose = -1
