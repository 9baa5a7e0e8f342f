"""The peers in mpidl's harness: PyTorch DDP over gloo and Horovod over MPI, as training algorithms.

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

Horovod (``mpidl train --algorithm horovod``, :class:`Horovod`), where it is
installed (``pip install horovod`` builds it from source;
``jobs/peers/horovod.sh`` builds it for this virtualenv's torch and MPI): its
``DistributedOptimizer`` with its defaults (each gradient's all-reduce
started from a backward hook, fused into 64 MiB buffers by Horovod's
background thread, ``MPI_Allreduce`` of the MPI library mpi4py uses, the
average), over the algorithm's communicator (``hvd.init(comm=...)``), the
parameters broadcast from rank 0 as every run's are. ``compression``: none
or ``fp16`` (``hvd.Compression.fp16``); Horovod has no PowerSGD. The
optimizer is Horovod's subclass of the given one, with the same parameter
groups and a state of its own: :attr:`Horovod.optimizer` is that one.

BatchNorm statistics: DDP's default, rank 0's running statistics broadcast to
every worker before each forward pass, so every worker evaluates with rank
0's — unlike mpidl's gradient-averaging algorithms, which keep each worker's
own (:mod:`algorithms.flat`).

Counters: the communication happens inside ``backward()``, where mpidl's
transport does not see it, so :attr:`~algorithms.Algorithm.bytes_sent` is
gloo's ring all-reduce payload (Horovod: the same count for its
``MPI_Allreduce``, whose large-message algorithm sends as much), 2 (n-1)/n x the model's bytes per step (with
compression, of what the hook all-reduces: half of it for fp16; PowerSGD's
P, Q and uncompressed parameters after its first steps), an estimate (the
buffer broadcast and gloo's framing not counted), and
:attr:`~algorithms.Algorithm.comm_wait_s` stays 0. The emulated cluster's
interface counters measure the bytes that really crossed nodes.
"""

from __future__ import annotations

import importlib.util
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


class Horovod(algorithms.Algorithm):
    """Horovod's ``DistributedOptimizer`` behind the algorithm interface (module docstring).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        compression: None or "none", or "fp16" (``hvd.Compression.fp16``).

    Attributes:
        optimizer: Horovod's distributed optimizer wrapping the given one (its
            ``step()`` waits for the gradients' all-reduces, then updates).
    """

    name = "horovod"

    def __init__(
        self, model: Any, optimizer: Any, comm: MPI.Comm | None = None, *, compression: Any = None, **common: Any
    ) -> None:
        self.module, self.compression = model, compression
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        import torch

        if not isinstance(self.flat.params, torch.Tensor):
            raise ArgumentError("horovod trains torch models only (use --backend torch)")
        name = (self.compression or "none").strip().lower() if isinstance(self.compression, (str, type(None))) else ""
        if name not in ("none", "fp16"):
            raise ArgumentError(
                f"horovod compresses with hvd.Compression.fp16 only: compression fp16, not {self.compression!r}"
            )
        if importlib.util.find_spec("horovod") is None:
            raise ArgumentError("horovod is not installed (jobs/peers/horovod.sh builds it for this torch and MPI)")
        self._fp16 = name == "fp16"
        return (name,)

    def _start(self) -> None:
        import horovod.torch as hvd

        hvd.init(comm=self.comm)
        compression = hvd.Compression.fp16 if self._fp16 else hvd.Compression.none
        self.optimizer = hvd.DistributedOptimizer(
            self.optimizer, named_parameters=self.module.named_parameters(), compression=compression, op=hvd.Average
        )
        self._per_step = 2 * (self.size - 1) * self.flat.nbytes // self.size // (2 if self._fp16 else 1)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()`` (torch's default: the gradients set to None), as a
        Horovod script does: backward then writes fresh gradients, which Horovod
        all-reduces in place (with fp16, it replaces their storage with the decompressed
        average), so they never alias the flat gradient buffer."""
        self.optimizer.zero_grad()

    def _collect_grads(self) -> None:
        """Nothing: the gradients stay Horovod's (:meth:`zero_grad`), some still in flight
        until its optimizer's ``step()``."""

    def _step(self) -> None:
        self.optimizer.step()
        self.bytes_sent += self._per_step

    def close(self) -> None:
        """Shut Horovod down (collective; a later run may init it again)."""
        if not self.closed:
            import horovod.torch as hvd

            hvd.shutdown()
        super().close()


#: The peers by their ``--algorithm`` name.
PEERS: dict[str, type[algorithms.Algorithm]] = {"ddp": DDP, "horovod": Horovod}
