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
  overlapped (``overlap=True``, which a device model must ask for).

Rank 0 prints "passed" if every rank passed; the exit status is 1 otherwise.
"""

from __future__ import annotations

import sys

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
        ("allreduce", {"algorithm": "ring"}),
        ("allreduce", {"algorithm": "ring", "overlap": True}),
        ("dpsgd", {"topology": "ring"}),
        ("dpsgd", {"topology": "ring", "overlap": True}),
        ("lsgd", {"layout": 2, "algorithm": "ring"}),
    ):
        x_cpu, bytes_cpu = train(name, options, "cpu", comm)
        x_gpu, bytes_gpu = train(name, options, "cuda", comm)
        if not np.allclose(x_cpu, x_gpu, rtol=0, atol=1e-12):
            failures.append(f"{name}: device trajectory differs by {np.max(np.abs(x_cpu - x_gpu)):.3g}")
        if bytes_cpu != bytes_gpu:
            failures.append(f"{name}: {bytes_gpu} bytes on the device, {bytes_cpu} on the host")
    return failures


def main() -> int:
    comm = MPI.COMM_WORLD
    failures = check_neighbor(comm) + check_algorithms(comm)
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
