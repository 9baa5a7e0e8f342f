"""The model as the training loop sees it: parameters, loss and gradient of a batch, evaluation of a flat state.

``mpidl train`` trains any :class:`Model`; it never looks inside one. A
model owns what :func:`algorithms.create` wraps (a ``torch.nn.Module`` or a
numpy parameter array) and the local optimizer over it, computes the loss
and gradient of a batch, and evaluates *any* flat state vector — a worker's
own, or the average of all workers' — without touching the training
parameters, the gradients, the optimizer or any random generator.

The flat state is the layout of :mod:`algorithms.flat`: the parameters in
``model.parameters()`` order, followed by the model's floating-point buffers
(BatchNorm's running mean and variance) in ``model.modules()`` order; for a
model without such buffers it is the parameters alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np


class Model(ABC):
    """A classifier on one worker (module docstring).

    Attributes:
        name: what the model is, e.g. "MLP 64-64-10" or "ResNet-8 (32-64-128)".
        spec: what identifies the architecture (a checkpoint of another
            architecture is refused): JSON-able.
        model: what :func:`algorithms.create` wraps.
        optimizer: the local SGD optimizer, once :meth:`make_optimizer` made it.
        device: where the parameters live.
        parameters: the number of parameters.
    """

    backend: ClassVar[str]
    name: str
    spec: dict[str, Any]
    model: Any
    parameters: int
    device: Any = "cpu"
    optimizer: Any = None

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
    def evaluate(self, state: Any, x: Any, y: Any) -> tuple[float, int]:
        """(sum of the losses, number of correct predictions) on (x, y) of the model whose
        flat state (module docstring) is ``state``; the training state is left as it was."""

    @abstractmethod
    def copy(self, buf: Any) -> Any:
        """A new flat buffer with the values of ``buf``."""

    @abstractmethod
    def squared_norms(self, params: Any, center: Any) -> tuple[float, float]:
        """(||params - center||^2, ||center||^2), accumulated in float64."""

    @abstractmethod
    def to_numpy(self, buf: Any) -> np.ndarray:
        """A host copy of the flat buffer ``buf``."""

    @abstractmethod
    def load(self, buf: Any, values: np.ndarray) -> None:
        """Copy ``values`` into the flat buffer ``buf``.

        Raises:
            ValueError: ``values`` of another length than ``buf`` (:func:`check_length`).
        """

    @abstractmethod
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's state as host arrays: ``{"momentum": the flat momentum buffer}``,
        or ``{}`` before the first momentum step (and without momentum)."""

    @abstractmethod
    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`optimizer_state` returned (into a fresh optimizer).

        Raises:
            ValueError: a momentum of another length than the parameters'.
        """

    def synchronize(self) -> None:
        """Wait for queued device work (so that host clocks measure it)."""


def check_length(values: np.ndarray, length: int, what: str) -> None:
    """Raise ValueError unless ``values`` is 1-D with ``length`` elements (a checkpoint's
    array must not be broadcast or cut to fit)."""
    if values.shape != (length,):
        raise ValueError(f"{what} has shape {values.shape}, the model {length} elements")
