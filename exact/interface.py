"""One interface for every attack on an observed update: `attack(update, threat_model, batch_size)` returns a
`Reconstruction` (the B sequences, each token's confidence where the attack has one, and which sequences the
attack certifies). The exact attacks behind it: `DagerAttack`, `BatchedAttack` and `SpearAttack` (which recovers
a layer's inputs, not tokens). Plain PyTorch.

`update` is one client's flat observed update (D,) in `threat_model.names`' order (a server gets it from the
weights it sent and those returned: `ThreatModel.update_from_weights`); `threat_model.target` must hold that
round's global weights (`ThreatModel.load_weights`). The true sequences are never an input: scoring against
them is the caller's business (`datamodules.metrics.score_batch`).

    attack = BatchedAttack(auxiliary_ids=blocks)         # or DagerAttack()
    found = attack.attack(update, threat, batch_size=4)
    print([threat.decode(s) for s in found.sequences], found.certified)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, adapter_sites
from exact.dager import Dager
from exact.dager.options import RETURNED_FLOAT32
from exact.spear import Spear, relu_linear_layer
from exact.spear.layer import attack_layer

if TYPE_CHECKING:
    from datamodules.threat_model import ThreatModel


@dataclass
class Reconstruction:
    """What an attack read off one update."""

    #: Token ids, one list per recovered sequence (an unordered set: an update has no batch order).
    sequences: list[list[int]]
    #: Per sequence: the attack certifies it (DAGER: both span tests passed; batched: the least-squares refit
    #: of the whole update left a negligible residual, which certifies every sequence at once).
    certified: list[bool]
    #: Per token, where the attack has one: higher is surer (batched: the span score's margin over the runner-up).
    confidence: list[list[float]] | None = None
    #: Attack-specific figures (DAGER's mode and ranks; the batched attack's bag, residual, phase times).
    diagnostics: dict[str, Any] = field(default_factory=dict)
    #: Wall time of the attack on this update.
    seconds: float = 0.0
    #: The attack certifies the whole update: every sequence of the batch recovered (DAGER: `exact`; batched: the refit).
    certified_update: bool = False
    #: Attacks that recover a layer's inputs rather than tokens (SPEAR): the recovered rows (N, n).
    inputs: Tensor | None = None

    def to_dict(self, decode=None) -> dict:
        """JSON-ready; with `decode` (ids -> text) also the sequences' text."""
        out = {"sequences": self.sequences, "certified": self.certified, "certified_update": self.certified_update,
               "confidence": self.confidence, "seconds": self.seconds, "diagnostics": _jsonable(self.diagnostics)}
        if self.inputs is not None:
            out["inputs"] = self.inputs.tolist()
        if decode is not None:
            out["texts"] = [decode(s) for s in self.sequences]
        return out


@runtime_checkable
class Attack(Protocol):
    """An attack on one observed update. `name` labels its rows in reports. An attack that reads only some
    batch sizes (a learned one trained on updates of m sequences) also has `reads(batch_size) -> bool`."""

    name: str

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction: ...


def token_attacks(attacks, owner: str) -> list:
    """`attacks` as a list, checked for a runner that scores token reconstructions (`owner` names it in the one-line
    errors): at least one, distinct names (they label rows and metrics), none that recovers a layer's inputs."""
    attacks = list(attacks)
    if not attacks:
        raise ValueError(f"{owner} needs at least one attack")
    names = [attack.name for attack in attacks]
    if len(set(names)) != len(names):
        raise ValueError(f"attack names must differ (they label {owner}'s rows and metrics): {names}")
    rows = [attack.name for attack in attacks if getattr(attack, "recovers", "tokens") != "tokens"]
    if rows:
        raise ValueError(f"{rows[0]} recovers a layer's inputs, not tokens: score it with SpearCallback")
    return attacks


def reads(attack: Attack, batch_size: int) -> bool:
    """Whether `attack` reads updates of `batch_size` sequences (every size, unless it says otherwise)."""
    check = getattr(attack, "reads", None)
    return True if check is None else bool(check(batch_size))


class DagerAttack:
    """DAGER (`exact.dager.Dager`) behind the interface, by default with the span tests of an update read off float32
    returned weights (`exact.dager.options.RETURNED_FLOAT32`). `trajectory`: the offsets of a multi-step client's
    local steps (`exact.dager.local_step_offsets`; () for FedSGD). Where the threat model can simulate one
    sequence's update (a FedSGD client in eval mode), certified sequences are peeled off (`Extensions.peel`)."""

    def __init__(self, dager: Dager | None = None, trajectory: tuple[float, ...] = (), name: str = "dager") -> None:
        self.dager = dager or Dager(span=RETURNED_FLOAT32)
        self.trajectory, self.name = tuple(trajectory), name

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        # DAGER reads the update at the precision the server holds it (float32 off the returned weights).
        split = {name: grads[0] for name, grads in threat_model.pipeline.split(update.reshape(1, -1)).items()}
        result = self.dager.attack(threat_model.target, split, batch_size=batch_size, max_length=threat_model.seq_len,
                                   trajectory=self.trajectory, sequence_update=threat_model.pipeline.sequence_update)
        certified = list(result.sequence_exact) or [bool(result.exact)] * len(result.sequences)
        return Reconstruction(result.sequences, certified, None, dict(result.diagnostics), time.perf_counter() - start,
                              bool(result.exact))


class BatchedAttack:
    """The batched LoRA attack (`exact.batched`) behind the interface: whitened bag recovery, the all-layer span
    search and, for a FedSGD client, the least-squares check against the threat model's own simulation.

    The whitening is the server's: given, or fitted once on blocks of its own text when the first update is
    attacked (cached at `whitening_cache` when given, keyed by the model's fingerprint). `scorer`: a learned scorer's
    (site weights, prior weight) (`exact.batched.scorer.ScorerWeights`).
    `check`: re-simulate the recovered sequences and refit the update (needs a FedSGD client: a FedAvg
    client's mean gradient along its path is no combination of the sequences' updates).
    """

    def __init__(self, options: BatchedOptions | None = None, whitening: SiteWhitening | None = None,
                 auxiliary_ids: Tensor | None = None, whitening_cache: str | None = None, whitening_blocks: int = 256,
                 scorer: tuple[Tensor, float] | None = None, second_opinion: tuple[Tensor, float] | None = None,
                 check: bool = True, name: str = "batched") -> None:
        """
        Args:
            options: The bag recovery and search settings.
            whitening: The server's whitening, if already computed.
            auxiliary_ids: (N, L) token ids of the server's own text to fit it on (the first `whitening_blocks`);
                the evaluation callback supplies its DataModule's auxiliary split when none is given.
            whitening_cache: A safetensors file the fitted whitening is cached in (None: not cached).
            whitening_blocks: Blocks of the server's text the whitening reads at most.
            scorer: A learned scorer's (site weights, prior weight) the search scores with
                (`exact.batched.scorer.ScorerWeights`; None: 1 per site and `options.lm_weight`).
            second_opinion: (site weights, prior weight) of a scorer to search again with when the refit doubts a
                result (`BatchedOptions.second_opinion_above`; needs `check`).
            check: Re-simulate the recovered sequences and refit the update (FedSGD clients only).
            name: What reports and metrics call it.
        """
        if whitening_blocks < 1:
            raise ValueError(f"whitening_blocks={whitening_blocks} must be >= 1")
        self.options = options or BatchedOptions()
        self.whitening, self.whitening_cache, self.whitening_blocks = whitening, whitening_cache, whitening_blocks
        self.auxiliary_ids = None if auxiliary_ids is None else auxiliary_ids[:whitening_blocks]
        self.scorer, self.second_opinion, self.check, self.name = scorer, second_opinion, check, name
        #: The threat model the search is bound to (the object: its target's weights change every round, in place).
        self._bound: tuple[ThreatModel, BatchedLoRA] | None = None
        self._fitted_for: str | None = None  # the model fingerprint the whitening was fitted for, if fitted here

    def needs_server_text(self) -> bool:
        return self.whitening is None and self.auxiliary_ids is None

    def use_server_text(self, auxiliary_ids: Tensor) -> None:
        """The server's own text (N, L) to fit the whitening on, when none was given."""
        self.auxiliary_ids = auxiliary_ids[: self.whitening_blocks]

    def _attack_for(self, threat_model: ThreatModel) -> BatchedLoRA:
        if self._bound is not None and self._bound[0] is threat_model:
            return self._bound[1]
        names = threat_model.names
        if self._fitted_for is not None and self._fitted_for != threat_model.fingerprint:
            self.whitening = None  # fitted here for another model: fit again for this one
        if self.whitening is None:
            if self.auxiliary_ids is None:
                raise ValueError("the batched attack needs the server's whitening or its own text to fit it on "
                                 "(auxiliary_ids: (N, L) token ids)")
            sites = adapter_sites(names)
            self.whitening = SiteWhitening.load_or_fit(self.whitening_cache, threat_model.target, sites,
                                                       self.auxiliary_ids, threat_model.fingerprint)
            self._fitted_for = threat_model.fingerprint
        bound = BatchedLoRA(threat_model.target, names, self.whitening, self.options, self.scorer, self.second_opinion)
        self._bound = (threat_model, bound)
        return bound

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        batched = self._attack_for(threat_model)
        split = threat_model.split(update)
        simulate = threat_model.simulate if self.check else None
        found = batched.attack(split, batch_size, threat_model.seq_len, simulate, update if self.check else None)
        diagnostics = {"bag": found.bag, "residual": found.residual, "coefficients": found.coefficients,
                       "phase_seconds": found.seconds, "second_opinion": found.second_opinion,
                       "budget_reached": found.budget_reached}
        return Reconstruction(found.sequences, [found.certified] * len(found.sequences), found.margins, diagnostics,
                              time.perf_counter() - start, found.certified)


class SpearAttack:
    """SPEAR (`exact.spear.Spear`) behind the interface, on one ReLU layer (`layer`: its module name, e.g.
    `encoder.layers.0.linear1` of the LTI paper's transformer3). SPEAR recovers that layer's inputs, not tokens:
    the reconstruction's `inputs` holds the recovered rows (a text update's B x L positions), its `sequences` are
    empty, and `certified_update` is SPEAR's sparsity-matching certificate. `SpearCallback` scores such rows
    against the true layer inputs (it runs the same call, `exact.spear.layer.attack_layer`)."""

    #: What the reconstruction holds: a layer's input rows, not token sequences (`AttackCallback` scores tokens only).
    recovers = "layer_inputs"

    def __init__(self, layer: str, spear: Spear | None = None, known_batch_size: bool = True,
                 prior: Tensor | None = None, name: str = "spear") -> None:
        """`known_batch_size`: give SPEAR the update's rows (B x L); False: it estimates the rank. `prior`:
        plausible layer inputs of the server's own data (N, n), which guide the search."""
        self.layer_name, self.spear = layer, spear or Spear()
        self.known_batch_size, self.prior, self.name = known_batch_size, prior, name

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        layer = relu_linear_layer(threat_model.target, self.layer_name)
        gradients = {name: grads[0] for name, grads in threat_model.pipeline.split(update.reshape(1, -1)).items()}
        rows = batch_size * threat_model.seq_len if self.known_batch_size else None
        result = attack_layer(self.spear, layer, gradients, rows, self.prior)
        diagnostics = {**result.diagnostics, "reason": result.reason, "agreement": result.agreement}
        return Reconstruction([], [], None, diagnostics, time.perf_counter() - start, bool(result.exact),
                              inputs=result.inputs)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
