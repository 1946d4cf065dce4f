"""LoRA: peft adapters on the global model; the client trains and sends only them.

LoRA injects peft adapters into the global model (deterministically from a seed: the server knows
the adapter init); the client trains only the adapters and sends only their update; the observed
parameters (and the hash spec that checkpoints record) are the `lora_A` / `lora_B` weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import Tensor, nn

from datamodules.federated.losses import ClientBatch
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.protocols.base import ClientProtocol, Observation
from datamodules.federated.protocols.fedsgd import FedSGDClient
from datamodules.targets.architectures import LORA_TARGETS, architecture_of


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapted_modules(names: list[str]) -> list[str]:
    """The modules (their last name, e.g. q_proj) that the adapters among parameter `names` adapt, sorted: what a
    threat model that leaves `target_modules` to the architecture ends up adapting."""
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names if _is_adapter(name)})


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
                architecture (`datamodules.targets.architectures.LORA_TARGETS`): transformer3 linear1/linear2, GPT-2
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
    def samples_per_update(self) -> int:  # type: ignore[override]
        return self.local.samples_per_update

    @property
    def update_is_sample_mean(self) -> bool:  # type: ignore[override]
        return self.local.update_is_sample_mean

    def single_sample(self) -> "LoRAClient":
        # A shallow copy shares the adapters' settings; only the local computation takes one sample.
        single = copy.copy(self)
        single.local = self.local.single_sample()
        return single

    def privacy_steps(self) -> tuple[int, float]:
        return self.local.privacy_steps()

    def local_steps(self) -> int:
        return self.local.local_steps()

    def gradient_scale(self) -> float:
        return self.local.gradient_scale()

    def prepare(self, target: nn.Module) -> nn.Module:
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
        def matches(path):
            return any(path == m or path.endswith("." + m) for m in modules)  # peft's suffix rule
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

    def observe(self, batch: ClientBatch, observation: Observation) -> Tensor:
        if observation.trainable is None:
            observation = dataclasses.replace(observation, trainable=self.adapter_names(observation.target))
        return self.local.observe(batch, observation)


def _safe_arch(target: nn.Module) -> str | None:
    try:
        return architecture_of(target)
    except ValueError:
        return None
