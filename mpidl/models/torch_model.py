"""Any ``torch.nn.Module`` classifier as a :class:`~mpidl.models.base.Model`.

The module maps a batch of flat samples (batch x features) to logits; the
loss is softmax cross-entropy averaged over the batch. The forward pass of
training goes through :attr:`TorchModel.forward_module`, the module itself
unless a peer wraps it (DistributedDataParallel must see the forward pass to
reduce the gradients of the backward pass that follows).

Evaluation runs the module in eval mode (BatchNorm uses the running
statistics of the given state), without gradients, on chunks of
:data:`EVAL_CHUNK` samples, through ``torch.func.functional_call`` with the
parameters and floating-point buffers replaced by views into the given flat
state: the module's own tensors are read by nothing and changed by nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Model, check_length

#: Samples per forward pass of an evaluation (bounds its memory).
EVAL_CHUNK = 1000


class TorchModel(Model):
    """A torch classifier on ``device`` (module docstring).

    Args:
        module: maps (batch, features) float32 inputs to (batch, classes) logits.
        name, spec: see :class:`~mpidl.models.base.Model`.
        device: a torch device ("cpu", "cuda", "cuda:1").
    """

    backend = "torch"

    def __init__(self, module: Any, name: str, spec: dict[str, Any], device: str = "cpu") -> None:
        import torch

        self.name, self.spec = name, spec
        self.device = torch.device(device)
        self.model = self.forward_module = module.to(self.device)
        self.parameters = sum(p.numel() for p in module.parameters())
        params = list(module.named_parameters())
        dtype, dev = params[0][1].dtype, params[0][1].device
        buffers = [
            (f"{prefix}.{name}" if prefix else name, b)
            for prefix, sub in module.named_modules()
            for name, b in sub.named_buffers(recurse=False)
            if b is not None and b.is_floating_point() and b.dtype == dtype and b.device == dev
        ]
        # The flat state's layout (algorithms.flat): parameters, then the float buffers of their dtype and device.
        self._layout = [(name, t.shape, t.numel()) for name, t in params + buffers]

    def make_optimizer(self, lr: float, momentum: float) -> Any:
        import torch

        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        return self.optimizer

    def array(self, values: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(np.ascontiguousarray(values)).to(self.device)

    def loss_backward(self, x: Any, y: Any) -> Any:
        import torch

        loss = torch.nn.functional.cross_entropy(self.forward_module(x), y)
        loss.backward()
        return loss.detach()

    def evaluate(self, state: Any, x: Any, y: Any) -> tuple[float, int]:
        import torch

        views, offset = {}, 0
        for name, shape, n in self._layout:
            views[name] = state[offset : offset + n].view(shape)
            offset += n
        training = self.model.training
        self.model.eval()
        loss, correct = 0.0, 0
        try:
            with torch.no_grad():
                for start in range(0, len(y), EVAL_CHUNK):
                    xs, ys = x[start : start + EVAL_CHUNK], y[start : start + EVAL_CHUNK]
                    logits = torch.func.functional_call(self.model, views, (xs,))
                    loss += float(torch.nn.functional.cross_entropy(logits, ys, reduction="sum"))
                    correct += int((logits.argmax(dim=1) == ys).sum())
        finally:
            self.model.train(training)
        return loss, correct

    def copy(self, buf: Any) -> Any:
        return buf.detach().clone()

    def squared_norms(self, params: Any, center: Any) -> tuple[float, float]:
        c = center.double()
        return float((params.double() - c).square().sum()), float(c.square().sum())

    def to_numpy(self, buf: Any) -> np.ndarray:
        return buf.detach().cpu().numpy().copy()

    def load(self, buf: Any, values: np.ndarray) -> None:
        import torch

        check_length(values, buf.numel(), "the saved state")
        with torch.no_grad():
            buf.copy_(torch.from_numpy(values))

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
        check_length(state["momentum"], sum(p.numel() for p in self.model.parameters()), "the saved momentum")
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
