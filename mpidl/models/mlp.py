"""Multi-layer perceptrons: a numpy model with hand-written backpropagation, and the same network in torch.

Both backends build the same network and start from the same numbers:

* architecture, for layer sizes (d_0, d_1, ..., d_L): Linear(d_0, d_1), ReLU,
  Linear(d_1, d_2), ReLU, ..., Linear(d_{L-1}, d_L); the loss is softmax
  cross-entropy averaged over the batch;
* parameters, in torch's ``model.parameters()`` order: W_1 (d_1 x d_0),
  b_1, W_2, b_2, ...; the flat parameter vector has the same layout in both
  backends;
* initialisation: every weight and bias of a layer with fan-in d drawn
  uniformly from [-1/sqrt(d), 1/sqrt(d)] — the distribution of
  ``torch.nn.Linear``'s default initialisation — by numpy's ``default_rng``
  seeded with the run's seed (:func:`init_params`), so the two backends hold
  identical initial models.

An MLP has no buffers: its flat state is its parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from algorithms import optim

from .base import Model, check_length


def init_params(sizes: Sequence[int], seed: int, dtype: Any = np.float32) -> np.ndarray:
    """The initial flat parameter vector of an MLP with layer ``sizes`` (module docstring)."""
    rng = np.random.default_rng(seed)
    parts = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = 1.0 / math.sqrt(fan_in)
        parts += [rng.uniform(-bound, bound, fan_out * fan_in), rng.uniform(-bound, bound, fan_out)]
    return np.concatenate(parts).astype(dtype)


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of ints, checked.

    Raises:
        ValueError: fewer than two sizes, or one not positive.
    """
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"an MLP needs at least two layer sizes, all positive; got {list(sizes)}")
    return tuple(int(s) for s in sizes)


def describe(sizes: Sequence[int]) -> str:
    """'MLP 64-64-10'."""
    return "MLP " + "-".join(map(str, sizes))


def count(sizes: Sequence[int]) -> int:
    """Number of parameters of an MLP with layer ``sizes``."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def torch_module(sizes: Sequence[int], seed: int) -> Any:
    """The MLP as a ``torch.nn.Sequential`` holding :func:`init_params`' numbers."""
    import torch

    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if i < len(sizes) - 2 else [])
    module = torch.nn.Sequential(*layers)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(init_params(sizes, seed)), module.parameters())
    return module


class NumpyMLP(Model):
    """The MLP on a flat numpy parameter array, with hand-written backpropagation.

    Args:
        sizes: layer sizes (inputs, hidden..., classes).
        seed: initialisation seed (:func:`init_params`).
        dtype: the parameters' floating-point type.
    """

    backend = "numpy"

    def __init__(self, sizes: Sequence[int], seed: int, dtype: Any = np.float32) -> None:
        self.sizes = check_sizes(sizes)
        self.name, self.spec = describe(self.sizes), {"model": "mlp", "layers": list(self.sizes)}
        self.parameters = count(self.sizes)
        self.model = self.params = init_params(self.sizes, seed, dtype)

    def layers(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Views (W, b) of every layer into the flat vector ``flat``."""
        out, offset = [], 0
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:]):
            w = flat[offset : offset + fan_out * fan_in].reshape(fan_out, fan_in)
            offset += fan_out * fan_in
            out.append((w, flat[offset : offset + fan_out]))
            offset += fan_out
        return out

    def forward(self, flat: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        """The input and every layer's output (after ReLU, except the logits, last)."""
        acts = [x]
        layers = self.layers(flat)
        for i, (w, b) in enumerate(layers):
            z = acts[-1] @ w.T + b
            acts.append(np.maximum(z, 0, out=z) if i < len(layers) - 1 else z)
        return acts

    @staticmethod
    def _log_softmax(logits: np.ndarray) -> np.ndarray:
        shifted = logits - logits.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray, grad: np.ndarray) -> float:
        """Mean cross-entropy of the model ``flat`` on (x, y); its gradient is written into ``grad``."""
        acts = self.forward(flat, x)
        logp = self._log_softmax(acts[-1])
        rows = np.arange(len(y))
        loss = -float(logp[rows, y].mean())
        delta = np.exp(logp)  # d loss / d logits = (softmax - onehot) / batch
        delta[rows, y] -= 1
        delta /= len(y)
        layers, grads = self.layers(flat), self.layers(grad)
        for i in range(len(layers) - 1, -1, -1):
            gw, gb = grads[i]
            np.matmul(delta.T, acts[i], out=gw)
            np.sum(delta, axis=0, out=gb)
            if i:
                delta = (delta @ layers[i][0]) * (acts[i] > 0)
        return loss

    def make_optimizer(self, lr: float, momentum: float) -> optim.SGD:
        self.optimizer = optim.SGD(self.params, lr=lr, momentum=momentum)
        return self.optimizer

    def array(self, values: np.ndarray) -> np.ndarray:
        return values

    def loss_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.loss_and_grad(self.params, x, y, self.optimizer.grad)

    def evaluate(self, state: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        logits = self.forward(state, x)[-1]
        loss = -float(self._log_softmax(logits)[np.arange(len(y)), y].sum())
        return loss, int((logits.argmax(axis=1) == y).sum())

    def copy(self, buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    def squared_norms(self, params: np.ndarray, center: np.ndarray) -> tuple[float, float]:
        c = center.astype(np.float64)
        return float(np.sum((params - c) ** 2)), float(np.dot(c, c))

    def to_numpy(self, buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    def load(self, buf: np.ndarray, values: np.ndarray) -> None:
        check_length(values, buf.size, "the saved state")
        buf[...] = values

    # algorithms.optim.SGD keeps its momentum buffer in ``_buf`` and whether it holds one in ``_started``.
    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {"momentum": self.optimizer._buf.copy()} if self.optimizer._started and self.optimizer.momentum else {}

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        if "momentum" in state:
            check_length(state["momentum"], self.optimizer._buf.size, "the saved momentum")
            self.optimizer._buf[...] = state["momentum"]
            self.optimizer._started = True
