"""The choice of the device transport (:func:`collectives.transport.gpu.configure`),
checked without a GPU through the stand-in CuPy (``tests/fake_cupy.py``): it is
collective over the communicator it is made on, once per communicator."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok

import collectives
from collectives.transport import gpu

pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore:.*device buffers are staged through host memory")]


def unprobed(monkeypatch: pytest.MonkeyPatch, direct: str) -> None:
    """The stand-in CuPy, with no transport chosen yet (``MPIDL_GPU_DIRECT=direct`` if given)."""
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(gpu, "PATH", gpu.Path())
    if direct:
        monkeypatch.setenv("MPIDL_GPU_DIRECT", direct)


def exact_on_device(comm: MPI.Comm) -> bool:
    """All-reduce 10**rank in a device array on ``comm``; whether the sum is exact."""
    x = fake_cupy.on(0, np.full(5, 10.0 ** comm.Get_rank()))
    collectives.allreduce(x, comm, collective="ring")
    return bool(np.all(x.host == sum(10.0**r for r in range(comm.Get_size()))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", ["", "1"])
def test_probe_on_a_sub_communicator_then_on_the_whole(monkeypatch: pytest.MonkeyPatch, direct: str) -> None:
    """Even ranks first use device buffers on their half, then every rank on the whole:
    the even ranks took part in the whole's probe too (they had skipped it, as probed
    already, and left the odd ranks waiting in it). With ``MPIDL_GPU_DIRECT=1`` the
    probe itself runs (and fails on the stand-in's arrays, which MPI cannot read)."""
    unprobed(monkeypatch, direct)
    world = MPI.COMM_WORLD
    half, whole = world.Split(world.rank % 2, world.rank), world.Dup()
    try:
        ok = exact_on_device(half) if world.rank % 2 == 0 else True
        ok = exact_on_device(whole) and ok
    finally:
        half.Free()
        whole.Free()
    assert all_ok(world, ok)
    expected = "the device-buffer probe failed" if direct else "the MPI library is not GPU-aware"
    assert all_ok(world, gpu.PATH.mode == "staged" and expected in gpu.PATH.reason), gpu.PATH


@pytest.mark.timeout(60)
def test_probe_with_a_rank_that_has_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank without a usable device still takes part (it returned at once, and the
    others waited for it in the probe): it has no device path, the others stage."""
    unprobed(monkeypatch, "1")
    world = MPI.COMM_WORLD
    lacking = world.rank == world.size - 1
    if lacking:
        monkeypatch.setattr(gpu, "available", lambda: False)
    comm = world.Dup()
    try:
        path = gpu.configure(comm)
        again = gpu.configure(comm)  # decided: no communication
    finally:
        comm.Free()
    if lacking:
        assert path.mode == "none" and "no CUDA device" in path.reason, path
    else:
        assert path.mode == "staged" and "another rank cannot use device buffers" in path.reason, path
    assert again is path
