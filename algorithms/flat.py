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
  floating dtype and device. Buffers (e.g. BatchNorm statistics) are not
  included. ``optimizer.zero_grad()`` (which sets grads to None) breaks the
  aliasing for a step; :meth:`FlatParams.collect_grads` repairs it with one
  copy, and zeroing with ``zero_grad(set_to_none=False)`` or
  :meth:`FlatParams.zero_grad` avoids the copy.
* numpy: the parameter array is the flat buffer (viewed 1-D) and the
  optimizer's ``grad`` array (:class:`algorithms.optim.SGD`) the flat
  gradient.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from collectives import ArgumentError, FlatBuffer, as_flat

from .optim import SGD


class FlatParams:
    """Parameters and gradients of one model, each one contiguous buffer.

    Attributes:
        params: the flat parameter buffer as the caller's kind (a 1-D torch
            tensor, or a 1-D view of the numpy parameter array).
        grads: the flat gradient buffer, same kind, length and dtype.
        param_data: ``params`` as a 1-D numpy array (shares memory).
        grad_data: ``grads`` as a 1-D numpy array (shares memory).
        dtype: the logical dtype name (e.g. "float32").
    """

    def __init__(self, params: Any, grads: Any) -> None:
        self.params, self.grads = params, grads
        flat_p, flat_g = as_flat(params), as_flat(grads)
        self.param_data, self.grad_data, self.dtype = flat_p.data, flat_g.data, flat_p.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(self.param_data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter buffer (the size of one model)."""
        return int(self.param_data.nbytes)

    def collect_grads(self) -> None:
        """Make sure the flat gradient buffer holds the current gradients (numpy: nothing to do)."""

    def new_buffer(self) -> FlatBuffer:
        """A new, uninitialised buffer of the gradients' kind, dtype and length (e.g. to
        keep a copy in flight while the gradient buffer is reused)."""
        return as_flat(np.empty_like(self.grads))

    def zero_grad(self) -> None:
        """Set every gradient to zero, keeping the aliasing."""
        self.grad_data.fill(0)


class TorchFlatParams(FlatParams):
    """:class:`FlatParams` of a torch model; ``tensors`` are its parameters in order."""

    def __init__(self, tensors: list) -> None:
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
        params = torch.empty(total, dtype=dtype, device=device)
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
                p.grad = grad
                self.views.append((p, grad))
                offset += n
        super().__init__(params, grads)

    def new_buffer(self) -> FlatBuffer:
        import torch

        return as_flat(torch.empty_like(self.grads))

    def collect_grads(self) -> None:
        """Copy gradients that no longer alias the flat buffer into it and re-point them.

        A parameter whose ``grad`` is None (zeroed with ``set_to_none``, or
        unused in the last backward pass) gets a zero gradient.
        """
        for p, view in self.views:
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                view.copy_(grad)
            else:
                continue
            p.grad = view


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
        return FlatParams(model.reshape(-1), optimizer.grad.reshape(-1))
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model must be a torch.nn.Module or a numpy array, got {type(model).__name__}")
    tensors = list(model.parameters())
    if not tensors:
        raise ArgumentError("the model has no parameters")
    held = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    if {id(p) for p in held} != {id(p) for p in tensors} or len(held) != len(tensors):
        raise ArgumentError(
            "the optimizer must hold exactly the model's parameters (e.g. torch.optim.SGD(model.parameters(), ...))"
        )
    return TorchFlatParams(tensors)
