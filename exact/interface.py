"""One interface for every attack on an observed update: `attack(update, threat_model, batch_size)` returns a
`Reconstruction` (the B sequences, each token's confidence where the attack has one, and which sequences the
attack certifies). The exact attacks behind it: `DagerAttack` and `BatchedAttack`. Plain PyTorch.

`update` is one client's flat observed update (D,) in `threat_model.names`' order (a server gets it from the
weights it sent and those returned: `ThreatModel.update_from_weights`); `threat_model.target` must hold that
round's global weights (`ThreatModel.load_weights`). The true sequences are never an input: scoring against
them is the caller's business (`datamodules.metrics.score_batch`).

    attack = BatchedAttack(auxiliary_ids=blocks)         # or DagerAttack()
    found = attack.attack(update, threat, batch_size=4)
    print([threat.decode(s) for s in found.sequences], found.certified)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, adapter_sites
from exact.dager import Dager

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

    def to_dict(self, decode=None) -> dict:
        """JSON-ready; with `decode` (ids -> text) also the sequences' text."""
        out = {"sequences": self.sequences, "certified": self.certified, "confidence": self.confidence,
               "seconds": self.seconds, "diagnostics": _jsonable(self.diagnostics)}
        if decode is not None:
            out["texts"] = [decode(s) for s in self.sequences]
        return out


@runtime_checkable
class Attack(Protocol):
    """An attack on one observed update. `name` labels its rows in reports."""

    name: str

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction: ...


class DagerAttack:
    """DAGER (`exact.dager.Dager`) behind the interface. `trajectory`: the offsets of a multi-step client's
    local steps (`exact.dager.local_step_offsets`; () for FedSGD)."""

    name = "dager"

    def __init__(self, dager: Dager | None = None, trajectory: tuple[float, ...] = ()) -> None:
        self.dager = dager or Dager()
        self.trajectory = tuple(trajectory)

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        # DAGER reads the update at the precision the server holds it (float32 off the returned weights).
        split = {name: grads[0] for name, grads in threat_model.pipeline.split(update.reshape(1, -1)).items()}
        result = self.dager.attack(threat_model.target, split, batch_size=batch_size, max_length=threat_model.seq_len,
                                   trajectory=self.trajectory)
        certified = list(result.sequence_exact) or [bool(result.exact)] * len(result.sequences)
        diagnostics = dict(result.diagnostics)
        diagnostics["exact"] = bool(result.exact)
        return Reconstruction(result.sequences, certified, None, diagnostics, time.perf_counter() - start)


class BatchedAttack:
    """The batched LoRA attack (`exact.batched`) behind the interface: whitened bag recovery, the all-layer span
    search and, for a FedSGD client, the least-squares check against the threat model's own simulation.

    The whitening is the server's: given, or fitted once on `auxiliary_ids` (N, L) blocks of its own text when
    the first update is attacked (cached at `whitening_cache` when given, keyed by the model's fingerprint). `site_weights`: a learned scorer's (`exact.batched.scorer.ScorerWeights.sites`).
    `check`: re-simulate the recovered sequences and refit the update (needs a FedSGD client: a FedAvg
    client's mean gradient along its path is no combination of the sequences' updates).
    """

    name = "batched"

    def __init__(self, options: BatchedOptions | None = None, whitening: SiteWhitening | None = None,
                 auxiliary_ids: Tensor | None = None, whitening_cache: str | os.PathLike | None = None,
                 site_weights: Tensor | None = None, check: bool = True) -> None:
        if whitening is None and auxiliary_ids is None:
            raise ValueError("the batched attack needs the server's whitening or auxiliary text to fit it on "
                             "(auxiliary_ids: (N, L) token ids)")
        self.options = options or BatchedOptions()
        self.whitening, self.auxiliary_ids, self.whitening_cache = whitening, auxiliary_ids, whitening_cache
        self.site_weights, self.check = site_weights, check
        self._bound: tuple[int, BatchedLoRA] | None = None

    def _attack_for(self, threat_model: ThreatModel) -> BatchedLoRA:
        if self._bound is not None and self._bound[0] == id(threat_model.target):
            return self._bound[1]
        names = threat_model.names
        if self.whitening is None:
            sites = adapter_sites(names)
            self.whitening = SiteWhitening.load_or_fit(self.whitening_cache, threat_model.target, sites,
                                                       self.auxiliary_ids, threat_model.fingerprint)
        bound = BatchedLoRA(threat_model.target, names, self.whitening, self.options, self.site_weights)
        self._bound = (id(threat_model.target), bound)
        return bound

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        batched = self._attack_for(threat_model)
        split = threat_model.split(update)
        simulate = threat_model.simulate if self.check else None
        found = batched.attack(split, batch_size, threat_model.seq_len, simulate, update if self.check else None)
        diagnostics = {"bag": found.bag, "residual": found.residual, "coefficients": found.coefficients,
                       "phase_seconds": found.seconds}
        return Reconstruction(found.sequences, [found.certified] * len(found.sequences), found.margins, diagnostics,
                              time.perf_counter() - start)


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
