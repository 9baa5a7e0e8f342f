"""Device buffers (CuPy arrays, CUDA torch tensors); skipped without a GPU.

Each case runs the all-reduce matrix on the device under its own mpiexec,
once with the transport mpidl chooses (GPU-aware MPI if confirmed, else
staging) and once with staging forced by ``MPIDL_GPU_DIRECT=0``.
"""

from __future__ import annotations

import re

import pytest
from mpitest import mpiexec, on_rank0_quietly

from collectives.transport import gpu

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not gpu.available(), reason="no CUDA device (or no CuPy)")]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("direct", ["auto", "0"])
def test_device_matrix(ranks: int, direct: str) -> None:
    env = {} if direct == "auto" else {"MPIDL_GPU_DIRECT": direct}
    proc = on_rank0_quietly(mpiexec, ranks, ["tests/allreduce_matrix.py", "--device", "cuda"], env=env, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" in proc.stdout


def test_info_reports_the_transport_and_why() -> None:
    forced = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "info"], env={"MPIDL_GPU_DIRECT": "0"})
    assert forced.returncode == 0, forced.stderr
    assert re.search(r"GPU transport\s+staged \(forced by MPIDL_GPU_DIRECT=0", forced.stdout), forced.stdout
    chosen = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "info"])
    assert re.search(r"GPU transport\s+(direct|staged) \(\S", chosen.stdout), chosen.stdout


def test_bench_on_device() -> None:
    proc = on_rank0_quietly(
        mpiexec,
        2,
        ["-m", "mpidl", "bench", "--device", "cuda", "--sizes", "4K,1M", "--repeat", "3", "--batch-time", "0.002"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ring" in proc.stdout and "native" in proc.stdout
    # the device reduction's bandwidth at 1 MiB, as a fraction of a device copy's
    assert re.search(r"device reduction .* at 1 MiB: \d+ GB/s .* \d+% of a device copy's \d+ GB/s", proc.stdout)


def test_step_bench_on_device() -> None:
    """``mpidl step-bench --device cuda``: every candidate (DDP over gloo, which takes CUDA
    tensors) times a step of a model on the GPU."""
    args = ["--device", "cuda", "--hidden", "64", "--steps", "2", "--repeat", "2", "--warmup", "1"]
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "step-bench", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "thread(s) per rank on cuda:0" in proc.stdout
    for name in ("local", "allreduce+overlap", "ddp"):
        assert re.search(rf"^{re.escape(name)} +\d", proc.stdout, re.M), proc.stdout
