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

Compression (``compression=``, ``mpidl train --algorithm ddp --compression``):
DDP's own communication hooks, registered on the wrapper, so that a
compressed mpidl run can be compared with DDP compressing the same way:

* ``powersgd:R``: ``powerSGD_hook`` with ``PowerSGDState(process_group=None,
  matrix_approximation_rank=R, start_powerSGD_iter=2)`` (error feedback and
  warm start on, its defaults). DDP runs plain all-reduces for the first
  ``start_powerSGD_iter`` steps; its default, 1000, would leave a short run
  uncompressed, and 2 is the least it accepts with error feedback, so the
  comparison is like with like (mpidl's PowerSGD compresses from the first
  step). Per bucket, a parameter viewed as shape[0] x rest is compressed when
  that saves more than half its elements (``min_compression_rate`` 2), else
  all-reduced as it is;
* ``fp16``: ``fp16_compress_hook`` (the buckets cast to float16, all-reduced,
  cast back).

Other specs are refused (:class:`~collectives.ArgumentError`).

BatchNorm statistics: DDP's default, rank 0's running statistics broadcast to
every worker before each forward pass, so every worker evaluates with rank
0's — unlike mpidl's gradient-averaging algorithms, which keep each worker's
own (:mod:`algorithms.flat`).

Counters: the communication happens inside ``backward()``, where mpidl's
transport does not see it, so :attr:`~algorithms.Algorithm.bytes_sent` is
gloo's ring all-reduce payload, 2 (n-1)/n x the model's bytes per step (with
compression, of what the hook all-reduces: half of it for fp16; PowerSGD's
P, Q and uncompressed parameters after its first steps), an estimate (the
buffer broadcast and gloo's framing not counted), and
:attr:`~algorithms.Algorithm.comm_wait_s` stays 0. The emulated cluster's
interface counters measure the bytes that really crossed nodes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

import algorithms
from collectives import ArgumentError
from collectives.compression import PowerSGD

from . import torchdist


class DDP(algorithms.Algorithm):
    """PyTorch DistributedDataParallel (gloo) behind the algorithm interface (module docstring).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        bucket_mb: DDP's ``bucket_cap_mb`` (its default 25).
        compression: None or "none", "powersgd:R" or "fp16": DDP's communication
            hook (module docstring).

    Attributes:
        module: the model.
        forward_module: the DDP wrapper of ``module``, whose forward pass the training must call.
    """

    name = "ddp"

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        bucket_mb: float = 25.0,
        compression: str | None = None,
        **common: Any,
    ) -> None:
        self.bucket_mb, self.module, self.compression = bucket_mb, model, compression
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        import torch

        if not isinstance(self.flat.params, torch.Tensor):
            raise ArgumentError("ddp trains torch models only (use --backend torch)")
        if not self.bucket_mb > 0:
            raise ArgumentError(f"bucket_mb must be positive, got {self.bucket_mb!r}")
        self._hook = _hook(self.compression)
        if self._hook[0] == "powersgd" and self.flat.params.device.type == "cpu" and torch.cuda.is_available():
            raise ArgumentError(
                "ddp: DDP's PowerSGD hook cannot train a model on the CPU where CUDA is available "
                f"(torch {torch.__version__}'s powerSGD_hook calls torch.cuda.synchronize() on the gradients' "
                "device, the CPU); train on the GPU (--device cuda) or hide it (CUDA_VISIBLE_DEVICES=)"
            )
        return (self.bucket_mb, self._hook)

    def _start(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        torchdist.init_process_group(self.comm, "gloo")
        device = self.flat.params.device
        self.forward_module = DistributedDataParallel(
            self.module, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=self.bucket_mb
        )
        ring = 2 * (self.size - 1) / self.size
        self._per_step = 2 * (self.size - 1) * self.flat.nbytes // self.size
        self._compressed_per_step = self._per_step
        self._plain_steps = 0
        name, rank = self._hook
        if name == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            self.forward_module.register_comm_hook(None, fp16_compress_hook)
            self._compressed_per_step = self._per_step // 2
        elif name == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

            state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_START)
            self.forward_module.register_comm_hook(state, powerSGD_hook)
            sent = sum(_powersgd_elements(shape, rank) for shape in self.flat.shapes)
            self._compressed_per_step = int(ring * sent * self.flat.grad_data.itemsize)
            self._plain_steps = POWERSGD_START

    def _step(self) -> None:
        self.optimizer.step()
        self.bytes_sent += self._per_step if self.iterations < self._plain_steps else self._compressed_per_step

    def close(self) -> None:
        """Leave torch.distributed's process group (collective)."""
        if not self.closed:
            torchdist.destroy_process_group()
        super().close()


#: DDP's ``start_powerSGD_iter``: plain all-reduces before PowerSGD starts (module docstring).
POWERSGD_START = 2


def _hook(spec: str | None) -> tuple[str, int]:
    """(the hook's name, PowerSGD's rank) of a ``compression`` spec; ("none", 0) for none.

    Raises:
        ArgumentError: a spec DDP has no hook for.
    """
    text = (spec or "none").strip().lower()
    name, colon, param = text.partition(":")
    if text in ("none", "fp16"):
        return text, 0
    if name == "powersgd":
        try:
            rank = int(param) if colon else inspect.signature(PowerSGD).parameters["rank"].default
        except ValueError:
            rank = 0
        if rank >= 1:
            return name, rank
    raise ArgumentError(
        f"ddp compresses with its communication hooks only: compression powersgd:R (R >= 1) or fp16, not {spec!r}"
    )


def _powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """Elements DDP's PowerSGD hook all-reduces for a gradient of ``shape``: P and Q of
    its shape[0] x rest matrix, or the gradient itself when that saves less than half."""
    rows = shape[0] if shape else 1
    size = math.prod(shape)
    cols = size // rows if rows else 0
    r = min(rows, cols, rank)
    return (rows + cols) * r if 2 * (rows + cols) * r < size else size


#: The peers by their ``--algorithm`` name.
PEERS: dict[str, type[algorithms.Algorithm]] = {"ddp": DDP}
