"""Convolutional networks for images given as flat samples: a LeNet-5 and a small ResNet (torch).

Both take a batch of flat samples (batch x C*H*W) and restore the image
shape (C, H, W) of the dataset first.

* **LeNet-5** (LeCun, Bottou, Bengio & Haffner, 1998), in its common modern
  form: conv 5x5 with 6 channels (padding 2), ReLU, 2x2 max-pool; conv 5x5
  with 16 channels, ReLU, 2x2 max-pool; fully connected 120, 84, classes,
  with ReLU between. On 28x28 Fashion-MNIST: 61,706 parameters (241 KiB),
  about 0.4 M multiply-adds per image — little computation per byte of
  model, so its training is bound by communication on slow links. Needs
  images of at least 12x12.
* **ResNet-8** (He, Zhang, Ren & Sun, 2016, "Deep Residual Learning"): a 3x3
  stem convolution with stride 2, BatchNorm, ReLU; three stages of one basic
  residual block each (two 3x3 convolutions with BatchNorm; a 1x1
  convolution with BatchNorm on the shortcut where the shape changes), with
  ``width``, 2 ``width`` and 4 ``width`` channels and strides 1, 2, 2; global
  average pooling; a fully connected layer. With width 32 on Fashion-MNIST:
  308,074 parameters and 1,344 BatchNorm statistics (running mean and
  variance), about 10 M multiply-adds per image — bound by computation on
  a CPU.

Initialisation: torch's defaults, drawn from a generator seeded with the
run's seed (``torch.manual_seed``), so every worker builds the same model.

A torch-only module: :mod:`mpidl.models` imports it when a CNN is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def lenet(shape: Sequence[int], classes: int) -> nn.Module:
    """LeNet-5 for images of ``shape`` (C, H, W) and ``classes`` classes (module docstring).

    Raises:
        ValueError: images smaller than 12x12.
    """
    c, h, w = shape
    if min(h, w) < 12:
        raise ValueError(f"LeNet-5 needs images of at least 12x12, the dataset's are {h}x{w}")

    def side(s: int) -> int:  # conv 5x5 pad 2, pool 2, conv 5x5, pool 2
        return (s // 2 - 4) // 2

    return nn.Sequential(
        nn.Unflatten(1, (c, h, w)),
        nn.Conv2d(c, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side(h) * side(w), 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, classes),
    )


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); the shortcut a 1x1 conv with
    BatchNorm where the shape changes, else the identity."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(c_in, c_out, 3, stride), nn.ReLU(), *_conv_bn(c_out, c_out, 3, 1))
        changes = stride != 1 or c_in != c_out
        self.shortcut = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if changes else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet8(shape: Sequence[int], classes: int, width: int = 32) -> nn.Module:
    """ResNet-8 with ``width`` channels in its first stage (module docstring)."""
    return nn.Sequential(
        nn.Unflatten(1, tuple(shape)),
        *_conv_bn(shape[0], width, 3, 2),
        nn.ReLU(),
        BasicBlock(width, width, 1),
        BasicBlock(width, 2 * width, 2),
        BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )
