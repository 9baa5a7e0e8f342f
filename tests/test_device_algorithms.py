"""Neighbor averaging and the training algorithms on device buffers; skipped without a GPU.

Each case runs ``tests/algorithms_device.py`` under its own mpiexec, with the
transport mpidl chooses and with staging forced (``MPIDL_GPU_DIRECT=0``): the
transport is chosen once per process.
"""

from __future__ import annotations

import pytest
from mpitest import mpiexec, on_rank0_quietly

from collectives.transport import gpu

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not gpu.available(), reason="no CUDA device (or no CuPy)")]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("direct", ["auto", "0"])
def test_device_matches_host(ranks: int, direct: str) -> None:
    env = {} if direct == "auto" else {"MPIDL_GPU_DIRECT": direct}
    proc = on_rank0_quietly(mpiexec, ranks, ["tests/algorithms_device.py"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" in proc.stdout
