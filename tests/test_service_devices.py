"""Service threads work on the CUDA device of the buffers they serve, checked without a GPU.

A new thread starts on device 0; a service thread of a model on device 1 must make
device 1 current before it allocates, stages or reduces (``gpu.use_device`` with
``gpu.device_of`` its buffer). Here a fake CuPy (``tests/fake_cupy.py``) records the
current device of every device operation: AD-PSGD, LSGD and Prague run on buffers that
claim device 1, and every operation of their service threads happens on device 1, with
the caller's thread on device 0 or 1 and its device left as it was. On a GPU,
``tests/algorithms_device.py`` checks the device of every allocation for real.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import fake_cupy
import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size, gather_failures

import algorithms
import algorithms.base
import collectives.transport.background
from algorithms.flat import FlatParams
from collectives import FlatBuffer, as_flat
from collectives.transport import gpu
from collectives.transport.background import Background

DIM = 10


def on_a_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (which starts on device 0); its value, or its exception raised here."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((fn(), None))
        except BaseException as exc:  # raised on the caller's thread below
            out.append((None, exc))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    value, error = out[0]
    if error is not None:
        raise error
    return value


def test_device_of_names_the_device_or_none_for_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    assert gpu.device_of(np.zeros(3)) is None
    assert gpu.device_of(fake_cupy.on(1, np.zeros(3))) == 1
    assert gpu.device_of(as_flat(fake_cupy.on(1, np.zeros(3))).data) == 1


def test_device_of_a_cpu_tensor_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    fake_cupy.install(monkeypatch)
    assert gpu.device_of(torch.zeros(3)) is None


def test_use_device_sets_the_calling_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    assert on_a_thread(fake_cupy.current) == 0  # as with CUDA

    def use_one() -> int:
        gpu.use_device(1)
        return fake_cupy.current()

    assert on_a_thread(use_one) == 1
    assert fake_cupy.current() == 0
    monkeypatch.setitem(sys.modules, "cupy", None)  # host memory: CuPy not even imported
    gpu.use_device(None)


def test_use_device_sets_torch_once_it_has_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    fake_cupy.install(monkeypatch)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    on_a_thread(lambda: gpu.use_device(1))
    assert chosen == [1]


def test_background_runs_its_tasks_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    on_one, on_host = Background("on-device-1", 1), Background("on-host")
    try:
        on_one.submit(fake_cupy.current)
        on_host.submit(fake_cupy.current)
        assert on_one.result() == (1, 0)
        assert on_host.result() == (0, 0)
    finally:
        on_one.close()
        on_host.close()
    assert fake_cupy.current() == 0


def test_background_hands_a_device_failure_to_every_task(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: int | None) -> None:
        raise RuntimeError(f"device {device} is gone")

    monkeypatch.setattr(collectives.transport.background, "use_device", broken)
    service = Background("broken", 1)
    for _ in range(2):
        service.submit(lambda: None)
        with pytest.raises(RuntimeError, match="device 1 is gone"):
            service.result()
    service.close()


# --- the algorithms on device 1 ----------------------------------------------------


class DeviceFlat(FlatParams):
    """Flat parameters and gradients of fake device arrays; new buffers on their device."""

    def new_buffer(self) -> FlatBuffer:
        with fake_cupy.Device(self.grad_data.device.id):
            return as_flat(fake_cupy.empty(self.size, self.grad_data.dtype))


class DeviceSGD:
    """x <- x - g, on the device."""

    def __init__(self, x: Any, g: Any) -> None:
        self.x, self.g = x, g

    def step(self) -> None:
        fake_cupy.subtract(self.x, self.g, out=self.x)


def run(name: str, options: dict[str, Any], comm: MPI.Comm, x0: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``name`` for 12 steps of gradient ``g`` from ``x0``, the model on device 1; the final model."""
    x, grads = fake_cupy.on(1, x0), fake_cupy.on(1, g)
    with algorithms.create(name, x, DeviceSGD(x, grads), comm, broadcast_init=False, **options) as algo:
        for _ in range(12):
            grads.host[:] = g  # as a backward pass would
            algo.step()
        algo.settle()
    return x.host


#: LSGD's groups on n ranks, and their representatives.
LAYOUTS = {1: (1, ()), 2: (1, (0, 1)), 3: ("2,1", (0, 2)), 4: (2, (0, 2))}


@pytest.mark.mpi
@pytest.mark.parametrize("caller_device", [0, 1])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_service_threads_work_on_the_models_device(
    monkeypatch: pytest.MonkeyPatch, size: int, caller_device: int
) -> None:
    """Every device operation of a service thread happens with device 1 current, on
    device-1 arrays, whatever the caller's device, which stays as it was; the models come
    out right (AD-PSGD and Prague keep the sum of the models exactly with zero gradients;
    LSGD applies the mean gradient, one step late)."""
    comm = comm_of_size(size)
    n, r = comm.Get_size(), comm.Get_rank()
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(algorithms.base, "flatten", lambda x, opt: DeviceFlat(x, opt.g))
    fake_cupy.Device(caller_device).use()
    x0 = np.arange(DIM, dtype=np.float64) * (r + 1)  # integers: averaging pairs is exact here
    failures = []
    for name in ("adpsgd", "prague"):
        x = run(name, {}, comm, x0, np.zeros(DIM))
        if comm.allreduce(x.sum()) != comm.allreduce(x0.sum()):
            failures.append(f"{name}: the sum of the models changed")
    layout, representatives = LAYOUTS[n]
    x = run("lsgd", {"layout": layout, "collective": "ring"}, comm, x0, np.full(DIM, r + 1.0))
    expected = x0 - (11 if n > 1 else 12) * ((n + 1) / 2)
    if not np.array_equal(x, expected):
        failures.append(f"lsgd: model {x}, expected {expected}")
    failures += sorted(
        {
            f"{e.thread}: {e.what} with device {e.current} current, on arrays of devices {e.arrays}"
            for e in fake_cupy.elsewhere(1)
            if e.thread != "MainThread"
        }
    )
    threads = {e.thread for e in fake_cupy.EVENTS}
    serving = {f"adpsgd-averaging-rank{r}" if r % 2 == 0 else f"adpsgd-server-rank{r}"} if n > 1 else set()
    serving |= {f"lsgd-inter-group-rank{r}"} if r in representatives else set()
    if not serving <= threads:
        failures.append(f"threads that worked on the device: {sorted(threads)}, expected {sorted(serving)} among them")
    if "mpidl-group-generator" in threads:
        failures.append("the group generator's thread touched device memory")
    if fake_cupy.current() != caller_device:
        failures.append(f"the caller's device changed from {caller_device} to {fake_cupy.current()}")
    failures = gather_failures(comm, failures)
    assert all_ok(MPI.COMM_WORLD, not failures), "\n".join(failures)


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 4])
def test_lsgd_resolves_auto_for_device_memory_before_its_steps(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """LSGD with ``collective="auto"`` on a device model has the device cost model
    calibrated when it starts, so the steps count only their own messages (on an H100
    its first step had counted the calibration's exchanges: 274x the model per step)."""
    comm = comm_of_size(size)
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(algorithms.base, "flatten", lambda x, opt: DeviceFlat(x, opt.g))
    x, grads = fake_cupy.on(1, np.zeros(DIM)), fake_cupy.on(1, np.ones(DIM))
    layout, _ = LAYOUTS[comm.Get_size()]
    with algorithms.create("lsgd", x, DeviceSGD(x, grads), comm, broadcast_init=False, layout=layout) as algo:
        for _ in range(4):
            algo.step()
        algo.settle()
        per_step = algo.bytes_sent / 4
    assert all_ok(comm, per_step <= 4 * x.host.nbytes), per_step
