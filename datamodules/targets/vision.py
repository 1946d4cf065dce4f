"""Image/table classifiers whose client updates the server observes. Plain PyTorch, no Lightning.

* `FCNN` — SPEAR's ReLU MLP (Dimitrov et al., 2024): `num_layers` Linear layers with an `nn.ReLU`
  after each but the last, on the flattened input, as one `nn.Sequential` called `layers`: the first
  Linear is `layers.0` (followed by the ReLU `layers.1`), the i-th is `layers.{2i}`;
  `FCNN.linear_names` lists them. Parameters are addressed by name: `layers.0.weight`, `layers.0.bias`.
* `LeNet` — the LTI paper's / breaching's `LeNetZhu`: three 5x5 convolutions (12 channels, strides
  2, 2, 1, padding 2) with sigmoid activations and one Linear classifier, every weight and bias drawn
  from U(-0.5, 0.5). Works for any channel count and image size (CIFAR-10: 768 classifier inputs).

Both take `init_seed`: the weights are drawn from a private generator, so the server and every client
build the same global model without touching the global RNG. Registered in `VISION_TARGETS` by name
(`VISION_TARGETS.create("fcnn", input_shape=(1, 8, 8))`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from datamodules.registry import Registry

VISION_TARGETS: Registry["VisionTarget"] = Registry("vision target")


class VisionTarget(nn.Module, VISION_TARGETS.base()):
    """A classifier of images (C, H, W) or table rows (F,) into `num_classes` classes.

    `forward(x)` takes (B, *input_shape) and returns logits (B, num_classes).
    """

    name: ClassVar[str]
    #: Parameter-name patterns never observed by default (none: a vision client sends everything).
    default_excluded: tuple[str, ...] = ()

    def __init__(self, input_shape: Sequence[int], num_classes: int, init_seed: int) -> None:
        super().__init__()
        shape = tuple(int(s) for s in input_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"input_shape={list(input_shape)} must be non-empty positive sizes, e.g. [1, 8, 8] or [105]")
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes} must be >= 2")
        self.input_shape, self.num_classes, self.init_seed = shape, int(num_classes), int(init_seed)

    @property
    def input_dim(self) -> int:
        return math.prod(self.input_shape)

    def _seeded_init(self, init) -> None:
        """Run `init(generator)` with a private generator seeded by `init_seed` (global RNG untouched)."""
        generator = torch.Generator().manual_seed(self.init_seed)
        with torch.no_grad():
            init(generator)

    def check_input(self, x: Tensor) -> None:
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{type(self).__name__} expects inputs (batch, {', '.join(map(str, self.input_shape))}), got {tuple(x.shape)}")


class FCNN(VisionTarget):
    """SPEAR's fully connected ReLU network."""

    name = "fcnn"

    def __init__(
        self,
        input_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        hidden: int = 200,
        num_layers: int = 6,
        init_seed: int = 0,
    ) -> None:
        """
        Args:
            input_shape: Shape of one input, (C, H, W) for images or (F,) for table rows; it is flattened.
            num_classes: Output classes.
            hidden: Width of every hidden layer (SPEAR: 200 for its FCNN experiments; 1000 also used).
            num_layers: Number of Linear layers (>= 2): `layers.0`, `layers.2`, ..., `layers.{2*(num_layers-1)}`.
            init_seed: Seed of the weight initialisation (PyTorch's default Linear init, drawn privately).
        """
        super().__init__(input_shape, num_classes, init_seed)
        if num_layers < 2:
            raise ValueError(f"FCNN num_layers={num_layers} must be >= 2")
        if hidden < 1:
            raise ValueError(f"FCNN hidden={hidden} must be >= 1")
        sizes = [self.input_dim] + [hidden] * (num_layers - 1) + [num_classes]
        self.hidden, self.num_layers = int(hidden), int(num_layers)
        modules: list[nn.Module] = []
        with torch.random.fork_rng(devices=[]):  # layer constructors draw from the global RNG; keep it untouched
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                modules.append(nn.Linear(a, b))
                if i < num_layers - 1:
                    modules.append(nn.ReLU())
        self.layers = nn.Sequential(*modules)

        def init(generator: torch.Generator) -> None:
            for layer in self.linears:  # PyTorch's default: U(+-1/sqrt(fan_in)) for weight and bias
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

        self._seeded_init(init)

    @property
    def linears(self) -> list[nn.Linear]:
        return [m for m in self.layers if isinstance(m, nn.Linear)]

    @property
    def linear_names(self) -> list[str]:
        """Module names of the Linear layers in order: `layers.0`, `layers.2`, ... (each but the last followed by a ReLU)."""
        return [f"layers.{i}" for i, m in enumerate(self.layers) if isinstance(m, nn.Linear)]

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x.reshape(x.shape[0], -1))


class LeNet(VisionTarget):
    """The LTI paper's LeNet (breaching `LeNetZhu`): sigmoid activations, U(+-0.5) init."""

    name = "lenet"

    def __init__(
        self,
        input_shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        channels: int = 12,
        init_seed: int = 0,
    ) -> None:
        """
        Args:
            input_shape: (C, H, W) of one image (CIFAR-10: [3, 32, 32]; MNIST: [1, 28, 28]; digits: [1, 8, 8]).
            num_classes: Output classes.
            channels: Channels of each of the three convolutions (paper: 12).
            init_seed: Seed of the U(-0.5, 0.5) initialisation of every weight and bias.
        """
        super().__init__(input_shape, num_classes, init_seed)
        if len(self.input_shape) != 3:
            raise ValueError(f"LeNet needs image inputs (C, H, W), got input_shape={list(self.input_shape)}")
        c, h, w = self.input_shape
        for _ in range(2):  # the two stride-2 convolutions
            h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
        with torch.random.fork_rng(devices=[]):  # layer constructors draw from the global RNG; keep it untouched
            self.body = nn.Sequential(
                nn.Conv2d(c, channels, kernel_size=5, padding=2, stride=2), nn.Sigmoid(),
                nn.Conv2d(channels, channels, kernel_size=5, padding=2, stride=2), nn.Sigmoid(),
                nn.Conv2d(channels, channels, kernel_size=5, padding=2, stride=1), nn.Sigmoid(),
            )
            self.fc = nn.Sequential(nn.Linear(channels * h * w, num_classes))

        def init(generator: torch.Generator) -> None:
            for p in self.parameters():
                p.uniform_(-0.5, 0.5, generator=generator)

        self._seeded_init(init)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.body(x).flatten(1))


__all__ = ["VISION_TARGETS", "VisionTarget", "FCNN", "LeNet"]
