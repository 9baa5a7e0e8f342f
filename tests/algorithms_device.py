"""Neighbor averaging and the training algorithms on device buffers, against the host.

Run under its own mpiexec by ``tests/test_device_algorithms.py`` (skipped
without a GPU), or by hand::

    mpiexec -n 4 python tests/algorithms_device.py

Checks, on every rank:

* ``neighbor_allreduce`` of CuPy arrays (CUDA tensors for bfloat16) gives
  bitwise the result of the same call on host buffers, for every dtype
  (both combine in the same order and precision);
* AllReduce-SGD, D-PSGD and LSGD on a CUDA torch model (float64, SGD with
  momentum) follow the same trajectory as on a CPU model, and count the
  same bytes; AllReduce-SGD and D-PSGD also with their communication
  overlapped (``overlap=True``, which a device model must ask for);
* AD-PSGD, LSGD and Prague with the model on the rank's device (local rank
  mod the GPU count, made current on the caller's thread as ``mpidl train``
  does): every device and pinned allocation of their service threads
  happens with that device current (a new thread starts on device 0), the
  group generator's thread makes none, and the caller's device stays.

Rank 0 prints "passed" if every rank passed; the exit status is 1 otherwise.
"""

from __future__ import annotations

import sys
import threading

import cupy
import numpy as np
import torch
from mpi4py import MPI

import algorithms
from collectives import NeighborWeights, neighbor_allreduce
from collectives.transport import gpu

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


def host_and_device(values: np.ndarray, dtype: str) -> tuple:
    if dtype == "bfloat16":
        host = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
        return host, host.cuda()
    host = values.astype(dtype)
    return host, cupy.asarray(host)


def to_host_bytes(buf) -> bytes:
    if isinstance(buf, torch.Tensor):
        return buf.cpu().view(torch.int16).numpy().tobytes()
    return (buf.get() if isinstance(buf, cupy.ndarray) else buf).tobytes()


def check_neighbor(comm: MPI.Comm) -> list[str]:
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(r)
    failures = []
    for dtype in DTYPES:
        integer = dtype.startswith("int")
        w = rng.integers(1, 4, n) if integer else rng.uniform(0.1, 1.0, n)
        row = NeighborWeights(w[r], {j: w[j] for j in range(n) if j != r})
        values = rng.integers(-50, 50, 1000).astype(np.float64) if integer else rng.standard_normal(1000)
        host, dev = host_and_device(values, dtype)
        neighbor_allreduce(host, row, comm)
        neighbor_allreduce(dev, row, comm)
        if to_host_bytes(host) != to_host_bytes(dev):
            failures.append(f"neighbor_allreduce {dtype}: device result differs from host")
    return failures


def train(name: str, options: dict, device: str, comm: MPI.Comm) -> tuple[np.ndarray, int]:
    r = comm.Get_rank()
    target = torch.tensor(np.sin(np.arange(64) * (r + 1)), dtype=torch.float64, device=device)
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(torch.full((64,), float(r), dtype=torch.float64, device=device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with algorithms.create(name, model, opt, comm, broadcast_init=False, **options) as algo:
        for _ in range(15):
            algo.zero_grad()
            (0.5 * (model.x - target).pow(2).sum()).backward()
            algo.step()
    return model.x.detach().cpu().numpy(), algo.bytes_sent


def check_algorithms(comm: MPI.Comm) -> list[str]:
    failures = []
    for name, options in (
        ("allreduce", {"collective": "ring"}),
        ("allreduce", {"collective": "ring", "overlap": True}),
        ("dpsgd", {"topology": "ring"}),
        ("dpsgd", {"topology": "ring", "overlap": True}),
        ("lsgd", {"layout": 2, "collective": "ring"}),
    ):
        x_cpu, bytes_cpu = train(name, options, "cpu", comm)
        x_gpu, bytes_gpu = train(name, options, "cuda", comm)
        if not np.allclose(x_cpu, x_gpu, rtol=0, atol=1e-12):
            failures.append(f"{name}: device trajectory differs by {np.max(np.abs(x_cpu - x_gpu)):.3g}")
        if bytes_cpu != bytes_gpu:
            failures.append(f"{name}: {bytes_gpu} bytes on the device, {bytes_cpu} on the host")
    return failures


def check_service_threads(comm: MPI.Comm) -> list[str]:
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = local.Get_rank() % cupy.cuda.runtime.getDeviceCount()
    local.Free()
    gpu.use_device(device)  # the caller's thread, as mpidl train sets it (last check: it stays)
    seen: list[tuple[str, int]] = []  # (thread, current device) of every allocation
    pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()

    def watched(malloc):
        def alloc(nbytes: int):
            seen.append((threading.current_thread().name, cupy.cuda.runtime.getDevice()))
            return malloc(nbytes)

        return alloc

    cupy.cuda.set_allocator(watched(pool.malloc))
    cupy.cuda.set_pinned_memory_allocator(watched(pinned.malloc))
    try:
        for name, options in (("adpsgd", {}), ("lsgd", {"layout": 1, "collective": "ring"}), ("prague", {})):
            train(name, options, f"cuda:{device}", comm)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
        cupy.cuda.set_pinned_memory_allocator(pinned.malloc)
    failures = sorted({f"{t}: an allocation with device {d} current, not {device}" for t, d in seen if d != device})
    threads = {t for t, _ in seen}
    r = comm.Get_rank()
    serving = {f"adpsgd-averaging-rank{r}" if r % 2 == 0 else f"adpsgd-server-rank{r}", f"lsgd-inter-group-rank{r}"}
    if comm.Get_size() > 1 and not serving <= threads:
        failures.append(f"threads that allocated: {sorted(threads)}, expected {sorted(serving)} among them")
    if "mpidl-group-generator" in threads:
        failures.append("the group generator's thread allocated device or pinned memory")
    if cupy.cuda.runtime.getDevice() != device:
        failures.append(f"the caller's device changed from {device} to {cupy.cuda.runtime.getDevice()}")
    return failures


def main() -> int:
    comm = MPI.COMM_WORLD
    failures = check_neighbor(comm) + check_algorithms(comm) + check_service_threads(comm)
    everyone = comm.gather(failures)
    if comm.Get_rank() == 0:
        print(f"GPU transport {gpu.PATH}")
        for rank, fs in enumerate(everyone):
            for f in fs:
                print(f"rank {rank}: {f}")
        print("passed" if not any(everyone) else "FAILED")
    return int(bool(comm.allreduce(len(failures))))


if __name__ == "__main__":
    sys.exit(main())
