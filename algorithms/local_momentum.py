"""Local momentum: each worker applies SGD's momentum to its own gradient before compressing it.

AllReduce-SGD's uncompressed update averages the gradients and lets the
optimizer apply momentum (and weight decay) to the average. With a biased
compressor and error feedback that order fails: the residual comes back in
bursts, and momentum 0.9 after the aggregation sums ten steps of them
(measured: sign with error feedback diverged on Fashion-MNIST at lr 0.05,
momentum 0.9, and trained within a point of uncompressed at momentum 0;
``docs/performance.rst``). Zheng, Huang & Kwok (NeurIPS
2019) compress the momentum-updated step instead. Here, per worker i and
parameter, with torch's SGD rule (momentum beta, dampening, Nesterov, weight
decay wd of the parameter's group):

    d_i = g_i + wd x                          (the worker's gradient, decayed)
    u_i = d_i (first step);  u_i = beta u_i + (1 - dampening) d_i
    p_i = d_i + beta u_i (Nesterov)  or  u_i
    aggregate C(p_i + e_i) with error feedback; e_i keeps what C dropped
    x = x - lr * mean                         (the optimizer, with momentum
                                               and weight decay set to 0)

Uncompressed, the mean of the p_i is exactly what the optimizer's momentum
makes of the mean gradient (momentum is linear); compressed, error feedback
works on the momentum-updated steps, whose residual the optimizer applies
once, not through ten steps of momentum. The velocity u_i is the worker's
own (it differs between workers, like the residual) and is algorithm state
(:meth:`LocalMomentum.state_dict`); the optimizer's own momentum buffer is
left untouched.

The update is the optimizer's ``step()`` with ``momentum``, ``weight_decay``
and ``nesterov`` set to 0 for that call (:meth:`LocalMomentum.plain`): so
the optimizer must be SGD (``torch.optim.SGD`` or
:class:`algorithms.optim.SGD`). A torch optimizer stepped any other way
while local momentum is on (``optimizer.step()`` after ``synchronize()``)
raises before it applies momentum a second time: finish the step with the
algorithm's ``step()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from collectives import ArgumentError
from collectives.transport.buffers import array_module
from collectives.transport.scratch import scratch

from .compressed import host_copy, load_into, name_of, require
from .error_feedback import zeros_like
from .flat import FlatParams
from .optim import SGD

#: The hyper-parameters local momentum takes over from the optimizer, as torch's SGD names them.
KEYS = ("momentum", "dampening", "nesterov", "weight_decay")
_SCRATCH = 130  # the scratch slot of a numpy a * x


class LocalMomentum:
    """Each worker's momentum, applied to its gradient before compression (module docstring).

    Args:
        optimizer: the local optimizer: ``torch.optim.SGD`` (any optimizer whose
            parameter groups have torch SGD's momentum, dampening, nesterov and
            weight_decay) or :class:`algorithms.optim.SGD`.
        flat: the model's flat parameters and gradients (the optimizer's).

    Attributes:
        velocity: every parameter's momentum u_i, a buffer like the gradients.

    Raises:
        ArgumentError: an optimizer that is not SGD.
    """

    def __init__(self, optimizer: Any, flat: FlatParams) -> None:
        self.optimizer, self.flat = optimizer, flat
        self._groups = parameter_groups(optimizer, flat)
        self.velocity = zeros_like(flat.grads)
        self._started = np.zeros(len(flat.sizes), np.bool_)
        offsets = np.cumsum((0, *flat.sizes))
        self._bounds = [(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
        self._plain = False
        hook = getattr(optimizer, "register_step_pre_hook", None)
        self._hook = hook(self._guard) if hook is not None else None

    def apply(self, params: Iterable[int]) -> None:
        """Replace the gradients of ``params`` (indices into the model's parameters) by
        the momentum-updated steps p_i, in place, advancing their velocity."""
        grads, xs, us = self.flat.grads, self.flat.params, self.velocity
        for i in params:
            a, b = self._bounds[i]
            g, x, u = grads[a:b], xs[a:b], us[a:b]
            beta, dampening, nesterov, decay = self.hyper(i)
            if decay:
                _axpy(g, decay, x)
            if self._started[i]:
                _scale(u, beta)
                _axpy(u, 1 - dampening, g)
            else:
                _copy(u, g)
                self._started[i] = True
            if nesterov:
                _axpy(g, beta, u)
            else:
                _copy(g, u)

    def mask(self, offset: int, indices: Any) -> None:
        """Zero the velocity of the elements ``offset + indices`` (``indices`` an integer
        array of the velocity's kind): DGC's momentum factor masking (:mod:`algorithms.dgc`)."""
        part = self.velocity[offset:]
        if hasattr(part, "index_fill_"):  # torch
            import torch

            part.index_fill_(0, torch.as_tensor(indices, device=part.device), 0)
        else:
            part[indices] = 0

    def hyper(self, i: int) -> tuple[float, float, bool, float]:
        """Parameter ``i``'s (momentum, dampening, nesterov, weight_decay), read now
        (a schedule may change them)."""
        group = self._groups[i] if self._groups is not None else vars(self.optimizer)
        momentum, dampening, nesterov, decay = (group[key] for key in KEYS)
        return float(momentum), float(dampening), bool(nesterov), float(decay)

    @contextmanager
    def plain(self) -> Iterator[None]:
        """Within: the optimizer's momentum, Nesterov and weight decay are 0 (its step is
        x -= lr * grad); restored after."""
        groups = self.optimizer.param_groups if self._groups is not None else [vars(self.optimizer)]
        saved = [{key: group[key] for key in KEYS if key != "dampening"} for group in groups]
        for group in groups:
            group.update(momentum=0.0, nesterov=False, weight_decay=0.0)
        self._plain = True
        try:
            yield
        finally:
            self._plain = False
            for group, values in zip(groups, saved):
                group.update(values)

    def state_dict(self) -> dict[str, np.ndarray]:
        """``velocity`` (a host copy) and ``velocity_started`` (per parameter, whether it has one)."""
        return {"velocity": host_copy(self.velocity), "velocity_started": self._started.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the velocity from ``state`` (:meth:`state_dict`).

        Raises:
            ValueError: a velocity missing, or of another length or dtype.
        """
        require(state, ("velocity", "velocity_started"), "the local momentum's velocity")
        load_into(self.velocity, np.asarray(state["velocity"]), "the local momentum's velocity")
        self._started[:] = np.asarray(state["velocity_started"], np.bool_)

    def close(self) -> None:
        """Remove the guard from the optimizer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _guard(self, *_: Any) -> None:
        """The torch optimizer's step pre-hook: its own step would apply momentum again."""
        if not self._plain:
            raise RuntimeError(
                "local momentum is on (the workers apply momentum before compressing): finish the "
                "step with the algorithm's step(), which runs the optimizer without its momentum; "
                "or build the algorithm with local_momentum=False"
            )


#: The compressors that train better with local momentum (measured,
#: docs/performance.rst): with error feedback, sign diverged and top-k 1 % lost 4
#: points with momentum after the aggregation; sign without error feedback (its
#: default) trained best with it; PowerSGD kept its accuracy with momentum after the
#: aggregation and lost some with local momentum.
LOCAL = ("sign", "topk")


def default_on(compression: tuple[str, bool] | None, optimizer: Any) -> bool:
    """Whether local momentum is on by default: for the compressors of :data:`LOCAL`
    (``compression`` as :func:`algorithms.compressed.resolve` returns it, with error
    feedback on or off), where the optimizer has momentum."""
    if compression is None:
        return False
    return name_of(compression[0]) in LOCAL and has_momentum(optimizer)


def has_momentum(optimizer: Any) -> bool:
    """Whether ``optimizer`` applies momentum (an SGD with momentum > 0 in some group)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return isinstance(optimizer, SGD) and optimizer.momentum > 0
    return any(float(group.get("momentum", 0) or 0) > 0 for group in groups)


def parameter_groups(optimizer: Any, flat: FlatParams) -> list[dict[str, Any]] | None:
    """Every parameter's group (torch), in the flat order; None for :class:`~algorithms.optim.SGD`."""
    if isinstance(optimizer, SGD):
        return None
    groups = getattr(optimizer, "param_groups", None)
    if groups is None or not all(all(key in group for key in KEYS) for group in groups):
        raise ArgumentError(
            f"local momentum takes over SGD's momentum, dampening, nesterov and weight_decay; "
            f"{type(optimizer).__name__} has no such parameter groups: use local_momentum=False"
        )
    of = {id(p): group for group in groups for p in group["params"]}
    return [of[id(p)] for p, _ in flat.views]  # type: ignore[attr-defined]  # torch models only here


def _copy(y: Any, x: Any) -> None:
    """y = x, in place."""
    y.copy_(x) if hasattr(y, "copy_") else array_module(y).copyto(y, x)


def _scale(y: Any, a: float) -> None:
    """y *= a, in place."""
    y.mul_(a) if hasattr(y, "mul_") else array_module(y).multiply(y, a, out=y)


def _axpy(y: Any, a: float, x: Any) -> None:
    """y += a * x, in place, allocating nothing."""
    if hasattr(y, "add_"):
        y.add_(x, alpha=a)
        return
    xp, ax = array_module(y), scratch(y, y.shape[0], _SCRATCH)
    xp.multiply(x, a, out=ax)
    xp.add(y, ax, out=y)
