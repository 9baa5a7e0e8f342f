"""A model's parameters and gradients as two contiguous 1-D buffers.

The training algorithms communicate whole models (D-PSGD) or whole gradients
(AllReduce-SGD, LSGD). Doing that per tensor would cost one collective per
layer, and packing into a send buffer would cost a copy per step. Instead,
:func:`flatten` makes every parameter *and* every gradient a view into one
flat buffer each, so a collective runs on the whole model in place:

* torch: each ``p.data`` is re-pointed to a slice of a new flat parameter
  tensor (values copied once, at construction), and each ``p.grad`` to a
  slice of a flat gradient tensor. The Parameter objects stay the same, so
  an optimizer built on ``model.parameters()`` keeps working, momentum and
  all; ``loss.backward()`` accumulates into the flat gradient in place.
  Parameters are taken in ``model.parameters()`` order; they must share one
  floating dtype and device. ``optimizer.zero_grad()`` (which sets grads to
  None) breaks the aliasing for a step; :meth:`FlatParams.collect_grads`
  repairs it with one copy, and zeroing with ``zero_grad(set_to_none=False)``
  or :meth:`FlatParams.zero_grad` avoids the copy. Frozen parameters
  (``requires_grad=False`` at construction) keep their place in both
  buffers but get no gradient (``p.grad`` stays None, so the optimizer
  leaves them alone); :attr:`FlatParams.trainable` says which are which.
* numpy: the parameter array is the flat buffer (viewed 1-D) and the
  optimizer's ``grad`` array (:class:`algorithms.optim.SGD`) the flat
  gradient.

The model's *state* is what a worker's model is beyond its gradients: the
parameters and the floating-point buffers that the forward pass updates, such
as BatchNorm's running mean and variance. For torch models the buffers of the
parameters' dtype and device (in ``model.buffers()`` order) are re-pointed,
like the parameters, into one flat state buffer laid out as
[parameters | buffers], of which the flat parameter buffer is the head; other
buffers (BatchNorm's int64 ``num_batches_tracked``, buffers of another dtype)
stay where they are, local to the worker. Without such buffers, and for numpy
models, the state is the parameters.

What the algorithms do with the buffers follows from what they average:

* algorithms that average *models* (D-PSGD, AD-PSGD, GR-SGD, Prague)
  average the whole state, so a worker's statistics are mixed with its
  neighbours' exactly as its parameters are, and stay consistent with them;
* algorithms that average *gradients* (AllReduce-SGD, LSGD) keep the buffers
  local: every worker's parameters are the same, its statistics are those of
  its own data, and the model evaluated as "the average" averages them (as
  DDP evaluates with one worker's, and Horovod without SyncBatchNorm with each
  worker's own).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import ArgumentError, FlatBuffer, as_flat

from .optim import SGD


class FlatParams:
    """Parameters, gradients and state of one model, each one contiguous buffer.

    Attributes:
        params: the flat parameter buffer as the caller's kind (a 1-D torch
            tensor, or a 1-D view of the numpy parameter array).
        grads: the flat gradient buffer, same kind, length and dtype.
        state: the flat state buffer [parameters | buffers] (module
            docstring), ``params`` itself when the model has no buffers.
        param_data, grad_data, state_data: ``params``, ``grads`` and
            ``state`` as 1-D arrays of the array module (share memory).
        dtype: the logical dtype name (e.g. "float32").
        sizes: the element count of every parameter, in order (their
            gradients lie one after the other in ``grads``); a numpy model
            is one parameter.
        trainable: for every parameter, whether it gets a gradient (torch:
            ``requires_grad`` at construction).
        shapes: every parameter's shape, in order (a numpy model's array shape).
    """

    def __init__(self, params: Any, grads: Any, state: Any = None, shape: Sequence[int] | None = None) -> None:
        self.params, self.grads = params, grads
        self.state = params if state is None else state
        flat_p, flat_g = as_flat(params), as_flat(grads)
        self.param_data, self.grad_data, self.dtype = flat_p.data, flat_g.data, flat_p.dtype
        self.state_data = self.param_data if state is None else as_flat(state).data
        self.sizes: tuple[int, ...] = (self.size,)
        self.trainable: tuple[bool, ...] = (True,)
        self.shapes: tuple[tuple[int, ...], ...] = (tuple(shape) if shape is not None else (self.size,),)

    @property
    def has_buffers(self) -> bool:
        """Whether the state holds buffers beyond the parameters."""
        return self.state is not self.params

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(self.param_data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter buffer (the size of one model)."""
        return int(self.param_data.nbytes)

    @property
    def memory(self) -> str:
        """Where the buffers live, as :func:`collectives.explain` names it: "cpu" for host
        arrays, "cuda" for device memory."""
        return "cpu" if type(self.param_data) is np.ndarray else "cuda"

    def layout(self) -> list[tuple[int, tuple[int, ...]]]:
        """(offset, shape) of every parameter in the flat buffers, in order: they tile
        the parameters (and the gradients) from 0 (e.g. PowerSGD's ``shapes``)."""
        offsets = np.cumsum((0, *self.sizes[:-1]))
        return [(int(o), shape) for o, shape in zip(offsets, self.shapes)]

    def collect_grads(self) -> None:
        """Make sure the flat gradient buffer holds the current gradients (numpy: nothing to do)."""

    def collect_grad(self, i: int) -> None:
        """:meth:`collect_grads` for parameter ``i`` alone (numpy: nothing to do)."""

    def outside_grad(self, i: int) -> Any:
        """Parameter ``i``'s gradient if it lies outside the flat buffer (see
        :class:`TorchFlatParams`), else None (numpy: always None)."""
        return None

    def drop_grads(self, indices: Sequence[int]) -> None:
        """Let the next backward pass write the gradients of parameters ``indices`` into
        fresh tensors instead of adding into the flat buffer (torch: ``p.grad = None``;
        numpy: nothing to do)."""

    def point_grads(self, indices: Sequence[int]) -> None:
        """Point the gradients of parameters ``indices`` back at the flat buffer, which
        holds their values already (numpy: nothing to do)."""

    def new_buffer(self) -> FlatBuffer:
        """A new, uninitialised buffer of the gradients' kind, dtype and length (e.g. to
        keep a copy in flight while the gradient buffer is reused)."""
        return as_flat(np.empty_like(self.grads))

    def zero_grad(self) -> None:
        """Set every gradient to zero, keeping the aliasing."""
        self.grad_data.fill(0)


class TorchFlatParams(FlatParams):
    """:class:`FlatParams` of a torch model; ``tensors`` are its parameters in order,
    ``buffers`` its (module, name, buffer) triples whose buffers join the state."""

    def __init__(self, tensors: list, buffers: Sequence[tuple[Any, str, Any]] = ()) -> None:
        import torch

        dtypes = {p.dtype for p in tensors}
        devices = {p.device for p in tensors}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ArgumentError(
                f"a flat model needs one dtype and one device; parameters have dtypes "
                f"{sorted(map(str, dtypes))} on devices {sorted(map(str, devices))}"
            )
        (dtype,), (device,) = dtypes, devices
        if not dtype.is_floating_point:
            raise ArgumentError(f"parameters must be floating point, got {dtype}")
        total = sum(p.numel() for p in tensors)
        extra = [(m, name, b) for m, name, b in buffers if b.dtype == dtype and b.device == device]
        state = torch.empty(total + sum(b.numel() for _, _, b in extra), dtype=dtype, device=device)
        params = state[:total]
        grads = torch.zeros(total, dtype=dtype, device=device)
        self.views: list[tuple[Any, Any]] = []  # (parameter, its gradient view)
        offset = 0
        with torch.no_grad():
            for p in tensors:
                n = p.numel()
                params[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = params[offset : offset + n].view_as(p)
                grad = grads[offset : offset + n].view_as(p)
                if p.grad is not None:
                    grad.copy_(p.grad)
                if p.requires_grad or p.grad is not None:
                    p.grad = grad
                self.views.append((p, grad))
                offset += n
            for module, name, b in extra:
                n = b.numel()
                view = state[offset : offset + n].view_as(b)
                view.copy_(b)
                setattr(module, name, view)  # a registered buffer: nn.Module keeps it registered
                offset += n
        super().__init__(params, grads, state if extra else None)
        self._buffers = [(module, name) for module, name, _ in extra]
        self.sizes = tuple(p.numel() for p in tensors)
        self.trainable = tuple(bool(p.requires_grad) for p in tensors)
        self.shapes = tuple(tuple(p.shape) for p in tensors)

    def new_buffer(self) -> FlatBuffer:
        import torch

        return as_flat(torch.empty_like(self.grads))

    def move_grads(self, grads: Any) -> None:
        """Make ``grads`` (a 1-D tensor of the flat gradient's length, dtype and device,
        e.g. in shared memory) the flat gradient buffer: the gradients are copied in,
        and those that aliased the old buffer are re-pointed to the new one."""
        import torch

        with torch.no_grad():
            grads.copy_(self.grads)
        offset = 0
        for i, (p, old) in enumerate(self.views):
            n = p.numel()
            view = grads[offset : offset + n].view_as(p)
            if p.grad is not None and _aliases(p.grad, old):
                p.grad = view
            self.views[i] = (p, view)
            offset += n
        self.grads, self.grad_data = grads, as_flat(grads).data

    def move_state(self, state: Any) -> None:
        """Make ``state`` (a 1-D tensor of the flat state's length, dtype and device, e.g.
        in shared memory) the flat state buffer: the parameters and buffers are copied in,
        and every parameter's ``data`` and every buffer of the state re-pointed to it."""
        import torch

        with torch.no_grad():
            state.copy_(self.state)
            offset = 0
            for p, _ in self.views:
                n = p.numel()
                p.data = state[offset : offset + n].view_as(p)
                offset += n
            params = state[:offset]
            for module, name in self._buffers:
                b = getattr(module, name)
                n = b.numel()
                setattr(module, name, state[offset : offset + n].view_as(b))
                offset += n
        self.params, self.param_data = params, as_flat(params).data
        self.state = state if self._buffers else params
        self.state_data = as_flat(self.state).data

    def collect_grads(self) -> None:
        """Copy gradients that no longer alias the flat buffer into it and re-point them.

        A trainable parameter whose ``grad`` is None (zeroed with
        ``set_to_none``, or unused in the last backward pass) gets a zero
        gradient; a frozen one keeps None.
        """
        for i in range(len(self.views)):
            self.collect_grad(i)

    def outside_grad(self, i: int) -> Any:
        """Parameter ``i``'s gradient where backward left it outside the flat buffer
        (after ``zero_grad(set_to_none=True)`` it steals a fresh tensor), contiguous; or
        None once the flat buffer holds it (:meth:`collect_grad` zeroes a missing one
        there and copies a strided one in)."""
        p, view = self.views[i]
        grad = p.grad
        if grad is not None and not _aliases(grad, view) and grad.is_contiguous():
            return grad
        self.collect_grad(i)
        return None

    def drop_grads(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.views[i][0].grad = None

    def point_grads(self, indices: Sequence[int]) -> None:
        """Point the gradients of parameters ``indices`` (trainable, or with a
        gradient) at their views of the flat buffer, which holds their values already."""
        for i in indices:
            p, view = self.views[i]
            if p.requires_grad or p.grad is not None:
                p.grad = view

    def collect_grad(self, i: int) -> None:
        """:meth:`collect_grads` for parameter ``i`` alone (e.g. from its gradient hook)."""
        p, view = self.views[i]
        grad = p.grad
        if grad is None:
            if not p.requires_grad:
                return
            view.zero_()
        elif not _aliases(grad, view):
            view.copy_(grad)
        else:
            return
        p.grad = view


def _aliases(grad: Any, view: Any) -> bool:
    """Whether the tensor ``grad`` is the flat buffer's ``view`` (same memory, same strides)."""
    return bool(grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride())


def flatten(model: Any, optimizer: Any) -> FlatParams:
    """View ``model``'s parameters and gradients as flat buffers (module docstring).

    Args:
        model: a ``torch.nn.Module``, or a numpy parameter array.
        optimizer: the local optimizer; it must update exactly those
            parameters (a torch optimizer over ``model.parameters()``, or an
            :class:`~algorithms.optim.SGD` whose ``params`` is the array).

    Raises:
        ArgumentError: an unsupported model, mixed dtypes or devices, or an
            optimizer that does not hold the model's parameters.
    """
    if isinstance(model, np.ndarray):
        if not isinstance(optimizer, SGD) or optimizer.params is not model:
            raise ArgumentError(
                "a numpy model needs an algorithms.optim.SGD built on that same array "
                f"(SGD(x, lr=...)); got {type(optimizer).__name__}"
            )
        return FlatParams(model.reshape(-1), optimizer.grad.reshape(-1), shape=model.shape)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model must be a torch.nn.Module or a numpy array, got {type(model).__name__}")
    tensors = list(model.parameters())
    if not tensors:
        raise ArgumentError("the model has no parameters")
    buffers = [
        (module, name, b)
        for module in model.modules()
        for name, b in module.named_buffers(recurse=False)
        if b is not None and b.is_floating_point()
    ]
    held = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    if {id(p) for p in held} != {id(p) for p in tensors} or len(held) != len(tensors):
        raise ArgumentError(
            "the optimizer must hold exactly the model's parameters (e.g. torch.optim.SGD(model.parameters(), ...))"
        )
    return TorchFlatParams(tensors, buffers)
