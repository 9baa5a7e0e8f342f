"""The peers in mpidl's harness: PyTorch DistributedDataParallel over gloo, as a training algorithm.

``mpidl train --algorithm ddp`` trains with torch's own data-parallel
wrapper instead of one of mpidl's algorithms, on the same data shards, the
same model and initial parameters, the same optimizer and the same metrics,
so that every table compares like with like. It is not an mpidl algorithm
(:data:`algorithms.ALGORITHMS` does not know it, and nothing below the face
imports torch.distributed); it speaks the same interface
(:class:`algorithms.Algorithm`), so the training loop cannot tell.

How DDP runs here:

* torch.distributed's process group is joined from the MPI ranks
  (:mod:`mpidl.torchdist`; no torchrun), backend gloo;
* the model is wrapped in ``DistributedDataParallel`` with its defaults
  (25 MiB buckets in reverse registration order, all-reduce of each bucket
  started from the backward pass as soon as its gradients are ready,
  rank 0's buffers broadcast before every forward pass). The forward pass
  must go through the wrapper: :attr:`DDP.forward_module` is what the
  training loop's model calls;
* ``step()`` applies the local optimizer: the averaged gradients are in
  place when ``backward()`` returns.

BatchNorm statistics: DDP's default, rank 0's running statistics broadcast to
every worker before each forward pass, so every worker evaluates with rank
0's — unlike mpidl's gradient-averaging algorithms, which keep each worker's
own (:mod:`algorithms.flat`).

Counters: the communication happens inside ``backward()``, where mpidl's
transport does not see it, so :attr:`~algorithms.Algorithm.bytes_sent` is
gloo's ring all-reduce payload, 2 (n-1)/n x the model's bytes per step, an
estimate (the buffer broadcast and gloo's framing not counted), and
:attr:`~algorithms.Algorithm.comm_wait_s` stays 0. The emulated cluster's
interface counters measure the bytes that really crossed nodes.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

import algorithms
from collectives import ArgumentError

from . import torchdist


class DDP(algorithms.Algorithm):
    """PyTorch DistributedDataParallel (gloo) behind the algorithm interface (module docstring).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        bucket_mb: DDP's ``bucket_cap_mb`` (its default 25).

    Attributes:
        module: the model.
        forward_module: the DDP wrapper of ``module``, whose forward pass the training must call.
    """

    name = "ddp"

    def __init__(
        self, model: Any, optimizer: Any, comm: MPI.Comm | None = None, *, bucket_mb: float = 25.0, **common: Any
    ) -> None:
        self.bucket_mb, self.module = bucket_mb, model
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        import torch

        if not isinstance(self.flat.params, torch.Tensor):
            raise ArgumentError("ddp trains torch models only (use --backend torch)")
        if not self.bucket_mb > 0:
            raise ArgumentError(f"bucket_mb must be positive, got {self.bucket_mb!r}")
        return (self.bucket_mb,)

    def _start(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        torchdist.init_process_group(self.comm, "gloo")
        device = self.flat.params.device
        self.forward_module = DistributedDataParallel(
            self.module, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=self.bucket_mb
        )
        self._per_step = 2 * (self.size - 1) * self.flat.nbytes // self.size

    def _step(self) -> None:
        self.optimizer.step()
        self.bytes_sent += self._per_step

    def close(self) -> None:
        """Leave torch.distributed's process group (collective)."""
        if not self.closed:
            torchdist.destroy_process_group()
        super().close()


#: The peers by their ``--algorithm`` name.
PEERS: dict[str, type[algorithms.Algorithm]] = {"ddp": DDP}
