"""The FedAvg client's local training schedule, shared by the text and the vision clients. No Lightning.

A FedAvg client runs E local epochs over its n samples in minibatches of B (the last minibatch of an
epoch may be smaller), SGD with learning rate eta and optional heavy-ball momentum (as
`torch.optim.SGD`), and sends w_start - w_end. `LocalSGD` holds that schedule and the lock-step loop
over all U clients of a batch (each with its own flat copy of the trained parameters); the protocol
supplies one function: the gradient of every client's current minibatch at its current weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

#: (minibatch indices (U, b) into each client's n samples, client weights (U, D) or None = the global
#: weights) -> (U, D) gradients, after any per-step defense (DP-SGD).
StepGradient = Callable[[Tensor, "Tensor | None"], Tensor]


class LocalSGD:
    """Mixin: E epochs of minibatch SGD on the client's n samples; the delta w_start - w_end."""

    local_epochs: int
    minibatch_size: int
    lr: float
    momentum: float
    shuffle: bool

    def _init_local_sgd(
        self, samples: tuple[str, int], local_epochs: int, minibatch_size: int, lr: float, momentum: float, shuffle: bool
    ) -> None:
        """Validates and stores the schedule; `samples` is (the protocol's name for n, n)."""
        for key, value in (samples, ("local_epochs", local_epochs), ("minibatch_size", minibatch_size)):
            if value < 1:
                raise ValueError(f"FedAvg {key}={value} must be >= 1")
        if not (lr > 0.0 and math.isfinite(lr)):
            raise ValueError(f"FedAvg lr={lr} must be a finite number > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"FedAvg momentum={momentum} is outside [0, 1)")
        self._local_samples = int(samples[1])
        self.local_epochs = int(local_epochs)
        self.minibatch_size = int(minibatch_size)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.shuffle = bool(shuffle)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self._local_samples / self.minibatch_size)

    def local_steps(self) -> int:
        return self.local_epochs * self.steps_per_epoch

    def privacy_steps(self) -> tuple[int, float]:
        """One accountant step per local step, sample rate B / n."""
        return self.local_steps(), min(1.0, self.minibatch_size / self._local_samples)

    def gradient_scale(self) -> float:
        """The delta is lr x the sum of the steps' gradients: 1 / (steps x lr) makes it their mean."""
        return 1.0 / (self.local_steps() * self.lr)

    def minibatch_order(self, updates: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """(U, n) sample order of one epoch per client: a fresh permutation each epoch unless shuffle is off."""
        n = self._local_samples
        if not self.shuffle:
            return torch.arange(n, device=device).expand(updates, n)
        draw_device = generator.device if generator is not None else device
        return torch.rand(updates, n, generator=generator, device=draw_device).argsort(dim=1).to(device)

    def train_locally(
        self, start: Tensor, observed_dim: int, step_gradient: StepGradient, generator: torch.Generator | None
    ) -> Tensor:
        """Runs the schedule for U clients in lock-step from `start` (U, D) (the global weights, flat; a
        stride-0 expansion is fine). Returns the undefended deltas (U, observed_dim) of the first
        `observed_dim` columns (the observed parameters come first; the rest are trained, not sent)."""
        updates = start.shape[0]
        weights, buffer, first = start, None, True
        for _ in range(self.local_epochs):
            order = self.minibatch_order(updates, generator, start.device)
            for step in range(self.steps_per_epoch):
                index = order[:, step * self.minibatch_size : (step + 1) * self.minibatch_size]
                # The first step runs at the global weights (None), which lets protocols take their
                # FedSGD fast path; later steps at every client's own weights.
                grad = step_gradient(index, None if first else weights)
                first = False
                with torch.no_grad():
                    # torch.optim.SGD: buf = momentum * buf + g (buf = g at the first step); w -= lr * buf.
                    if self.momentum:
                        buffer = grad if buffer is None else buffer.mul(self.momentum).add_(grad)
                        grad = buffer
                    weights = weights - self.lr * grad
        with torch.no_grad():
            return (start[:, :observed_dim] - weights[:, :observed_dim]).contiguous()
