"""FedAvg: E local epochs of minibatch SGD on the client's n samples; the client sends w_start - w_end.

Conventions (the same for text and image/table clients):

* Each client of a batch starts from the global weights; clients never see each other. With E = 1,
  one minibatch and no momentum the delta is exactly lr x the FedSGD gradient.
* `dtype` sets the arithmetic of the local training: `model` (the target's own, float32 for every
  target here, as real clients), `float32` or `float64` (the client trains a float64 copy; the delta
  it sends is that of exact arithmetic, rounded once to the target's dtype). A float32 delta
  w_start - w_end loses digits to cancellation (|w| >> |lr x g|: with lr = 0.01 it keeps about 3
  significant digits), which is what stops exact attacks that test exact spans or zeros (SPEAR,
  DAGER); float64 is their best case.
* Defenses: DP-SGD (`Defense.acts_per_step`) clips every sample's gradient and adds noise at every
  local step; sign, pruning and Gaussian noise act on the delta the client sends (`Defense.on_delta`).
  Gaussian noise is therefore in weight units: sigma on a delta of lr x g is sigma / lr on the
  gradient scale.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import Tensor, nn

from datamodules.federated.losses import ClientBatch
from datamodules.federated.protocols.base import ClientProtocol, Observation, check_choice, model_mode
from datamodules.federated.protocols.local_sgd import LocalSGD


class FedAvgClient(LocalSGD, ClientProtocol):  # LocalSGD first: its step counts override the FedSGD defaults
    """FedAvg: E local epochs of minibatch SGD on the client's n samples; sends w_start - w_end.

    Implementation: the schedule is `LocalSGD`'s (all U clients of a batch step in lock-step, each
    with its own flat copy of the trained parameters). Every step asks the client's loss for the
    gradient of every client's minibatch at its own weights (`ClientLoss.group_gradients`; text
    Transformer3: its engine with per-client weights; other models: one vmap over clients), or for
    every sample's own gradient when DP-SGD clips them. The first step runs at the global weights,
    where the losses take their FedSGD fast paths. A minibatch gradient is the mean of its samples'
    own gradients.
    """

    name = "fedavg"

    def __init__(
        self,
        mode: Literal["train", "eval"] = "train",
        samples_per_update: int = 4,
        local_epochs: int = 1,
        minibatch_size: int = 2,
        lr: float = 0.01,
        momentum: float = 0.0,
        trainable: list[str] | None = None,
        shuffle: bool = True,
        implementation: Literal["vmap", "loop"] = "vmap",
        dtype: Literal["model", "float32", "float64"] = "model",
    ) -> None:
        """
        Args:
            mode: `train` (dropout on, the realistic default) or `eval` (dropout off).
            samples_per_update: n, the client's local samples (text: sequences; one update = one client's round).
            local_epochs: E, passes over the n samples.
            minibatch_size: B, samples per local step (the last minibatch of an epoch may be smaller).
            lr: Local SGD learning rate eta.
            momentum: Heavy-ball momentum as `torch.optim.SGD` (0: plain SGD); the buffer starts at zero.
            trainable: fnmatch patterns of parameters trained locally besides the observed ones (None:
                the client trains exactly the observed parameters; `['*']` trains the whole model,
                which costs a copy of it per client).
            shuffle: Reshuffle the n samples every epoch (per client, from the pipeline's
                generator); False keeps their order.
            implementation: `vmap` (fast) or `loop` (reference, one sample at a time).
            dtype: Arithmetic of the local training: `model` (the target's dtype; float32 as real
                clients), `float32` or `float64` (exact deltas, the exact attacks' best case). Any
                other dtype than the target's trains a copy of it; the delta is sent in the
                target's dtype.
        """
        check_choice("mode", mode, ("train", "eval"))
        check_choice("implementation", implementation, ("vmap", "loop"))
        check_choice("dtype", dtype, ("model", "float32", "float64"))
        self.mode = mode
        self._init_local_sgd(samples_per_update, local_epochs, minibatch_size, lr, momentum, shuffle, trainable)
        self.implementation = implementation
        self.dtype = dtype

    def _local_model(self, target: nn.Module) -> nn.Module:
        """The model the client trains: the target itself, or a copy in the client's `dtype`.
        A fresh copy per call: the global model may change between rounds, and a copy of the
        small models here costs far less than the local steps (GPT-2 124M: ~1 GB in float64)."""
        if self.dtype == "model":
            return target
        dtype = getattr(torch, self.dtype)
        if all(p.dtype == dtype for p in target.parameters() if p.is_floating_point()):
            return target
        return copy.deepcopy(target).to(dtype)

    def observe(self, batch: ClientBatch, observation: Observation) -> Tensor:
        loss, defense, generator, check = observation.loss, observation.defense, observation.generator, observation.check
        names = observation.names
        updates, _ = self.check_batch(batch, loss)
        sent_dtype = observation.target.get_parameter(names[0]).dtype
        target = self._local_model(observation.target)
        batch = loss.cast(batch, next(p.dtype for p in target.parameters() if p.is_floating_point()))
        trained = self.trained_names(target, names, observation.trainable)
        params = dict(target.named_parameters())
        observed_dim = sum(params[name].numel() for name in names)
        # Global weights, flat in the order of `trained`, one stride-0 row per client.
        start = torch.cat([params[name].detach().reshape(-1) for name in trained]).expand(updates, -1)

        def step_gradient(index: Tensor, weights: Tensor | None) -> Tensor:
            """One local step's gradient (U, D) for every client at its weights (None: global), after
            a per-step defense (DP-SGD sees every sample's own gradient)."""
            minibatch = loss.select(batch, index)
            if not defense.acts_per_step:
                gradient = loss.group_gradients(target, trained, minibatch, weights, self.implementation)
                check(gradient)
                return gradient
            per_example = loss.grouped_per_example_gradients(target, trained, minibatch, weights, self.implementation)
            check(per_example)
            with torch.no_grad():
                return defense.local_step(per_example, generator)

        with model_mode(target, self.mode), torch.enable_grad():
            delta = self.train_locally(start, observed_dim, step_gradient, generator)
        with torch.no_grad():
            return defense.on_delta(delta.to(sent_dtype), generator)
