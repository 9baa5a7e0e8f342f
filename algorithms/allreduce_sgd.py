"""AllReduce-SGD: the synchronous (bulk-synchronous parallel) baseline.

Each step, on every worker i of n:

1. g_i = the local gradient at x (computed by the caller);
2. g = (1/n) sum_j g_j by all-reduces (average) of the flat gradient buffer,
   in place, bucket by bucket (:mod:`algorithms.buckets`), with any
   all-reduce algorithm of :data:`collectives.COLLECTIVES`;
3. x <- optimizer step with g (e.g. SGD with momentum).

Every worker applies the same averaged gradient to the same model, so the
models stay bitwise identical (the all-reduce gives every rank the same bits)
and the algorithm is mini-batch SGD with an n times larger batch.

Overlap (``overlap=True``): the all-reduce of a bucket starts, on a service
thread (:class:`~collectives.transport.background.Background`, over a private duplicate
of the communicator), as soon as backward has accumulated all its gradients
— a post-accumulate-grad hook per parameter reports them
(:class:`~algorithms.buckets.Tracker`) — while backward goes on computing
the earlier layers' gradients; ``step()`` launches the buckets still
unlaunched (parameters that got no gradient), waits for those in flight,
then runs the optimizer. The service thread touches gradients only, never
parameters, and is idle between steps. It is the default for torch models on
the CPU where every rank has a core to spare for it
(:func:`~algorithms.background.spare_cores`); where every core computes, its
work only takes cores from the computation (measured in
``docs/performance.rst``). Without overlap (numpy models,
``overlap=False``) ``step()`` all-reduces the same buckets, in the same
order, with the same algorithms, on the calling thread: both ways reduce
every element with the same operations in the same order, so they give
bitwise identical gradients, hence parameters. A bucket's algorithm is
resolved once, at construction, for its size ("auto": the cost model's
choice).

Shared memory: when every rank is on one node and the buckets' algorithm is
``shm`` (what ``auto`` picks there), the flat gradient of a torch model on
the CPU is allocated in shared memory, one vector per rank
(:class:`collectives.kernels.resident.SharedVectors`), and a bucket's
all-reduce runs there in place with two barriers, combining, dividing and
copying out block by block in cache (``shm`` copies the whole vector into
its segment and divides in a pass of its own). There
:meth:`AllReduceSGD.zero_grad` sets the gradients to None rather than
zeroing the buffer: backward writes fresh tensors (no zeroing pass, no pass
adding into the buffer), and each bucket reads this rank's part of them
where they are and copies in only the parts the peers reduce; ``step()``
points the gradients back at the buffer, which then holds the average. Each element is computed as ``shm`` computes
it, so the bits are those ``shm`` gives. :meth:`AllReduceSGD.close` moves the
gradients back into private memory. Without overlap, with a plain
``torch.optim.SGD``, the update is fused with that all-reduce (``fuse_update``,
:mod:`algorithms.fused_sgd`): the parameters and momentum live in shared memory
too, and the rank that averages a block of a bucket applies SGD's rule to it
for every rank, while it is in cache; the same bits as the optimizer's step,
its 5n element accesses per rank become 2n + 2n/q. Not where the workers keep
their own models (``broadcast_init=False``: one update does not fit them
all), and not where shared memory has no room for the parameters and
momentum besides the gradients (a small ``/dev/shm``: the update runs
unfused, and rank 0 warns).

Gradient accumulation over several backward passes: all but the last run
inside :meth:`AllReduceSGD.no_sync`, which keeps them from reporting; a
gradient accumulated twice outside it in one step is an error (its bucket may
already be in flight). :meth:`~algorithms.base.Algorithm.synchronize` runs
(or waits for) every bucket's all-reduce and leaves the average in the
gradients, to be clipped or unscaled before the update.

Compression (``compression="NAME[:PARAM]"``, :mod:`algorithms.compressed`):
each bucket is aggregated by a compressor of its own
(:meth:`collectives.compression.Compressor.allreduce`: the average of what
the ranks sent, bitwise identical on all ranks; PowerSGD is given the
bucket's matrices, :meth:`~algorithms.flat.FlatParams.layout`), with a
per-worker error-feedback memory per bucket
(:class:`~algorithms.error_feedback.ErrorFeedback`: on by default for
top-k and PowerSGD, ``error_feedback=`` switches it), on the calling thread
or, with overlap, on the service thread, in the same order either way; without
overlap and without a ``bucket_mb``, the whole gradient is one bucket (one
compressor, its collectives once per step). The
bucket's all-reduce algorithm is that of the linear compressors' all-reduces
(PowerSGD's P and Q, random-k's values). A compressed run uses the ordinary
flat gradient: never shared memory, where copying bytes costs less than
encoding them (measured in ``docs/performance.rst``). The memory is
algorithm state (:meth:`AllReduceSGD.state_dict`: ``residual``, and
``server`` for the compressors that encode the average again). Bytes per
step: each compressor's (its module docstring), per bucket. With sign and
top-k (error feedback on) and an optimizer with momentum, each worker
applies the momentum to its own gradient before compressing it, and the
optimizer steps without it (``local_momentum=``,
:mod:`algorithms.local_momentum`): error feedback's residual with momentum
after the aggregation made sign diverge. ``compression_start=K`` all-reduces
the first K steps uncompressed (a warm-up: the largest gradients come first).

Cost per step: one all-reduce of the model's size m bytes, in b buckets; with
the ring, 2(n-1) b alpha + 2 m (n-1)/n beta + m (n-1)/n gamma, and each
worker sends 2 m (n-1)/n bytes, the bandwidth lower bound. With overlap the
part of it that runs while backward computes the earlier gradients is off the
critical path (where a core is free for it). Reference: Valiant's
BSP model; Goyal et al., "Accurate, Large Minibatch SGD", 2017; buckets as in
Li et al., "PyTorch Distributed", VLDB 2020.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable
from zlib import crc32

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ArgumentError, as_flat, reduction
from collectives.compression import TopK
from collectives.errors import renamed, renamed_keyword
from collectives.kernels.resident import SharedVectors
from collectives.topology.layout import RanksPerNode, detected
from collectives.topology.layout import layout as node_layout
from collectives.transport import gpu, threads
from collectives.transport.background import Background
from collectives.transport.buffers import array_module
from collectives.transport.context import context

from . import events
from .background import spare_cores
from .base import Algorithm
from .buckets import DEFAULT_BUCKET_MB, Bucket, Tracker, plan
from .compressed import CompressedSlices, name_of, resolve
from .dgc import DGC
from .flat import TorchFlatParams
from .fused_sgd import SharedSGD, unfusable
from .join import Join
from .local_momentum import LocalMomentum, default_on, parameter_groups


class AllReduceSGD(Algorithm):
    """Average the gradients with all-reduces, bucket by bucket, then step the local optimizer.

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        collective: the all-reduce algorithm (a key of
            :data:`collectives.COLLECTIVES`; "auto" chooses by the cost model,
            per bucket size, resolved — and, on first use, calibrated — at
            construction).
        layout: ranks per node for the topology-aware all-reduce algorithms
            (one number or node sizes such as "3,1"); None detects it or
            reads ``MPIDL_RANKS_PER_NODE``.
        overlap: all-reduce each bucket during backward (module docstring).
            None: on for torch models on the CPU if every rank has a core to
            spare (:func:`~algorithms.background.spare_cores`), off otherwise.
            True needs a torch model; numpy models have no backward to
            overlap with.
        bucket_mb: the size in MiB at which a bucket is closed (a bucket
            exceeds it by less than its last parameter, as DDP's buckets do:
            :func:`~algorithms.buckets.plan`); the same buckets are used with and without
            overlap. None: :data:`~algorithms.buckets.DEFAULT_BUCKET_MB`, except
            that a compressed gradient without overlap is one bucket (each
            bucket costs a compressor collectives of its own, PowerSGD two
            latency-bound all-reduces, and without overlap buckets hide
            nothing: measured in ``docs/performance.rst``).
        compression: None (or "none"), or a compressor spec "NAME[:PARAM][@AGGREGATION]" of
            :data:`collectives.COMPRESSORS` for every bucket (module docstring).
        error_feedback: keep each worker's compression residual for its next
            gradient (None: the compressor's default, on for top-k and PowerSGD).
        local_momentum: each worker applies the SGD optimizer's momentum and
            weight decay to its own gradient before compressing it, and the
            optimizer steps without them
            (:mod:`algorithms.local_momentum`). None: on for sign and top-k
            where the optimizer has momentum
            (:func:`~algorithms.local_momentum.default_on`). Needs a compression
            and an SGD optimizer; finish a step with :meth:`step`.
        compression_start: the first steps are all-reduced uncompressed, as
            DDP's PowerSGD hook does its first ``start_powerSGD_iter`` (local
            momentum, where on, is applied throughout); 0: compress from the start.
        clip_norm: Deep Gradient Compression's local clipping (:mod:`algorithms.dgc`):
            each tensor of a worker's gradient is scaled down to this l2 norm
            before momentum and compression where it exceeds it; None: no clipping.
        momentum_masking: DGC's momentum factor masking: the local momentum of
            the elements top-k sent is zeroed. None: on for top-k with local
            momentum (it kept the accuracy on Fashion-MNIST where top-k without
            it lost 1-1.4 points: ``docs/performance.rst``), off otherwise.
        sparsity_warmup: DGC's warm-up: top-k keeps 25 %, 6.25 %, ... of each
            layer, this many steps each, before its ratio; 0: none.
        seed: seeds the compressors' random numbers (qsgd, random-k, PowerSGD).
        fuse_update: with the gradients in shared memory and no overlap, each rank
            applies the SGD update to the part of every bucket it reduces, for every
            rank (:mod:`algorithms.fused_sgd`: the same bits, a fraction of the
            memory traffic). None: wherever that holds, the optimizer is a
            plain ``torch.optim.SGD`` (:func:`~algorithms.fused_sgd.unfusable`)
            and every worker starts from one model (``broadcast_init``), and
            unfused, with a warning on rank 0, where shared memory has no room
            for the parameters and momentum (a small ``/dev/shm``); True:
            there, else an ArgumentError saying why not (an OSError on every
            rank where the memory lacks).
        algorithm: the old name of ``collective`` (deprecated).

    Attributes:
        choice: for "auto", the cost model's choice for the whole model's size
            (:func:`collectives.explain`), else None.
        overlap: whether buckets are all-reduced during backward.
        buckets: the bucket plan (:func:`algorithms.buckets.plan`), in launch order.
        bucket_collectives: the all-reduce algorithm of each bucket.
        resident: whether the flat gradient lives in shared memory, where the
            ``shm`` buckets are all-reduced in place (module docstring).
        compression: the buckets' compressors and error-feedback memory
            (:class:`~algorithms.compressed.CompressedSlices`), or None.
        local_momentum: the workers' momentum
            (:class:`~algorithms.local_momentum.LocalMomentum`), or None.
        fused_update: the update fused with the all-reduce
            (:class:`~algorithms.fused_sgd.SharedSGD`), or None.
    """

    name = "allreduce"
    synchronous = True

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        collective: str = collectives.DEFAULT_COLLECTIVE,
        layout: RanksPerNode = None,
        overlap: bool | None = None,
        bucket_mb: float | None = None,
        compression: str | None = None,
        error_feedback: bool | None = None,
        local_momentum: bool | None = None,
        compression_start: int = 0,
        clip_norm: float | None = None,
        momentum_masking: bool | None = None,
        sparsity_warmup: int = 0,
        seed: int = 0,
        fuse_update: bool | None = None,
        algorithm: str | None = None,
        **common: Any,
    ) -> None:
        self.collective = renamed_keyword(
            "AllReduceSGD", "algorithm", "collective", algorithm, collective, collectives.DEFAULT_COLLECTIVE
        )
        self.layout = layout
        self.overlap_arg, self.bucket_mb = overlap, bucket_mb
        self.compression_arg, self.error_feedback_arg, self.seed = compression, error_feedback, seed
        self.compression: CompressedSlices | None = None
        self.local_momentum_arg = local_momentum
        self.compression_start = compression_start
        self.dgc_args = (clip_norm, momentum_masking, sparsity_warmup)
        self.dgc: DGC | None = None
        self.local_momentum: LocalMomentum | None = None
        self.fuse_update_arg = fuse_update
        self.fused_update: SharedSGD | None = None
        self._background: Background | None = None
        self._shared: SharedVectors | None = None
        self._hooks: list[Any] = []
        self._sync = True
        self._joining: Join | None = None  # inside join() (algorithms.join)
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if self.collective not in collectives.COLLECTIVES:
            raise ArgumentError(
                f"unknown collective {self.collective!r}; valid collectives: {', '.join(collectives.COLLECTIVES)}"
            )
        if self.layout is not None:
            node_layout(self.comm, self.layout)  # parses the override: local
        mb = DEFAULT_BUCKET_MB if self.bucket_mb is None else self.bucket_mb
        if isinstance(mb, bool) or not (isinstance(mb, (int, float)) and math.isfinite(mb) and mb > 0):
            raise ArgumentError(f"bucket_mb must be a positive number of MiB, got {self.bucket_mb!r}")
        hooked = isinstance(self.flat, TorchFlatParams)
        if self.overlap_arg and not hooked:
            raise ArgumentError(
                "overlap needs a torch model (its gradients report through autograd hooks); "
                "a numpy model's gradient is all-reduced in step()"
            )
        if self.overlap_arg:
            threads.require_multiple("overlap all-reduces on a service thread")
        self._may_overlap = hooked and threads.multiple() and type(self.flat.grad_data) is np.ndarray
        cap = max(1, int(mb * 2**20) // self.flat.grad_data.itemsize)
        self.buckets = plan(self.flat.sizes, self.flat.trainable, cap)
        bounds = np.array([(b.start, b.stop) for b in self.buckets], np.int64)
        self._compression = resolve(self.compression_arg, self.error_feedback_arg, self.flat.layout())
        self._local = self._resolve_local_momentum()
        start = self.compression_start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ArgumentError(f"compression_start must be a number of steps >= 0, got {start!r}")
        if start and self._compression is None:
            raise ArgumentError("compression_start needs a compression (the steps before it are uncompressed)")
        self.dgc = self._resolve_dgc()
        self._unfusable = self._why_unfusable(hooked)
        if self.fuse_update_arg and self._unfusable:
            raise ArgumentError(f"fuse_update=True, but {self._unfusable}")
        return (
            self.collective,
            self.layout,
            self.overlap_arg,
            self.bucket_mb,
            crc32(bounds.tobytes()),
            self._compression,
            self.seed if self._compression else None,
            self._local,
            start,
            None if self.dgc is None else (self.dgc.clip_norm, self.dgc.masking, self.dgc.warmup),
            self.fuse_update_arg,
            self._unfusable is None,
        )

    def _why_unfusable(self, hooked: bool) -> str | None:
        """Why the update cannot be fused with the all-reduce, as far as the options and
        the optimizer tell (local; :meth:`_start` knows the rest), or None."""
        arg = self.fuse_update_arg
        if arg is not None and not isinstance(arg, bool):
            raise ArgumentError(f"fuse_update must be None, True or False, got {arg!r}")
        if not hooked:
            return "the model is not a torch model"
        if self._compression is not None:
            return "the gradient is compressed"
        if self.overlap_arg:
            return "the buckets are all-reduced during backward (overlap)"
        if not self.broadcast_init:
            return (
                "the workers keep their own models (broadcast_init=False), and the rank that reduces "
                "a block would write its own update of it into every worker's model"
            )
        return unfusable(self.optimizer)

    def _resolve_dgc(self) -> DGC | None:
        """Deep Gradient Compression's switches (:mod:`algorithms.dgc`), checked; None if all are off."""
        clip_norm, masking, warmup = self.dgc_args
        if masking is not None and not isinstance(masking, bool):
            raise ArgumentError(f"momentum_masking must be None, True or False, got {masking!r}")
        topk = self._compression is not None and name_of(self._compression[0]) == "topk"
        if clip_norm is not None and self._compression is None:
            raise ArgumentError("clip_norm clips each worker's gradient before compression: it needs a compression")
        if warmup and not topk:
            raise ArgumentError("sparsity_warmup warms top-k's sparsity up: it needs compression topk:RATIO")
        if masking and not (topk and self._local):
            raise ArgumentError(
                "momentum_masking zeroes the local momentum of the elements top-k sent: it needs compression "
                "topk:RATIO and local momentum"
            )
        if masking is None:
            masking = topk and self._local
        if clip_norm is None and not masking and not warmup:
            return None
        target = collectives.compressor(self._compression[0]) if self._compression is not None else None
        return DGC(clip_norm, bool(masking), warmup, target.ratio if isinstance(target, TopK) else 1.0)

    def _resolve_local_momentum(self) -> bool:
        """Whether the workers apply momentum before compressing (the ``local_momentum``
        argument, checked; None: :func:`~algorithms.local_momentum.default_on`)."""
        arg = self.local_momentum_arg
        if arg is not None and not isinstance(arg, bool):
            raise ArgumentError(f"local_momentum must be None, True or False, got {arg!r}")
        if arg and self._compression is None:
            raise ArgumentError(
                "local_momentum needs a compression: uncompressed, the optimizer's momentum on the "
                "average is the same update"
            )
        on = arg if arg is not None else default_on(self._compression, self.optimizer)
        if on:
            parameter_groups(self.optimizer, self.flat)  # an SGD, or ArgumentError now
        return on

    def _start(self) -> None:
        arg = self.overlap_arg
        self.overlap = bool(arg) if arg is not None else spare_cores(self.comm, self._may_overlap)
        if self.bucket_mb is None and self._compression is not None and not self.overlap:
            self.buckets = plan(self.flat.sizes, self.flat.trainable, max(1, self.flat.size))
        device = self.flat.memory
        dtype = self.flat.dtype
        self.choice = (
            collectives.explain(self.flat.nbytes, self.comm, layout=self.layout, device=device, dtype=dtype, op="avg")
            if self.collective == "auto"
            else None
        )
        itemsize = self.flat.grad_data.itemsize
        resolved: dict[int, str] = {}
        for b in self.buckets:
            if self.collective == "auto" and b.size not in resolved:
                choice = collectives.explain(
                    b.size * itemsize,
                    self.comm,
                    layout=self.layout,
                    device=device,
                    validate=False,
                    dtype=dtype,
                    op="avg",
                )
                resolved[b.size] = choice.algorithm
        self.bucket_collectives = tuple(resolved.get(b.size, self.collective) for b in self.buckets)
        self._frozen = [p for p, _ in getattr(self.flat, "views", ()) if not p.requires_grad]
        # With overlap, the service thread's own communicator: the caller may use self.comm meanwhile.
        self._comm = self.comm.Dup() if self.overlap else self.comm
        if self._compression is not None:
            spec, feedback = self._compression
            bounds = [(b.start, b.stop) for b in self.buckets]
            self.compression = CompressedSlices(spec, feedback, self.flat.grads, bounds, self.flat.layout(), self.seed)
            if self._local:
                self.local_momentum = LocalMomentum(self.optimizer, self.flat)
        elif "shm" in self.bucket_collectives and self._resident():
            self._red = reduction("avg", self.flat.dtype)
            self._sum = reduction("sum", self.flat.dtype)
            self._shared = SharedVectors(context(self._comm).comm, self.flat.size, self.flat.grad_data.dtype)
            self._move_grads(self._shared.mine)
        self.resident = self._shared is not None
        grads = self.flat.grads
        self._slices = [grads[b.start : b.stop] for b in self.buckets]
        offsets = np.cumsum((0, *self.flat.sizes))
        self._offsets = [int(o) for o in offsets[:-1]]
        #: Per bucket, (start, stop) of each of its parameters in the flat buffers.
        self._spans = [[(int(offsets[i]), int(offsets[i + 1])) for i in b.params] for b in self.buckets]
        self._bucketed = [i for b in self.buckets for i in b.params]
        self._start_fused_update()
        if not self.overlap:
            return
        context(self._comm)
        self._background = Background(f"allreduce-buckets-rank{self.rank}", gpu.device_of(self.flat.grad_data))
        self._tracker = Tracker(self.buckets, len(self.flat.sizes), self._launch)
        flat = self.flat
        assert isinstance(flat, TorchFlatParams)  # overlap is resolved for torch models only
        for b in self.buckets:
            for i in b.params:
                self._hooks.append(flat.views[i][0].register_post_accumulate_grad_hook(self._ready(i)))

    def _start_fused_update(self) -> None:
        """Fuse the update with the all-reduce where :mod:`algorithms.fused_sgd` applies:
        the gradients in shared memory, every bucket's algorithm ``shm``, no overlap."""
        why = self._unfusable
        if why is None and self.overlap:
            why = "the buckets are all-reduced during backward (overlap)"
        if why is None and (self._shared is None or set(self.bucket_collectives) != {"shm"}):
            why = "the gradients are not all-reduced in shared memory (one node, every bucket shm)"
        if why is not None or self.fuse_update_arg is False:
            if self.fuse_update_arg:
                raise ArgumentError(f"fuse_update=True, but {why}")
            return
        assert isinstance(self.flat, TorchFlatParams)  # else unfusable
        try:
            self.fused_update = SharedSGD(context(self._comm).comm, self.optimizer, self.flat, self._bucketed)
        except OSError as exc:  # raised on every rank (node_memory): every rank falls back
            if self.fuse_update_arg:
                raise
            if self.rank == 0:
                warnings.warn(
                    "mpidl: the SGD update is not fused with the all-reduce, which needs the parameters "
                    f"and momentum in shared memory too: {exc}",
                    stacklevel=2,
                )

    def _resident(self) -> bool:
        """Whether the gradients can live in shared memory (module docstring): a torch
        model on the CPU, two or more ranks, all on one node, by the layout and really."""
        return (
            isinstance(self.flat, TorchFlatParams)
            and type(self.flat.grad_data) is np.ndarray
            and self.size > 1
            and node_layout(self.comm, self.layout).nodes == 1
            and detected(context(self.comm)).nodes == 1
        )

    def _move_grads(self, buf: np.ndarray) -> None:
        """Make the host array ``buf`` the flat gradient buffer (torch models)."""
        import torch

        assert isinstance(self.flat, TorchFlatParams)
        tensor = torch.from_numpy(buf)
        self.flat.move_grads(tensor if tensor.dtype == self.flat.grads.dtype else tensor.view(self.flat.grads.dtype))

    @contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside accumulate their gradients locally, without
        communicating; the next backward pass outside (the last of the step) starts
        the buckets' all-reduces. Without overlap it changes nothing: ``step()``
        communicates. ``enabled=False`` makes it no context at all (``with
        algo.no_sync(enabled=not last):`` around every pass of a step)."""
        self._sync = not enabled
        try:
            yield
        finally:
            self._sync = True

    def _ready(self, i: int) -> Callable[[Any], None]:
        """The hook of parameter ``i``: its gradient is final."""

        def hook(_: Any) -> None:
            if self._sync:
                self._tracker.report(i)

        return hook

    def zero_grad(self) -> None:
        """Zero the gradients. With the gradients in shared memory, set them to None
        instead (as ``optimizer.zero_grad()`` does): backward then writes fresh ones
        and each bucket's all-reduce reads them where they are, which saves zeroing
        the flat buffer and adding into it; ``step()`` points them back at it."""
        if self._shared is None:
            super().zero_grad()
            return
        self.flat.drop_grads(self._bucketed)

    def _collect_grads(self) -> None:
        if self._shared is None:
            super()._collect_grads()

    def _prepare(self, bucket: Bucket) -> Sequence[tuple[int, Any]]:
        """Ready ``bucket``'s gradients for its all-reduce (on the calling thread): in the
        flat buffer, or, for an all-reduce in shared memory, where backward left them,
        as (offset, array) pieces for :meth:`SharedVectors.allreduce`."""
        flat = self.flat
        if self._shared is None or self.bucket_collectives[bucket.index] != "shm":
            for i in bucket.params:
                flat.collect_grad(i)
            return ()
        pieces = []
        for i in bucket.params:
            grad = flat.outside_grad(i)
            if grad is not None:
                pieces.append((self._offsets[i], as_flat(grad).data))
        return pieces

    def _launch(self, bucket: Bucket) -> None:
        assert self._background is not None
        self._background.submit(self._reduce, bucket, self._prepare(bucket))

    def _reduce(
        self, bucket: Bucket, pieces: Sequence[tuple[int, Any]], finish: Callable[..., None] | None = None
    ) -> None:
        """All-reduce (average) ``bucket``'s slice of the flat gradient, in place
        (``pieces``: see :meth:`_prepare`; ``finish``: the fused update, see
        :meth:`SharedVectors.allreduce`); a recorded timeline gets it as a span."""
        recorder = events.active
        if recorder is None:
            self._reduce_bucket(bucket, pieces, finish)
            return
        t0 = time.perf_counter()
        self._reduce_bucket(bucket, pieces, finish)
        k = bucket.index
        recorder.add(
            f"bucket {k}",
            events.COMMUNICATION,
            t0,
            time.perf_counter(),
            step=self.iterations,
            bucket=k,
            bytes=bucket.size * self.flat.grad_data.itemsize,
            collective=self.bucket_collectives[k],
        )

    def _reduce_bucket(
        self, bucket: Bucket, pieces: Sequence[tuple[int, Any]], finish: Callable[..., None] | None
    ) -> None:
        """:meth:`_reduce`'s all-reduce."""
        joining = self._joining is not None  # then sum: the step divides by the workers still in
        if self._shared is not None and self.bucket_collectives[bucket.index] == "shm":
            self._shared.allreduce(bucket.start, bucket.stop, self._sum if joining else self._red, pieces, finish)
            return
        dgc, k = self.dgc, bucket.index
        if dgc is not None and dgc.clip_norm is not None:
            dgc.clip(self.flat.grads, self._spans[k])
        if self.local_momentum is not None:
            self.local_momentum.apply(bucket.params)
        if self.compression is not None and self.iterations >= self.compression_start:
            if dgc is not None and dgc.warmup:
                ratio = dgc.ratio(self.iterations - self.compression_start)
                self.compression.respec(k, f"topk:{ratio:g}")
            self.compression.allreduce(k, self._slices[k], self._comm, "avg", self.bucket_collectives[k])
            if dgc is not None and dgc.masking and self.local_momentum is not None:
                compressor = self.compression.feedback[k].compressor
                assert isinstance(compressor, TopK)  # masking is for top-k only
                self.local_momentum.mask(bucket.start, compressor.selected)
            return
        collectives.allreduce(
            self._slices[bucket.index],
            self._comm,
            "sum" if joining else "avg",
            self.bucket_collectives[bucket.index],
            validate=False,
            layout=self.layout,
        )

    def _step(self) -> None:
        fused = self.fused_update
        if fused is None or self._joining is not None:  # joining: the average comes after the sum
            self._synchronize()
            self._update()
            return
        fused.begin()
        self._synchronize(fused.update)
        fused.end()

    def _update(self) -> None:
        if self.local_momentum is None:
            self.optimizer.step()
            return
        with self.local_momentum.plain():
            self.optimizer.step()

    def _synchronize(self, finish: Callable[..., None] | None = None) -> None:
        """All-reduce every bucket (``finish``: the fused update, without overlap)."""
        if any(p.requires_grad for p in self._frozen):
            raise RuntimeError(
                "a parameter frozen when the algorithm was built now requires a gradient, which no "
                "bucket holds; set requires_grad before building the algorithm"
            )
        joining = self._joining
        overlapped = self._background is not None
        with self._communicating(*(("wait for buckets", events.WAIT) if overlapped else ())):
            count = joining.count(active=True) if joining is not None else self.size
            self._reduce_buckets(finish)
            if joining is not None:  # the buckets hold sums: average over the workers still in
                average = reduction("avg", self.flat.dtype, array_module(self.flat.grad_data))
                for b in self.buckets:
                    average.finalize(self.flat.grad_data[b.start : b.stop], count)
        if self._shared is not None:
            self.flat.point_grads(self._bucketed)

    def _reduce_buckets(self, finish: Callable[..., None] | None = None) -> None:
        """All-reduce every bucket in order, here or on the service thread (``finish``:
        the fused update, without overlap)."""
        if self._background is None:
            for b in self.buckets:
                self._reduce(b, self._prepare(b), finish)
        else:
            self._tracker.flush()
            self._tracker.reset()
            self._drain()

    def join(self) -> Join:
        """A context for uneven inputs (:mod:`algorithms.join`, DDP's ``Join``): inside
        it, a worker that leaves the block answers the steps of the workers still in,
        which average their gradients over themselves, until every worker has left;
        then every worker takes the model, optimizer state and step count of the last
        one in. Every worker enters it at the same step, before its backward pass::

            with algo.join():
                for x, y in my_batches:      # as many as this worker has
                    ...backward...
                    algo.step()              # or opt.step()

        Raises:
            ArgumentError: with compression or ``average_buffers=True`` (the workers
                out of data would be counted in them).
            RuntimeError: closed, already inside ``join()``, or a backward pass of
                this step has launched buckets already.
        """
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._joining is not None:
            raise RuntimeError("join() inside join()")
        if self.compression is not None:
            raise ArgumentError("join() averages over the workers still in; compressed all-reduces cannot")
        if self.buffer_averaging:
            raise ArgumentError(
                "join() with average_buffers=True: the buffers' average would count the workers out of "
                "data; call average_buffers() after the join() block instead"
            )
        if self._background is not None and self._tracker.launched:
            raise RuntimeError("enter join() before the backward pass: this step's buckets are in flight")
        return Join(self)

    def _join_starts(self, join: Join) -> None:
        """From now on steps count the workers still in (:class:`~algorithms.join.Join`)."""
        self._joining = join

    def _joined(self) -> None:
        """Every worker has joined, or the join() block was left by an exception."""
        self._joining = None

    def _shadow(self) -> None:
        """Answer a step of the workers still in: zero gradients into the step's
        all-reduces; no update (the joined worker takes the state of the last one in)."""
        self.flat.zero_grad()
        self.flat.point_grads(range(len(self.flat.sizes)))
        self._reduce_buckets()

    def _drain(self) -> None:
        """Wait for every bucket in flight and count its bytes; re-raise the first failure."""
        assert self._background is not None
        failure: BaseException | None = None
        while self._background.pending:
            try:
                self.bytes_sent += self._background.result()[1]
            except BaseException as exc:  # every result is taken before one is raised
                failure = failure or exc
        if failure is not None:
            raise failure

    def state_dict(self) -> dict[str, Any]:
        """The counters and, with error feedback, this worker's memories of what
        compression dropped (:meth:`algorithms.compressed.CompressedSlices.state_dict`);
        with local momentum, its velocity (:meth:`algorithms.local_momentum.LocalMomentum.state_dict`)."""
        extra = self.compression.state_dict() if self.compression is not None else {}
        if self.local_momentum is not None:
            extra.update(self.local_momentum.state_dict())
        return {**super().state_dict(), **extra}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        if self.compression is not None:
            self.compression.load_state_dict(state)
        if self.local_momentum is not None:
            self.local_momentum.load_state_dict(state)

    def close(self) -> None:
        """Remove the hooks, finish what is in flight, stop the thread, move the gradients
        out of shared memory, free the communicator."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.local_momentum is not None:
            self.local_momentum.close()
        if self._background is not None:
            try:
                # A backward pass without a step left buckets in flight on some rank: every rank
                # launches the rest (the same buckets, in the same order), so none waits in vain.
                if context(self.comm).comm.allreduce(self._tracker.launched, op=MPI.MAX):
                    self._tracker.flush()
                self._drain()
            finally:
                self._background.close()
                self._background = None
        if self.fused_update is not None:
            self.fused_update.close()
            self.fused_update = None
        if self._shared is not None:
            self._move_grads(self._shared.mine.copy())
            self._shared.free()
            self._shared = None
        if self._comm is not self.comm:
            self._comm.Free()
            self._comm = self.comm
        super().close()

    @property
    def bucket_algorithms(self) -> tuple[str, ...]:
        """The old name of :attr:`bucket_collectives` (deprecated: a ``DeprecationWarning``)."""
        renamed("AllReduceSGD", "the attribute bucket_algorithms", "bucket_collectives")
        return self.bucket_collectives
