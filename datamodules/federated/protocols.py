"""Client protocols beyond FedSGD: FedAvg local training and LoRA adapters (plain PyTorch + peft).

Every protocol is a registered `ClientProtocol` (`CLIENT_PROTOCOLS`: fedsgd, fedavg, lora), chosen
in YAML by `class_path`/`init_args` under `data.client`. Conventions:

* FedAvg sends the weight delta `w_start - w_end` of the observed parameters after E local epochs
  of SGD (so with E = 1, one minibatch and no momentum it is exactly lr x the FedSGD gradient).
  Each client of a batch starts from the global weights; clients never see each other.
* FedAvg's `dtype` sets the arithmetic of the local training: `model` (the target's own, float32 for
  every target here, as real clients) or `float64` (the client trains a float64 copy; the delta it
  sends is that of exact arithmetic, rounded once to the target's dtype). A float32 delta
  w_start - w_end loses digits to cancellation (|w| >> |lr x g|), which is what stops exact attacks
  that test exact spans or zeros; float64 is their best case.
* Defenses under FedAvg: DP-SGD (`Defense.acts_per_step`) clips every sequence's gradient and adds
  noise at every local step; sign, pruning and Gaussian noise act on the delta the client sends
  (`Defense.on_delta`). Gaussian noise is therefore in weight units: sigma on a delta of lr x g is
  sigma / lr on the gradient scale.
* LoRA injects peft adapters into the global model (deterministically from a seed: the server knows
  the adapter init), the client trains only the adapters and sends only their update; the observed
  parameters (and the hash spec that checkpoints record) are the `lora_A` / `lora_B` weights.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from datamodules.federated.client import (
    CLIENT_PROTOCOLS,
    ClientProtocol,
    FedSGDClient,
    FiniteCheck,
    _check_mode,
    _default_check,
    group_gradients,
    group_gradients_loop,
    grouped_per_example_gradients,
    model_mode,
)
from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.local_sgd import LocalSGD
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.presets import LORA_TARGETS, architecture_of
from datamodules.targets.base import TargetLM

__all__ = ["CLIENT_PROTOCOLS", "ClientProtocol", "FedSGDClient", "FedAvgClient", "LoRAClient"]


class FedAvgClient(LocalSGD, ClientProtocol):  # LocalSGD first: its step counts override the FedSGD defaults
    """FedAvg: E local epochs of minibatch SGD on the client's n sequences; sends w_start - w_end.

    Implementation: the schedule is `LocalSGD`'s (all U clients of a batch step in lock-step, each
    with its own flat copy of the trained parameters). The first step runs at the global weights
    through the FedSGD fast path; later steps use `client.group_gradients` (Transformer3: its engine
    with per-client weights; other models: one vmap over clients with a batched head). A minibatch
    gradient is the mean of its sequences' own mean-token-loss gradients.
    """

    name = "fedavg"

    def __init__(
        self,
        mode: Literal["train", "eval"] = "train",
        sequences_per_update: int = 4,
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
            sequences_per_update: n, the client's local sequences (one update = one client's round).
            local_epochs: E, passes over the n sequences.
            minibatch_size: B, sequences per local step (the last minibatch of an epoch may be smaller).
            lr: Local SGD learning rate eta.
            momentum: Heavy-ball momentum as `torch.optim.SGD` (0: plain SGD); the buffer starts at zero.
            trainable: fnmatch patterns of parameters trained locally besides the observed ones (None:
                the client trains exactly the observed parameters; `['*']` trains the whole model,
                which costs a copy of it per client).
            shuffle: Reshuffle the n sequences every epoch (per client, from the pipeline's
                generator); False keeps their order.
            implementation: `vmap` (fast) or `loop` (reference, one sequence at a time).
            dtype: Arithmetic of the local training: `model` (the target's dtype; float32 as real
                clients), `float32` or `float64` (exact deltas, the exact attacks' best case). Any
                other dtype than the target's trains a copy of it; the delta is sent in the
                target's dtype.
        """
        _check_mode(mode)
        if implementation not in ("vmap", "loop"):
            raise ValueError(f"client implementation {implementation!r} is not allowed; use 'vmap' or 'loop'")
        if dtype not in ("model", "float32", "float64"):
            raise ValueError(f"client dtype {dtype!r} is not allowed; use 'model', 'float32' or 'float64'")
        self.mode = mode
        self.sequences_per_update = sequences_per_update
        self._init_local_sgd(("sequences_per_update", sequences_per_update), local_epochs, minibatch_size, lr, momentum, shuffle, trainable)
        self.implementation = implementation
        self.dtype = dtype

    def _local_model(self, target: TargetLM) -> TargetLM:
        """The model the client trains: the target itself, or a copy in the client's `dtype`.
        A fresh copy per call: the global model may change between rounds, and a copy of the
        small models here costs far less than the local steps (GPT-2 124M: ~1 GB in float64)."""
        if self.dtype == "model":
            return target
        dtype = getattr(torch, self.dtype)
        if all(p.dtype == dtype for p in target.parameters() if p.is_floating_point()):
            return target
        return copy.deepcopy(target).to(dtype)

    def _step_gradient(
        self, target, names, ids, mask, weights, defense: Defense, generator, check: FiniteCheck
    ) -> Tensor:
        """One local step's gradient (U, D) for every client at its weights (None: global), after
        a per-step defense (DP-SGD sees every sequence's own gradient)."""
        updates, size, length = ids.shape
        if self.implementation == "loop":
            if defense.acts_per_step:  # groups of one sequence, each with its client's weights
                rows = None if weights is None else weights.repeat_interleave(size, dim=0)
                flat_mask = None if mask is None else mask.reshape(-1, 1, length)
                per_seq = group_gradients_loop(target, names, ids.reshape(-1, 1, length), flat_mask, rows).view(updates, size, -1)
            else:
                grad = group_gradients_loop(target, names, ids, mask, weights)
        elif defense.acts_per_step:
            per_seq = grouped_per_example_gradients(target, names, ids, mask, weights)
        else:
            grad = group_gradients(target, names, ids, mask, weights)
        if not defense.acts_per_step:
            check(grad)
            return grad
        check(per_seq)
        with torch.no_grad():
            return defense.local_step(per_seq, generator)

    def observe(
        self,
        target: TargetLM,
        names: Sequence[str],
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        defense: Defense | None = None,
        generator: torch.Generator | None = None,
        check: FiniteCheck | None = None,
        trainable: Sequence[str] | None = None,
    ) -> Tensor:
        defense = defense or NoDefense()
        check = check or _default_check
        updates, n, length = input_ids.shape
        if n != self.sequences_per_update:
            raise ValueError(f"batch has {n} sequences per update, client expects {self.sequences_per_update}")
        sent_dtype = target.get_parameter(names[0]).dtype
        target = self._local_model(target)
        trained = self.trained_names(target, names, trainable)
        params = dict(target.named_parameters())
        observed_dim = sum(params[name].numel() for name in names)
        # Global weights, flat in the order of `trained`, one stride-0 row per client.
        start = torch.cat([params[name].detach().reshape(-1) for name in trained]).expand(updates, -1)

        def step_gradient(index: Tensor, weights: Tensor | None) -> Tensor:
            ids = input_ids.gather(1, index.unsqueeze(-1).expand(-1, -1, length))
            mask = None if attention_mask is None else attention_mask.gather(1, index.unsqueeze(-1).expand(-1, -1, length))
            return self._step_gradient(target, trained, ids, mask, weights, defense, generator, check)

        with model_mode(target, self.mode), torch.enable_grad():
            delta = self.train_locally(start, observed_dim, step_gradient, generator)
        with torch.no_grad():
            return defense.on_delta(delta.to(sent_dtype), generator)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class LoRAClient(ClientProtocol):
    """LoRA fine-tuning: peft adapters on the global model; the client trains and sends only them.

    The adapters are injected into the global model once (`prepare`), initialised from `seed` (the
    server knows the global model including its adapters). peft's default init has lora_B = 0, so the
    first-round gradient of lora_A is zero; `init_b_std > 0` draws lora_B ~ N(0, std^2) instead, like
    a global model after some LoRA rounds. The local computation is `local`'s (FedSGD by default, or
    FedAvg), restricted to the adapters.
    """

    name = "lora"

    def __init__(
        self,
        rank: int = 8,
        alpha: float = 16.0,
        target_modules: list[str] | None = None,
        dropout: float = 0.0,
        seed: int = 0,
        init_b_std: float = 0.0,
        local: ClientProtocol | None = None,
    ) -> None:
        """
        Args:
            rank: LoRA rank r.
            alpha: LoRA alpha (the update is scaled by alpha / r).
            target_modules: Module-name suffixes to adapt (peft's `target_modules`). None: per
                architecture (`presets.LORA_TARGETS`): transformer3 linear1/linear2, GPT-2
                c_attn/c_proj/c_fc, Llama q/k/v/o/gate/up/down_proj, BERT query/key/value/dense.
            dropout: LoRA dropout on the adapter input (active in train mode).
            seed: Seed of the adapter initialisation (server and clients agree on it).
            init_b_std: Std of a Gaussian lora_B init (0: peft's zero init).
            local: Local computation on the adapters (default: `FedSGDClient()`; or `FedAvgClient`).
        """
        if rank < 1:
            raise ValueError(f"LoRA rank={rank} must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout={dropout} is outside [0, 1)")
        if not (init_b_std >= 0.0 and math.isfinite(init_b_std)):
            raise ValueError(f"LoRA init_b_std={init_b_std} must be a finite number >= 0")
        if local is not None and isinstance(local, LoRAClient):
            raise ValueError("LoRA's local computation cannot itself be LoRA")
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.target_modules = None if target_modules is None else list(target_modules)
        self.dropout = float(dropout)
        self.seed = int(seed)
        self.init_b_std = float(init_b_std)
        self.local = local if local is not None else FedSGDClient()

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self.local.mode

    @property
    def sequences_per_update(self) -> int:  # type: ignore[override]
        return self.local.sequences_per_update

    def privacy_steps(self) -> tuple[int, float]:
        return self.local.privacy_steps()

    def local_steps(self) -> int:
        return self.local.local_steps()

    def gradient_scale(self) -> float:
        return self.local.gradient_scale()

    def prepare(self, target: TargetLM) -> TargetLM:
        """Inject the adapters into `target` in place (deterministic from `seed`); freeze everything."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) for m in target.modules()):
            raise ValueError("the target model already has LoRA adapters; give the LoRA client a fresh target model")
        arch = None
        if self.target_modules is None:
            arch = architecture_of(target)
            if arch not in LORA_TARGETS:
                raise ValueError(f"no default LoRA target modules for {arch!r}; set target_modules (known: {', '.join(LORA_TARGETS)})")
        modules = list(self.target_modules or LORA_TARGETS[arch])
        matches = lambda path: any(path == m or path.endswith("." + m) for m in modules)  # peft's suffix rule
        for name, module in target.named_modules():
            # Inside nn.MultiheadAttention the out_proj Linear is never called (the functional
            # attention reads its weight), and peft's wrapper of the whole module merges adapters into
            # the shared base weights in place on every forward: refuse both.
            if isinstance(module, nn.MultiheadAttention) and any(matches(path) for path, _ in module.named_modules(prefix=name)):
                raise ValueError(f"LoRA on nn.MultiheadAttention ({name}) is not supported; adapt the feed-forward Linears instead")
        config = LoraConfig(
            r=self.rank, lora_alpha=self.alpha, target_modules=modules, lora_dropout=self.dropout, bias="none",
            fan_in_fan_out=(arch or _safe_arch(target)) == "gpt2",  # GPT-2's Conv1D stores W transposed
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            inject_adapter_in_model(config, target)
            if self.init_b_std > 0:
                with torch.no_grad():
                    for name, p in target.named_parameters():
                        if ".lora_B." in name:
                            p.normal_(0.0, self.init_b_std)
        for p in target.parameters():
            p.requires_grad_(False)  # the global model is fixed; clients train copies
        return target

    def adapter_names(self, target: nn.Module) -> list[str]:
        return [name for name, _ in target.named_parameters() if _is_adapter(name)]

    def observed_names(self, target: nn.Module, selection: ParameterSelection) -> list[str]:
        """The adapter parameters among the selection (e.g. a preset picks one layer's adapters)."""
        names = [name for name in selection.resolve(target) if _is_adapter(name)]
        if not names:
            raise ValueError(f"{selection!r} selects no LoRA adapter parameter (lora_A / lora_B)")
        return names

    def observe(
        self,
        target: TargetLM,
        names: Sequence[str],
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        defense: Defense | None = None,
        generator: torch.Generator | None = None,
        check: FiniteCheck | None = None,
        trainable: Sequence[str] | None = None,
    ) -> Tensor:
        trainable = list(trainable) if trainable is not None else self.adapter_names(target)
        return self.local.observe(target, names, input_ids, attention_mask, defense, generator, check, trainable)


def _safe_arch(target: nn.Module) -> str | None:
    try:
        return architecture_of(target)
    except ValueError:
        return None
