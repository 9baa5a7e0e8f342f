"""Models for ``mpidl train``: the interface the training loop sees, and the networks behind it.

================ ============================================== ======== ======================
``--model``      network                                        backends parameters
================ ============================================== ======== ======================
``mlp``          multi-layer perceptron, ``--hidden`` sizes     numpy,   64-64-10: 4,810;
                 (:mod:`~mpidl.models.mlp`)                     torch    64-2048-2048-10:
                                                                         4,349,962 (16.6 MiB)
``lenet``        LeNet-5 (:mod:`~mpidl.models.cnn`)             torch    61,706 on 28x28
``resnet``       ResNet-8, BatchNorm, width 32                  torch    308,074 on 28x28
                 (:mod:`~mpidl.models.cnn`)
================ ============================================== ======== ======================

:class:`~mpidl.models.base.Model` is the interface; :func:`make` builds one.
torch is imported only when a torch model is asked for.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

from .base import Model
from .mlp import NumpyMLP, check_sizes, describe, init_params

#: Model backends: ``auto`` is torch when it is installed, else numpy.
BACKENDS = ("auto", "torch", "numpy")
#: The networks (module docstring).
MODELS = ("mlp", "lenet", "resnet")


def torch_available() -> bool:
    """Whether torch can be imported."""
    return importlib.util.find_spec("torch") is not None


def rank_device(device: str, local_rank: int) -> str:
    """The torch device of a rank with ``local_rank`` on its node: ``device`` itself for
    "cpu", else "cuda:<local_rank mod the GPU count>", made the calling thread's
    current device (its collectives run there too, :mod:`collectives.transport.gpu`).
    Without torch it returns ``device`` as given, without a GPU "cuda:0"; either way
    it sets nothing, and :func:`make` says why it cannot build there."""
    if device != "cuda" or not torch_available():
        return device
    import torch

    chosen = f"cuda:{local_rank % max(1, torch.cuda.device_count())}"
    if torch.cuda.is_available():
        torch.cuda.set_device(chosen)
    return chosen


def make(
    kind: str,
    shape: Sequence[int],
    classes: int,
    *,
    hidden: Sequence[int] = (64,),
    backend: str = "auto",
    seed: int = 0,
    device: str = "cpu",
) -> Model:
    """The network ``kind`` (one of :data:`MODELS`) for samples of image ``shape`` (C, H, W)
    and ``classes`` classes, on ``backend`` (one of :data:`BACKENDS`) and ``device``;
    ``hidden``: the MLP's hidden layer sizes.

    Raises:
        ValueError: an unknown model or backend, torch asked for (or needed) but
            missing, a device the backend cannot use, or a shape the network cannot take.
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; valid models: {', '.join(MODELS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "torch" if torch_available() else "numpy"
    sizes = check_sizes((math.prod(shape), *hidden, classes)) if kind == "mlp" else ()
    if backend == "numpy":
        if kind != "mlp":
            raise ValueError(f"the {kind} model needs the torch backend (the numpy backend has the MLP only)")
        if device != "cpu":
            raise ValueError(f"the numpy backend runs on the CPU only, not {device!r}; use --backend torch")
        return NumpyMLP(sizes, seed)
    if not torch_available():
        raise ValueError("the torch backend needs PyTorch: pip install 'mpidl[torch]' (or use --backend numpy)")
    import torch

    from .torch_model import TorchModel

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    if kind == "mlp":
        from .mlp import torch_module

        return TorchModel(torch_module(sizes, seed), describe(sizes), {"model": "mlp", "layers": list(sizes)}, device)
    from . import cnn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "lenet":
            return TorchModel(cnn.lenet(shape, classes), "LeNet-5", {"model": "lenet", "input": list(shape)}, device)
        return TorchModel(
            cnn.resnet8(shape, classes), "ResNet-8 (32-64-128)", {"model": "resnet", "input": list(shape)}, device
        )


__all__ = [
    "BACKENDS",
    "MODELS",
    "Model",
    "NumpyMLP",
    "describe",
    "init_params",
    "make",
    "rank_device",
    "torch_available",
]
