"""A numpy SGD optimizer with the semantics of ``torch.optim.SGD``.

It lets the training algorithms run on a plain numpy parameter array exactly
as on a torch model: the optimizer holds the parameters and a gradient array
of the same shape (the analogue of ``p.grad``), and :meth:`SGD.step` applies
torch's update rule:

    d = g + weight_decay * x
    b = d                                    (first step with momentum)
    b = momentum * b + (1 - dampening) * d   (later steps)
    d = d + momentum * b if nesterov else b  (with momentum)
    x = x - lr * d

All work arrays are allocated once, in the constructor; a step allocates
nothing. ``lr`` (and the other hyper-parameters) may be changed between steps,
e.g. by a schedule.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SGD:
    """Stochastic gradient descent (with momentum, dampening, weight decay, Nesterov) on a numpy array.

    Attributes:
        params: the parameter array (updated in place by :meth:`step`).
        grad: the gradient array, same shape and dtype; write the gradient
            here (or let an algorithm do it) before :meth:`step`.
        lr, momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
    """

    def __init__(
        self,
        params: np.ndarray,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if not isinstance(params, np.ndarray) or params.dtype.kind != "f":
            raise TypeError(
                f"params must be a floating-point numpy array, got {type(params).__name__}"
                + (f" of {params.dtype}" if isinstance(params, np.ndarray) else "")
            )
        if not params.flags.c_contiguous or not params.flags.writeable:
            raise ValueError("params must be a C-contiguous, writable array (it is updated in place)")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.params = params
        self.grad = np.zeros_like(params)
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self._buf = np.zeros_like(params)  # momentum buffer
        self._decayed = np.empty_like(params)  # g + weight_decay * x
        self._work = np.empty_like(params)
        self._started = False

    def step(self) -> None:
        """Apply one update to :attr:`params` from :attr:`grad` (module docstring)."""
        x, d, work = self.params, self.grad, self._work
        if self.weight_decay:
            d = np.multiply(x, self.weight_decay, out=self._decayed)
            np.add(self.grad, d, out=d)
        if self.momentum:
            buf = self._buf
            if not self._started:
                np.copyto(buf, d)
            else:
                buf *= self.momentum
                buf += np.multiply(d, 1 - self.dampening, out=work) if self.dampening else d
            d = np.add(d, np.multiply(buf, self.momentum, out=work), out=work) if self.nesterov else buf
        self._started = True
        x -= np.multiply(d, self.lr, out=work)

    def zero_grad(self) -> None:
        """Set :attr:`grad` to zero."""
        self.grad.fill(0)

    #: The hyper-parameters, as :meth:`state_dict` names them.
    SETTINGS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def state_dict(self) -> dict[str, Any]:
        """The hyper-parameters and the momentum buffer (a copy; None before the first
        step with momentum), as torch's optimizers give theirs: e.g. for
        :func:`algorithms.broadcast_optimizer_state`."""
        buffer = self._buf.copy() if self._started and self.momentum else None
        return {**{name: getattr(self, name) for name in self.SETTINGS}, "momentum_buffer": buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of an SGD over an array of this size.

        Raises:
            ValueError: a momentum buffer of another size, or a missing entry.
        """
        missing = [name for name in (*self.SETTINGS, "momentum_buffer") if name not in state]
        if missing:
            raise ValueError(f"SGD state without {', '.join(missing)}")
        buffer = state["momentum_buffer"]
        if buffer is not None and np.shape(buffer) != self._buf.shape:
            raise ValueError(f"momentum buffer of shape {np.shape(buffer)}, the parameters' is {self._buf.shape}")
        for name in self.SETTINGS:
            setattr(self, name, state[name])
        self._started = buffer is not None
        if buffer is not None:
            np.copyto(self._buf, buffer)

    def __repr__(self) -> str:
        return (
            f"SGD(lr={self.lr}, momentum={self.momentum}, dampening={self.dampening}, "
            f"weight_decay={self.weight_decay}, nesterov={self.nesterov})"
        )
