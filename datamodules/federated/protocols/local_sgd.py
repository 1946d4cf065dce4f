"""Client step schedules: FedSGD's single step and FedAvg's local SGD. No Lightning.

`SingleStep` is FedSGD's: the update is one gradient. `LocalSGD` is FedAvg's:
a FedAvg client runs E local epochs over its n samples in minibatches of B (the last minibatch of an
epoch may be smaller), SGD with learning rate eta and optional heavy-ball momentum (as
`torch.optim.SGD`), and sends w_start - w_end. `LocalSGD` holds that schedule and the lock-step loop
over all U clients of a batch (each with its own flat copy of the trained parameters); the protocol
supplies one function: the gradient of every client's current minibatch at its current weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

#: (minibatch indices (U, b) into each client's n samples, client weights (U, D) or None = the global
#: weights) -> (U, D) gradients, after any per-step defense (DP-SGD).
StepGradient = Callable[[Tensor, "Tensor | None"], Tensor]


class SingleStep:
    """Mixin: the step counts of a client that sends one gradient (FedSGD)."""

    def privacy_steps(self) -> tuple[int, float]:
        """(noisy steps, sample rate) of DP-SGD on one client, for the accountant."""
        return 1, 1.0

    def local_steps(self) -> int:
        """Optimiser steps between the global weights and the update sent (1 for FedSGD)."""
        return 1

    def gradient_scale(self) -> float:
        """Factor turning a sent update into a pseudo-gradient (the mean gradient of the local steps):
        1 for FedSGD; 1 / (steps * lr) for a weight delta, which is lr times the sum of the steps'
        gradients (DAGER's FedAvg setting). Exact attacks run on update * gradient_scale()."""
        return 1.0


class LocalSGD(SingleStep):
    """Mixin: E epochs of minibatch SGD on the client's n samples; the delta w_start - w_end."""

    trainable: list[str] | None
    samples_per_update: int  # n, the client's local samples
    local_epochs: int
    minibatch_size: int
    lr: float
    momentum: float
    shuffle: bool

    def _init_local_sgd(
        self, samples_per_update: int, local_epochs: int, minibatch_size: int, lr: float, momentum: float, shuffle: bool,
        trainable: Sequence[str] | None,
    ) -> None:
        """Validates and stores the schedule."""
        for key, value in (("samples_per_update", samples_per_update), ("local_epochs", local_epochs),
                           ("minibatch_size", minibatch_size)):
            if value < 1:
                raise ValueError(f"FedAvg {key}={value} must be >= 1")
        if not (lr > 0.0 and math.isfinite(lr)):
            raise ValueError(f"FedAvg lr={lr} must be a finite number > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"FedAvg momentum={momentum} is outside [0, 1)")
        self.samples_per_update = int(samples_per_update)
        self.local_epochs = int(local_epochs)
        self.minibatch_size = int(minibatch_size)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.shuffle = bool(shuffle)
        self.trainable = None if trainable is None else list(trainable)

    def trained_names(self, target: nn.Module, names: Sequence[str], trainable: Sequence[str] | None = None) -> list[str]:
        """Observed names first (their delta is sent), then the other parameters the client trains:
        `trainable` names if given, else those matching the client's `trainable` patterns."""
        if trainable is not None:
            extra = [n for n in trainable if n not in names]
        elif self.trainable is not None:
            extra = [
                n for n, _ in target.named_parameters()
                if n not in names and any(fnmatchcase(n, p) for p in self.trainable)
            ]
        else:
            extra = []
        return list(names) + extra

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.samples_per_update / self.minibatch_size)

    def local_steps(self) -> int:
        return self.local_epochs * self.steps_per_epoch

    def privacy_steps(self) -> tuple[int, float]:
        """One accountant step per local step, sample rate B / n."""
        return self.local_steps(), min(1.0, self.minibatch_size / self.samples_per_update)

    def gradient_scale(self) -> float:
        """The delta is lr x the sum of the steps' gradients: 1 / (steps x lr) makes it their mean."""
        return 1.0 / (self.local_steps() * self.lr)

    def minibatch_order(self, updates: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """(U, n) sample order of one epoch per client: a fresh permutation each epoch unless shuffle is off."""
        n = self.samples_per_update
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
