"""`AttackCallback`: any list of `exact.interface.Attack`s on every evaluation batch's defended updates, scored
next to the learned attack's metrics:

    {stage}/{attack.name}/token_acc, rouge1, rouge2, rougeL, exact_fraction, certified_fraction, seconds_per_batch

The attacks see the update and the threat model (`ThreatModel` around the DataModule's pipeline) and the
protocol's sequences per update, never the batch's tokens, which score them. An attack that needs the server's own
text (the batched attack's whitening) gets the DataModule's auxiliary blocks. Text DataModules only.

    lti validate --config configs/audit/inverter_smollm2_lora.yaml \
        --trainer.callbacks+=exact.callbacks.AttackCallback \
        --trainer.callbacks.attacks+=exact.interface.BatchedAttack --trainer.callbacks.attacks+=exact.interface.DagerAttack
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule, Trainer

from datamodules.attack_data import AttackData
from datamodules.federated.pipeline import UpdatePipeline
from datamodules.metrics import ROUGE_TYPES, ScoreTotals, score_batch
from datamodules.threat_model import ThreatModel
from exact.callbacks.base import ExactAttackCallback
from exact.interface import Attack, reads, token_attacks


class AttackCallback(ExactAttackCallback):
    attack_name = "the attacks"

    def __init__(self, attacks: list[Attack], max_updates_per_batch: int | None = None, every_n_batches: int = 1,
                 stages: tuple[str, ...] = ("val", "test"), log_samples: bool = True) -> None:
        """
        Args:
            attacks: The attacks, each logged under its `name`.
            max_updates_per_batch: Attack at most this many client updates of each batch (None: all).
            every_n_batches: Attack every n-th evaluation batch only.
            stages: Evaluation stages to run in (`val`, `test`).
            log_samples: Add reconstructions to `pl_module.samples` (key: the attack's name).
        """
        super().__init__(max_updates_per_batch, every_n_batches, stages)
        self.attacks, self.log_samples = token_attacks(attacks, "AttackCallback"), log_samples
        self._threat: ThreatModel | None = None

    def _threat_model(self, data: AttackData, pipeline: UpdatePipeline) -> ThreatModel:
        if self._threat is None or self._threat.pipeline is not pipeline:
            own = getattr(data, "threat_model", None)
            self._threat = (own if own is not None and own.pipeline is pipeline
                            else ThreatModel.from_pipeline(pipeline, data.seq_len, loaded_tokenizer=data.tokenizer))
            for attack in self.attacks:  # the server's own text, for attacks that need it
                if getattr(attack, "needs_server_text", lambda: False)():
                    attack.use_server_text(data.blocks(data.prior_split)[0])
        return self._threat

    def _attacks_for(self, pipeline: UpdatePipeline) -> list[Attack]:
        """The attacks run on this pipeline's updates (a subclass may adapt them to its client protocol)."""
        return self.attacks

    def _attacked(self, pl_module: LightningModule, pipeline: UpdatePipeline, attack: Attack, found, per_update: int) -> None:
        """Called after each update an attack read (a subclass's notes on what it found)."""

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor,
             pipeline: UpdatePipeline, stage: str) -> None:
        data: AttackData = trainer.datamodule
        if data.seq_len is None:
            self._warn("text", "the attacks read text updates; this DataModule holds none: skipped")
            return
        threat = self._threat_model(data, pipeline)
        # Scored as text; without a tokenizer (token ids of a synthetic vocabulary) as the ids themselves.
        decode = data.tokenizer.decode if data.tokenizer is not None else (lambda t: " ".join(map(str, t)))
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if ids.dim() == 2:  # one sequence per update
            ids, mask = ids[:, None], None if mask is None else mask[:, None]
        per_update = data.samples_per_update  # what the server knows, never read off the client's data
        count = self._count(ids.shape[0])
        common = dict(on_step=False, on_epoch=True, sync_dist=True)
        for attack in self._attacks_for(pipeline):
            if not reads(attack, per_update):
                self._warn(f"reads-{attack.name}", f"{attack.name} does not read updates of {per_update} sequences: skipped")
                continue
            start, totals, certified, texts = time.perf_counter(), ScoreTotals(), 0, []
            for u in range(count):
                found = attack.attack(update[u], threat, per_update)
                scores = score_batch(found.sequences, ids[u].cpu(), None if mask is None else mask[u].cpu(),
                                     decode, found.certified_update)
                totals.add(scores)
                certified += int(found.certified_update)
                texts.append((u, scores, found))
                self._attacked(pl_module, pipeline, attack, found, per_update)
            prefix, means = f"{stage}/{attack.name}", totals.means()
            pl_module.log(f"{prefix}/token_acc", means["token_acc"], batch_size=max(1, totals.tokens), **common)
            for key in (*ROUGE_TYPES, "exact_fraction"):
                pl_module.log(f"{prefix}/{key}", means[key], batch_size=max(1, totals.sequences), **common)
            pl_module.log(f"{prefix}/certified_fraction", certified / max(1, count), batch_size=max(1, count), **common)
            pl_module.log(f"{prefix}/seconds_per_batch", time.perf_counter() - start, batch_size=1, **common)
            if self.log_samples and isinstance(getattr(pl_module, "samples", None), list):
                _add_samples(pl_module.samples, batch, attack.name, texts, ids.shape[0])


def _add_samples(samples: list, batch: dict, name: str, texts: list, updates: int) -> None:
    """The reconstructions beside the module's own samples of the same updates (matched by index): the text, whether
    it is exact and certified, and its scores, each key prefixed by the attack's name."""
    index = batch.get("index")
    recent = samples[-updates:] if updates else []
    for u, scores, found in texts:
        key = int(index[u]) if isinstance(index, torch.Tensor) and index.numel() > u else None
        # The recovered sequences in the order of the references they were matched to.
        fields = {name: "\n".join(pred for pred, _ in scores["pairs"]),
                  f"{name}_exact": bool(scores["exact_fraction"] == 1.0),
                  f"{name}_certified": bool(found.certified_update),
                  f"{name}_token_acc": scores["token_acc"],
                  **{f"{name}_{k}": scores[k] for k in ROUGE_TYPES}}
        match = next((r for r in recent if key is not None and key >= 0 and r.get("index") == key), None)
        if match is not None:
            match.update(fields)
        else:
            samples.append({"index": -1 if key is None else key,
                            "reference": "\n".join(ref for _, ref in scores["pairs"]), **fields})
