"""Gradient buckets: the flat gradient cut into slices, each communicated once its gradients are final.

Gradient-averaging algorithms need not wait for the whole backward pass: the
last layers' gradients are final long before the first layers' are. As in
PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020) and Horovod's tensor fusion, the
gradients are grouped into *buckets*, and a bucket's collective may start as
soon as all its gradients have been accumulated, while backward computes the
rest.

Plan (:func:`plan`): the parameters, in reverse registration order (roughly
the order in which backward finishes their gradients), fill a bucket until
it holds ``cap`` elements or more, as DDP fills its buckets: so a bucket
exceeds the cap by less than its last parameter, and a layer's bias, final
with its weight, travels with it rather than in a bucket of its own (where
every bucket costs a latency-bound collective: measured in
``docs/performance.rst``). A frozen parameter belongs to no bucket and ends
the current one. The flat gradient (:mod:`algorithms.flat`) holds the gradients one after
the other in registration order, so every bucket is one contiguous slice
``[start, stop)`` of it: a bucket's all-reduce, or a compressor's encoding,
runs on a view, in place, with nothing packed or unpacked. A numpy model is
one parameter, hence one bucket.

Readiness (:class:`Tracker`): each trainable parameter reports once per step
that its gradient is final (torch: ``Tensor.register_post_accumulate_grad_hook``);
a bucket is ready when all its parameters have reported. Buckets are launched
strictly in plan order, bucket k only after buckets 0..k-1, so every rank
issues its collectives in the same order whatever order autograd finishes the
gradients in (a rank-dependent order would pair the wrong messages, or hang).
A parameter that gets no gradient in this backward pass never reports; the
step's :meth:`Tracker.flush` launches whatever is left, in order, so an unused
parameter costs overlap, never a hang. A parameter that reports twice in one
step (a second backward pass adding to gradients that may be in flight) is an
error: accumulating over several backward passes must keep all but the last
from reporting (e.g. :meth:`AllReduceSGD.no_sync <algorithms.allreduce_sgd.AllReduceSGD.no_sync>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

#: Default bucket size in MiB (:mod:`algorithms.allreduce_sgd` measured its choice).
DEFAULT_BUCKET_MB = 4.0


@dataclass(frozen=True)
class Bucket:
    """One slice ``[start, stop)`` of the flat gradient: the gradients of ``params``
    (indices in registration order, descending), communicated together.

    Attributes:
        index: its place in the plan (the order of launch).
        start, stop: element offsets into the flat gradient.
        params: the parameters whose gradients it holds.
    """

    index: int
    start: int
    stop: int
    params: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.stop - self.start


def plan(sizes: Sequence[int], trainable: Sequence[bool], cap: int) -> tuple[Bucket, ...]:
    """Buckets of ``cap`` elements or more (the last may hold fewer; module docstring), in launch order.

    Args:
        sizes: every parameter's element count, in registration order.
        trainable: whether each parameter gets a gradient (frozen ones are in no bucket).
        cap: the size at which a bucket is closed, in elements.

    Raises:
        ValueError: ``cap`` < 1, or ``sizes`` and ``trainable`` of different lengths.
    """
    if cap < 1:
        raise ValueError(f"a bucket must hold at least one element, got a cap of {cap}")
    if len(sizes) != len(trainable):
        raise ValueError(f"{len(sizes)} parameter sizes but {len(trainable)} trainable flags")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + int(n))
    buckets: list[Bucket] = []
    members: list[int] = []

    def close() -> None:
        if members:
            buckets.append(Bucket(len(buckets), offsets[members[-1]], offsets[members[0] + 1], tuple(members)))
            members.clear()

    for i in reversed(range(len(sizes))):
        if not trainable[i]:
            close()
            continue
        members.append(i)
        if offsets[members[0] + 1] - offsets[i] >= cap:
            close()
    close()
    return tuple(buckets)


class Tracker:
    """Which buckets' gradients are final in the current step, and which are launched.

    Args:
        buckets: the plan (:func:`plan`).
        nparams: the number of parameters (trainable or not).
        launch: called with each bucket, once per step, in plan order.

    Attributes:
        launched: buckets launched in this step (the first ``launched`` of the plan).
    """

    def __init__(self, buckets: Sequence[Bucket], nparams: int, launch: Callable[[Bucket], None]) -> None:
        self.buckets = tuple(buckets)
        self._launch = launch
        self._bucket_of = [-1] * nparams
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self.reset()

    def reset(self) -> None:
        """Start a new step: no gradient reported, no bucket launched."""
        self._missing = [len(b.params) for b in self.buckets]
        self._reported = [False] * len(self._bucket_of)
        self.launched = 0

    def report(self, i: int) -> None:
        """Parameter ``i`` (one of a bucket's) has its final gradient: launch, in order, every bucket that is now
        ready and whose predecessors are launched.

        Raises:
            RuntimeError: parameter ``i`` already reported in this step.
        """
        if self._reported[i]:
            raise RuntimeError(
                f"parameter {i}'s gradient was accumulated twice in one step, after its bucket may "
                "have been sent; accumulate over several backward passes inside no_sync() and "
                "leave only the last one outside"
            )
        self._reported[i] = True
        self._missing[self._bucket_of[i]] -= 1
        while self.launched < len(self.buckets) and not self._missing[self.launched]:
            self._next()

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order: the step treats the gradients
        that never reported (unused parameters) as final."""
        while self.launched < len(self.buckets):
            self._next()

    def _next(self) -> None:
        bucket = self.buckets[self.launched]
        self.launched += 1
        self._launch(bucket)
