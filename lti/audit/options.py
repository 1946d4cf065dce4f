"""The audit's knobs, in groups: the federation, Flower's DP mods, the attacks, and where it writes.

The threat model (target model, LoRA adapters, client protocol, workbench defense, tokenizer, block
length, the clients' and the server's text) is not repeated here: it is the `threat_model` config, an
ordinary `lti fit` config, so the audit's clients and the server's learned inverter can never disagree
on it. These dataclasses become `lti audit --help`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from exact.batched import BatchedOptions
from exact.dager.options import RETURNED_FLOAT32, DagerOptions
from lti.candidates.decoding import DECODERS

FLOWER_DP = ("none", "local_dp", "fixed_clipping")


@dataclass
class FederationOptions:
    """The Flower federation: how many clients and rounds, and the clients' step.

    Args:
        clients: Flower clients (SuperNodes); each holds its own documents of the evaluation split.
        rounds: Federated rounds.
        batch_size: Sequences B in a client's update (overrides the threat model's samples per update).
        lr: Client learning rate: a client returns w - lr * update (FedSGD), or runs its local SGD steps at it.
        local_epochs: E, passes a client makes over its B sequences per round. 1 with `minibatch_size` None:
            one FedSGD step; more (or smaller minibatches): FedAvg, E * ceil(B / minibatch) local SGD steps
            (`datamodules.federated.FedAvgClient`), the client returning its new weights.
        minibatch_size: Sequences per local step (None: all B).
        seed: Seed of the clients' batch draws (each client holds a fixed, consecutive part of the evaluation split).
    """

    clients: int = 4
    rounds: int = 3
    batch_size: int = 1
    lr: float = 1.0e-3
    local_epochs: int = 1
    minibatch_size: int | None = None
    seed: int = 0

    def local_steps(self) -> int:
        """Local SGD steps per client and round (1: FedSGD)."""
        return self.local_epochs * math.ceil(self.batch_size / (self.minibatch_size or self.batch_size))

    def check(self) -> None:
        if self.clients < 1:
            raise ValueError(f"federation.clients={self.clients} must be >= 1")
        if self.rounds < 1:
            raise ValueError(f"federation.rounds={self.rounds} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"federation.batch_size={self.batch_size} must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"federation.lr={self.lr} must be a finite number > 0")
        if self.local_epochs < 1:
            raise ValueError(f"federation.local_epochs={self.local_epochs} must be >= 1")
        if self.minibatch_size is not None and not 1 <= self.minibatch_size <= self.batch_size:
            raise ValueError(f"federation.minibatch_size={self.minibatch_size} must be in [1, batch_size = {self.batch_size}]")


@dataclass
class FlowerDPOptions:
    """Flower's own client-side differential privacy, beside the threat model's workbench defense.

    `local_dp`: Flower's `LocalDpMod` clips each client's update to `clipping_norm` and adds Gaussian
    noise of std clipping_norm * sqrt(2 ln(1.25/delta)) / epsilon to it (epsilon, delta per round per client).
    `fixed_clipping`: Flower's `fixedclipping_mod` clips each update and the server-side wrapper
    `DifferentialPrivacyClientSideFixedClipping` adds noise of std noise_multiplier * clipping_norm /
    clients to the *aggregate*: the server sees every clipped update without noise.

    Args:
        clipping_norm: Clipping norm of the update a client returns (lr * gradient for FedSGD).
        epsilon: Local_dp: epsilon per round per client.
        delta: Local_dp: delta per round; fixed_clipping: the delta epsilon is reported at.
        noise_multiplier: Fixed_clipping: noise std of the aggregate over clipping_norm / clients.
    """

    mode: Literal["none", "local_dp", "fixed_clipping"] = "none"
    clipping_norm: float = 1.0e-3
    epsilon: float = 10.0
    delta: float = 1.0e-5
    noise_multiplier: float = 1.0

    def check(self) -> None:
        if self.mode not in FLOWER_DP:
            raise ValueError(f"flower_dp.mode={self.mode!r} is not one of {', '.join(FLOWER_DP)}")
        if self.mode == "none":
            return
        for name in ("clipping_norm", "epsilon", "delta", "noise_multiplier"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"flower_dp.{name}={value} must be a finite number > 0")
        if self.delta >= 1:
            raise ValueError(f"flower_dp.delta={self.delta} must be < 1")


@dataclass
class AttackOptions:
    """Which attacks run on which rounds' updates.

    Args:
        rounds: Rounds whose client updates are attacked (1-based); None: every round; []: none (only the federation runs).
        dager: DAGER on every attacked update (the adapters' lora_A span test).
        dager_search: DAGER's options by group (`exact.dager.options`: span tests and their thresholds, budgets,
            the causal prefix search, extensions), e.g. `--attacks.dager_search.span.l1_threshold 1e-3
            --attacks.dager_search.span.l2_threshold 1e-3` (the paper's; the default is `RETURNED_FLOAT32`'s 1e-2 for
            both, for updates read off float32 returned weights).
        batched: The batched LoRA attack on every attacked update (`exact.batched`): whitened bag recovery, a
            joint search of the B sequences scored by every layer's whitened span test and the global model's
            prior, and a least-squares check of the result against the update. Needs no trained checkpoint.
        batched_search: The batched attack's bag recovery and search (beam, prior weight, refinement, screen).
        batched_scorer: A learned scorer's weights file for the batched search (`exact.batched.scorer`: one weight
            per site and one for the prior); None: fitted by the audit itself (see `batched_scorer_updates`).
        batched_scorer_role: How the learned scorer is used: `second_opinion` (the hand-set search first; a result
            whose refit residual is above `batched_search.second_opinion_above` is searched again with the learned
            scorer, and the lower residual's result kept) or `replace` (the learned scorer alone).
        batched_scorer_updates: Without a weights file, the audit fits the learned scorer on this many updates of
            B sequences it simulates from its own auxiliary blocks (after the whitening's; cached in the run
            folder); 0: every site weighs 1 (the hand-set score; on held-out text it read as well or better than the
            learned weights, docs/audit.md).
        whitening_blocks: Auxiliary (server) blocks the batched attack's whitening statistics are computed on.
        checkpoint: The server's learned inverter (an `lti fit` checkpoint trained under `threat_model`); None: no learned attack.
        pointer: The candidate pointer (`pointer.safetensors` of `lti candidates fit`, trained on candidates of
            `threat_model`): the span test's bag of tokens, ordered by a learned network; None: not run.
        pointer_decode: How the pointer's output becomes text: `argmax`, `assign` (each candidate once), `lm`
            (a beam search adding the global model's own next-token log-probability) or `second_layer` (that
            beam search with every prefix also scored by DAGER's second-layer span test of the update).
        pointer_lm_weight: The weight of that log-probability under `lm` and `second_layer`.
        pointer_second_weight: The weight of the second-layer test's score under `second_layer`.
        probe_sequences: Measure the learned attacks' accuracy there (their staleness); 0: only the Flower clients' own updates.
        samples: Clients per round and attack whose reconstructions are shown next to their originals in the report.
    """

    rounds: list[int] | None = None
    dager: bool = True
    dager_search: DagerOptions = field(default_factory=lambda: DagerOptions(span=RETURNED_FLOAT32))
    batched: bool = True
    batched_search: BatchedOptions = field(default_factory=BatchedOptions)
    batched_scorer: str | None = None
    batched_scorer_role: Literal["second_opinion", "replace"] = "second_opinion"
    batched_scorer_updates: int = 0
    whitening_blocks: int = 256
    checkpoint: str | None = None
    pointer: str | None = None
    pointer_decode: str = "argmax"
    pointer_lm_weight: float = 0.5
    pointer_second_weight: float = 1.0
    probe_sequences: int = 128
    samples: int = 3

    def check(self, rounds: int) -> None:
        for r in self.rounds or []:
            if not 1 <= r <= rounds:
                raise ValueError(f"attacks.rounds has round {r}, but the simulation runs rounds 1..{rounds}")
        if self.pointer_decode not in DECODERS:
            raise ValueError(f"attacks.pointer_decode {self.pointer_decode!r} is not known; use {', '.join(DECODERS)}")
        for name in ("pointer_lm_weight", "pointer_second_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"attacks.{name}={value} must be finite and >= 0")
        if self.batched_scorer_role not in ("second_opinion", "replace"):
            raise ValueError(f"attacks.batched_scorer_role={self.batched_scorer_role!r} is not second_opinion or replace")
        if self.batched_scorer_updates < 0:
            raise ValueError(f"attacks.batched_scorer_updates={self.batched_scorer_updates} must be >= 0")
        if self.whitening_blocks < 1:
            raise ValueError(f"attacks.whitening_blocks={self.whitening_blocks} must be >= 1")
        if self.probe_sequences < 0:
            raise ValueError(f"attacks.probe_sequences={self.probe_sequences} must be >= 0")
        if self.samples < 0:
            raise ValueError(f"attacks.samples={self.samples} must be >= 0 (0: no reconstructions shown)")


@dataclass
class AuditOptions:
    """`lti audit`: a Flower simulation of federated LoRA fine-tuning, every client update attacked.

    Args:
        threat_model: An `lti fit` config: target model, LoRA client, defense, tokenizer, corpus, block length.
        threat_model_args: `lti fit` options over the threat model's config, e.g.
            `[--data.client.init_args.rank, "16"]` (a learned inverter must have been trained under the same).
        out_dir: The report folder (client text stays here); an interrupted audit resumes from it.
        utility_sequences: Server-side sequences (auxiliary text) for the global model's validation loss.
        wandb: Also log the report's numbers to W&B (offline, in out_dir).
    """

    threat_model: str
    threat_model_args: list[str] = field(default_factory=list)
    out_dir: str = "runs/audit"
    federation: FederationOptions = field(default_factory=FederationOptions)
    flower_dp: FlowerDPOptions = field(default_factory=FlowerDPOptions)
    attacks: AttackOptions = field(default_factory=AttackOptions)
    utility_sequences: int = 64
    wandb: bool = False

    def check(self) -> None:
        self.federation.check()
        self.flower_dp.check()
        self.attacks.check(self.federation.rounds)
        if self.utility_sequences < 1:
            raise ValueError(f"utility_sequences={self.utility_sequences} must be >= 1")

    def attacked_rounds(self) -> list[int]:
        rounds = self.attacks.rounds
        return list(range(1, self.federation.rounds + 1)) if rounds is None else sorted(set(rounds))
