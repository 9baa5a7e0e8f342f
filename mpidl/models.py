"""Multi-layer perceptrons for ``mpidl train``: a torch model, and a numpy one with manual backprop.

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

:class:`MLP` is the interface the training loop uses: the model to hand to
:func:`algorithms.create`, its optimizer, the loss and gradient of a batch,
and the evaluation of *any* flat parameter vector (a worker's own, or the
average of all workers'), which touches neither the training parameters,
nor the gradients, nor any random generator.
"""

from __future__ import annotations

import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from algorithms import optim

#: Model backends: ``auto`` is torch when it is installed, else numpy.
BACKENDS = ("auto", "torch", "numpy")


def init_params(sizes: Sequence[int], seed: int, dtype: Any = np.float32) -> np.ndarray:
    """The initial flat parameter vector of an MLP with layer ``sizes`` (module docstring)."""
    rng = np.random.default_rng(seed)
    parts = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = 1.0 / math.sqrt(fan_in)
        parts += [rng.uniform(-bound, bound, fan_out * fan_in), rng.uniform(-bound, bound, fan_out)]
    return np.concatenate(parts).astype(dtype)


def describe(sizes: Sequence[int]) -> str:
    """'MLP 64-64-10'."""
    return "MLP " + "-".join(map(str, sizes))


class MLP(ABC):
    """An MLP classifier on one worker, as the training loop sees it.

    Attributes:
        sizes: layer sizes (inputs, hidden..., classes).
        model: what :func:`algorithms.create` wraps (a ``torch.nn.Module`` or
            the numpy flat parameter array).
        optimizer: the local SGD optimizer, once :meth:`make_optimizer` made it.
        device: where the parameters live.
    """

    backend: ClassVar[str]
    device: Any = "cpu"
    model: Any

    def __init__(self, sizes: Sequence[int]) -> None:
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"an MLP needs at least two layer sizes, all positive; got {list(sizes)}")
        self.sizes = tuple(int(s) for s in sizes)
        self.optimizer: Any = None

    @property
    def parameters(self) -> int:
        """Number of parameters."""
        return sum(a * b + b for a, b in zip(self.sizes[:-1], self.sizes[1:]))

    @abstractmethod
    def make_optimizer(self, lr: float, momentum: float) -> Any:
        """Create (and keep) SGD over the model's parameters, torch's update rule in both backends."""

    @abstractmethod
    def array(self, values: np.ndarray) -> Any:
        """``values`` as the backend's array on the model's device (the dataset, batch indices)."""

    @abstractmethod
    def loss_backward(self, x: Any, y: Any) -> Any:
        """The batch's mean loss (a float, or a 0-d tensor: sum them, then ``float()``), its
        gradient accumulated into the model's gradients (zero them first)."""

    @abstractmethod
    def evaluate(self, params: Any, x: Any, y: Any) -> tuple[float, float]:
        """(mean loss, accuracy) on (x, y) of the model with flat parameters ``params``."""

    @abstractmethod
    def copy(self, params: Any) -> Any:
        """A new flat buffer with the values of ``params``."""

    @abstractmethod
    def squared_norms(self, params: Any, center: Any) -> tuple[float, float]:
        """(||params - center||^2, ||center||^2), accumulated in float64."""

    @abstractmethod
    def to_numpy(self, params: Any) -> np.ndarray:
        """A host copy of the flat buffer ``params``."""

    @abstractmethod
    def load(self, params: Any, values: np.ndarray) -> None:
        """Copy ``values`` into the flat buffer ``params``."""

    @abstractmethod
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's state as host arrays: ``{"momentum": the flat momentum buffer}``,
        or ``{}`` before the first momentum step (and without momentum)."""

    @abstractmethod
    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`optimizer_state` returned (into a fresh optimizer)."""

    def synchronize(self) -> None:
        """Wait for queued device work (so that host clocks measure it)."""


class NumpyMLP(MLP):
    """The MLP on a flat numpy parameter array, with hand-written backpropagation.

    Args:
        sizes: layer sizes.
        seed: initialisation seed (:func:`init_params`).
        dtype: the parameters' floating-point type.
    """

    backend = "numpy"

    def __init__(self, sizes: Sequence[int], seed: int, dtype: Any = np.float32) -> None:
        super().__init__(sizes)
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

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        logits = self.forward(params, x)[-1]
        loss = -float(self._log_softmax(logits)[np.arange(len(y)), y].mean())
        return loss, float((logits.argmax(axis=1) == y).mean())

    def copy(self, params: np.ndarray) -> np.ndarray:
        return params.copy()

    def squared_norms(self, params: np.ndarray, center: np.ndarray) -> tuple[float, float]:
        c = center.astype(np.float64)
        return float(np.sum((params - c) ** 2)), float(np.dot(c, c))

    def to_numpy(self, params: np.ndarray) -> np.ndarray:
        return params.copy()

    def load(self, params: np.ndarray, values: np.ndarray) -> None:
        params[...] = values

    # algorithms.optim.SGD keeps its momentum buffer in ``_buf`` and whether it holds one in ``_started``.
    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {"momentum": self.optimizer._buf.copy()} if self.optimizer._started and self.optimizer.momentum else {}

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        if "momentum" in state:
            self.optimizer._buf[...] = state["momentum"]
            self.optimizer._started = True


class TorchMLP(MLP):
    """The MLP as a ``torch.nn.Sequential`` on ``device``.

    Args:
        sizes: layer sizes.
        seed: initialisation seed (:func:`init_params`).
        device: a torch device ("cpu", "cuda", "cuda:1").
    """

    backend = "torch"

    def __init__(self, sizes: Sequence[int], seed: int, device: str = "cpu") -> None:
        import torch

        super().__init__(sizes)
        self.device = torch.device(device)
        layers: list[torch.nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if i < len(self.sizes) - 2 else [])
        self.model = torch.nn.Sequential(*layers)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(
                torch.from_numpy(init_params(self.sizes, seed)), self.model.parameters()
            )
        self.model.to(self.device)
        self._shapes = [(name, p.shape, p.numel()) for name, p in self.model.named_parameters()]

    def make_optimizer(self, lr: float, momentum: float) -> Any:
        import torch

        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        return self.optimizer

    def array(self, values: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(np.ascontiguousarray(values)).to(self.device)

    def loss_backward(self, x: Any, y: Any) -> Any:
        import torch

        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.detach()

    def evaluate(self, params: Any, x: Any, y: Any) -> tuple[float, float]:
        import torch

        views, offset = {}, 0
        for name, shape, n in self._shapes:
            views[name] = params[offset : offset + n].view(shape)
            offset += n
        with torch.no_grad():
            logits = torch.func.functional_call(self.model, views, (x,))
            loss = torch.nn.functional.cross_entropy(logits, y)
            return float(loss), float((logits.argmax(dim=1) == y).double().mean())

    def copy(self, params: Any) -> Any:
        return params.detach().clone()

    def squared_norms(self, params: Any, center: Any) -> tuple[float, float]:
        c = center.double()
        return float((params.double() - c).square().sum()), float(c.square().sum())

    def to_numpy(self, params: Any) -> np.ndarray:
        return params.detach().cpu().numpy().copy()

    def load(self, params: Any, values: np.ndarray) -> None:
        import torch

        with torch.no_grad():
            params.copy_(torch.from_numpy(values))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        import torch

        buffers = [self.optimizer.state[p].get("momentum_buffer") for p in self.model.parameters()]
        if any(b is None for b in buffers):
            return {}
        return {"momentum": torch.cat([b.reshape(-1) for b in buffers]).cpu().numpy()}

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        import torch

        if "momentum" not in state:
            return
        flat, offset = torch.from_numpy(state["momentum"]), 0
        for p in self.model.parameters():
            self.optimizer.state[p]["momentum_buffer"] = (
                flat[offset : offset + p.numel()].view_as(p).to(p.device).clone()
            )
            offset += p.numel()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def torch_available() -> bool:
    """Whether torch can be imported."""
    return importlib.util.find_spec("torch") is not None


def make(backend: str, sizes: Sequence[int], seed: int, device: str = "cpu") -> MLP:
    """The MLP on ``backend`` (one of :data:`BACKENDS`) and ``device`` ("cpu" or "cuda").

    Raises:
        ValueError: an unknown backend, torch asked for but missing, or a
            device the backend cannot use.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "torch" if torch_available() else "numpy"
    if backend == "numpy":
        if device != "cpu":
            raise ValueError(f"the numpy backend runs on the CPU only, not {device!r}; use --backend torch")
        return NumpyMLP(sizes, seed)
    if not torch_available():
        raise ValueError("the torch backend needs PyTorch: pip install 'mpidl[torch]' (or use --backend numpy)")
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    return TorchMLP(sizes, seed, device)
