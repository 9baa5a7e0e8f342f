"""pytest configuration: quieter output on ranks other than 0."""

from __future__ import annotations

import pytest
from mpi4py import MPI


def pytest_configure(config: pytest.Config) -> None:
    if MPI.COMM_WORLD.rank != 0:
        # Ranks > 0 still report failures (and exit non-zero); they skip the
        # progress dots so that rank 0's report stays readable.
        config.option.verbose = -1
