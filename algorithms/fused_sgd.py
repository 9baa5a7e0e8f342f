"""SGD's update fused with the shared-memory all-reduce: each rank updates the part it reduces.

On one node AllReduce-SGD keeps every rank's gradient in shared memory, and
each rank reduces one part of every bucket
(:class:`collectives.kernels.resident.SharedVectors`); then each of the q
ranks runs the optimizer over the whole model, the same update on the same
values, q times the optimizer's memory traffic on the node. :class:`SharedSGD`
keeps every rank's parameters (its flat state, :mod:`algorithms.flat`) and
SGD momentum in shared memory too, one vector per rank, and the rank that
reduced a block of the gradient applies torch's SGD rule to that block at
once, while it is in cache, and writes the new parameters and momentum into
every rank's vectors. Per element, with the hyper-parameters of the
parameter's group, read at every step (a schedule may change them):

    d = g  (-g with maximize)
    d = d + weight_decay * x
    b = d  (first step)  or  b = momentum * b + (1 - dampening) * d
    d = d + momentum * b  (Nesterov)  or  d = b
    x = x - lr * d

with the torch operations, in the order, of ``torch.optim.SGD``'s step (its
single-tensor implementation, torch's default on the CPU), so that the bits
are those of the unfused step (tested).

Nothing is partitioned: each rank keeps the whole model and the whole
momentum, the optimizer's ``state[p]["momentum_buffer"]`` are views of the
rank's momentum vector, and the gradients hold the average after the step,
as without fusion. So the optimizer may still step itself (after
:meth:`~algorithms.base.Algorithm.synchronize`, e.g. through a
``GradScaler``), ``optimizer.state_dict()`` holds the momentum, and a state
loaded into the optimizer is copied into shared memory at the next step
(:meth:`SharedSGD.begin`). The optimizer's own ``step()`` is still called once
per fused step, after the update, with the gradients detached for the call so
that it applies nothing: what wraps or watches it (an LR scheduler's check that
it ran, step post-hooks) sees the step; a step pre-hook sees it after the update.

Traffic per rank and step, for n elements on q ranks: it reads the q
contributions, the parameters and the momentum of its n/q elements and
writes the parameters and momentum of q ranks, about 2n + 2n/q element
accesses beyond the all-reduce's, against 5n for the optimizer over the
whole model. Measured on the development machine, 2 ranks, MLP
64-2048-2048-10 (``docs/performance.rst``): the step 1.04-1.08x the local
step against 1.13-1.17x unfused where memory bandwidth binds; the same as
unfused where it does not. The writes into the peers' copies are not counted
as bytes sent (:func:`collectives.transport.p2p.count_sent`): they stand for the
update each rank would otherwise compute itself, not for communication; the
step counts the all-reduce's bytes, as unfused.

Only ``torch.optim.SGD`` without ``fused`` or ``differentiable`` qualifies
(:func:`unfusable`); AllReduce-SGD uses it where every bucket is all-reduced in
shared memory on the calling thread and every worker holds the same model
(:mod:`algorithms.allreduce_sgd`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.kernels.resident import SharedVectors

from .flat import TorchFlatParams


def unfusable(optimizer: Any) -> str | None:
    """Why ``optimizer``'s update cannot be fused with the all-reduce, or None if it can."""
    import torch

    if type(optimizer) is not torch.optim.SGD:
        return f"the optimizer is {type(optimizer).__name__}, not torch.optim.SGD"
    flags = [key for group in optimizer.param_groups for key in ("fused", "differentiable") if group.get(key)]
    if flags:
        return f"the optimizer's step is {flags[0]} (fused=True or differentiable=True)"
    return None


class SharedSGD:
    """Parameters and momentum of every rank of ``comm`` (a node communicator) in shared
    memory, updated by the rank that reduces each part (module docstring); collective to
    create and to :meth:`close`.

    Args:
        comm: the node communicator of the shared-memory all-reduce.
        optimizer: the ``torch.optim.SGD`` over the model (:func:`unfusable` says None).
        flat: the model's flat parameters; its state moves into shared memory.
        indices: the parameters the update covers (those in a bucket).

    Raises:
        OSError: on every rank, where the shared memory cannot be allocated
            (:func:`collectives.kernels.resident.node_memory`); nothing is kept.
    """

    def __init__(self, comm: MPI.Comm, optimizer: Any, flat: TorchFlatParams, indices: Sequence[int]) -> None:
        self.optimizer, self.flat = optimizer, flat
        self.rank = comm.Get_rank()
        dtype = flat.state_data.dtype
        self._state = SharedVectors(comm, flat.state_data.shape[0], dtype)
        try:
            self._momentum = SharedVectors(comm, flat.size, dtype)
        except OSError:  # on every rank (a full /dev/shm): release what was allocated
            self._state.free()
            raise
        flat.move_state(self._tensor(self._state.mine))
        self._x = [self._tensor(v) for v in self._state.vectors]
        self._m = [self._tensor(v) for v in self._momentum.vectors]
        self._peers = [k for k in range(len(self._x)) if k != self.rank]
        offsets = np.cumsum((0, *flat.sizes))
        self._offsets = [int(o) for o in offsets[:-1]]
        self._ends = [int(o) for o in offsets[1:]]
        self._index = {id(p): i for i, (p, _) in enumerate(flat.views)}
        self._indices = tuple(indices)
        mine = self._m[self.rank]
        self._views = [mine[a:b].view_as(p) for (p, _), a, b in zip(flat.views, self._offsets, self._ends)]
        self._hyper: list[tuple[float, float, float, float, bool, bool] | None] = [None] * len(flat.sizes)
        self._started = [False] * len(flat.sizes)
        self._scratch = self._tensor(np.empty(0, dtype))

    def _tensor(self, array: np.ndarray) -> Any:
        """``array`` as a torch tensor of the model's dtype (sharing its memory)."""
        import torch

        tensor = torch.from_numpy(array)
        return tensor if tensor.dtype == self.flat.grads.dtype else tensor.view(self.flat.grads.dtype)

    def begin(self) -> None:
        """Read every covered parameter's hyper-parameters and momentum state for this
        step: a momentum buffer the optimizer holds elsewhere (a loaded state) is copied
        into this rank's momentum vector first. Call it on every rank before the
        all-reduce (whose first barrier orders it before any peer's update)."""
        hyper = self._hyper
        for group in self.optimizer.param_groups:
            lr = group["lr"]
            values = (
                float(lr),
                float(group["momentum"]),
                float(group["dampening"]),
                float(group["weight_decay"]),
                bool(group["nesterov"]),
                bool(group.get("maximize", False)),
            )
            for p in group["params"]:
                i = self._index.get(id(p))  # None: added to the optimizer later; its own step updates it
                if i is not None:
                    hyper[i] = values
        for i in self._indices:
            p, view = self.flat.views[i][0], self._views[i]
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            self._started[i] = buf is not None
            if buf is not None and not (buf.data_ptr() == view.data_ptr() and buf.shape == view.shape):
                view.copy_(buf)

    def update(self, a: int, b: int, g: np.ndarray) -> None:
        """Apply the update to elements ``[a, b)`` of every rank's parameters and momentum,
        ``g`` their averaged gradient (the all-reduce's ``finish``)."""
        grad = self._tensor(g)
        i = bisect_right(self._offsets, a) - 1
        while i < len(self._offsets) and self._offsets[i] < b:
            lo, hi = max(a, self._offsets[i]), min(b, self._ends[i])
            if hi > lo:
                self._apply(i, lo, hi, grad[lo - a : hi - a])
            i += 1

    def _apply(self, i: int, lo: int, hi: int, g: Any) -> None:
        """The SGD rule (module docstring) on elements ``[lo, hi)`` of parameter ``i``."""
        import torch

        hyper = self._hyper[i]
        assert hyper is not None  # every parameter of the optimizer, read by begin()
        lr, momentum, dampening, decay, nesterov, maximize = hyper
        if self._scratch.shape[0] < hi - lo:
            self._scratch = torch.empty(hi - lo, dtype=g.dtype)
        scratch = self._scratch[: hi - lo]
        x = self._x[self.rank][lo:hi]
        d = torch.neg(g, out=scratch) if maximize else g
        if decay:
            d = torch.add(d, x, alpha=decay, out=scratch)
        written = [x]
        if momentum:
            buf = self._m[self.rank][lo:hi]
            if self._started[i]:
                buf.mul_(momentum).add_(d, alpha=1 - dampening)
            else:
                buf.copy_(d)
            d = torch.add(d, buf, alpha=momentum, out=scratch) if nesterov else buf
            written.append(buf)
        x.add_(d, alpha=-lr)
        for k in self._peers:
            for mine, theirs in zip(written, (self._x[k], self._m[k])):
                theirs[lo:hi].copy_(mine)

    def end(self) -> None:
        """After the all-reduce: point the optimizer's momentum buffers at this rank's
        momentum vector, and call its ``step()`` with the gradients detached, which
        applies nothing (module docstring)."""
        flat, state = self.flat, self.optimizer.state
        for i in self._indices:
            hyper = self._hyper[i]
            if hyper is not None and hyper[1]:
                state[flat.views[i][0]]["momentum_buffer"] = self._views[i]
        params = [p for p, _ in flat.views]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad

    def close(self) -> None:
        """Move the parameters and the optimizer's momentum buffers back into private
        memory, values kept, and release the shared vectors (collective)."""
        self.flat.move_state(self.flat.state.clone())
        for i, (p, _) in enumerate(self.flat.views):
            state = self.optimizer.state.get(p, {})
            buf = state.get("momentum_buffer")
            if buf is not None and buf.data_ptr() == self._views[i].data_ptr():
                state["momentum_buffer"] = buf.clone()
        self._x.clear()
        self._m.clear()
        self._views.clear()
        self._state.free()
        self._momentum.free()
