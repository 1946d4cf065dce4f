"""Lightning adapters for the exact attacks: run them on every evaluation batch's defended update.

`DagerCallback` reads, for each validation/test batch, the defended observed update the server saw
(`batch["update"]`, kept by the DataModule for evaluation) and the global model
(`trainer.datamodule.pipeline`), runs DAGER on every client update, and logs next to LTI's metrics:

    {stage}/dager/token_acc, rouge1, rouge2, rougeL, exact_fraction, certified_fraction, seconds_per_batch

(`exact_fraction`: sequences recovered exactly, checked against the batch's true tokens;
`certified_fraction`: updates DAGER itself certified as exact, without looking at the truth). The
reconstructions go into `pl_module.samples` (key "dager") when the module keeps samples, so the
results writer puts them in `<stage>_samples.jsonl` and the W&B table beside LTI's.

The attack never reads the true tokens; they are used here for the metrics only.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule, Trainer

from datamodules.attack_data import AttackData
from datamodules.federated.pipeline import UpdatePipeline
from datamodules.metrics import ROUGE_TYPES, ScoreTotals, score_batch
from exact.callbacks.base import ExactAttackCallback
from exact.dager import Dager, local_step_offsets
from exact.dager.feasibility import feasibility_notes


class DagerCallback(ExactAttackCallback):
    attack_name = "DAGER"
    def __init__(
        self,
        attack: Dager | None = None,
        max_updates_per_batch: int | None = None,
        every_n_batches: int = 1,
        stages: tuple[str, ...] = ("val", "test"),
        log_samples: bool = True,
        multi_step_threshold: float | None = 1e-2,
        follow_trajectory: bool = True,
    ) -> None:
        """
        Args:
            attack: The configured attack (default: `Dager()` with its default thresholds).
            max_updates_per_batch: Attack at most this many client updates of each batch (None: all).
            every_n_batches: Attack every n-th evaluation batch only (DAGER on large models is slow).
            stages: Evaluation stages to run in (`val`, `test`).
            log_samples: Add reconstructions to `pl_module.samples` (key "dager").
            multi_step_threshold: When the client takes several local steps (FedAvg), raise DAGER's layer-1
                and layer-2 thresholds to at least this: later steps see inputs computed with already
                updated weights, so the true tokens sit slightly off the span (DAGER's FedAvg setting;
                measured on transformer3: 1e-3 recovers 50-88% of FedAvg E=1-2 sequences, 1e-2 all).
                None keeps the attack's thresholds.
            follow_trajectory: For a multi-step client with a learning rate (FedAvg), also run the
                second-layer test at the weights a straight path puts the client at before each local
                step (`Dager.attack(trajectory=...)`, offsets t * lr), so sequences seen only after the
                first step are tested at (nearly) the weights they were seen at.
        """
        super().__init__(max_updates_per_batch, every_n_batches, stages)
        if multi_step_threshold is not None and not multi_step_threshold > 0:
            raise ValueError(f"multi_step_threshold={multi_step_threshold} must be > 0 or null")
        self.attack = attack if attack is not None else Dager()
        self.log_samples = log_samples
        self.multi_step_threshold = multi_step_threshold
        self.follow_trajectory = follow_trajectory
        self._feasibility_said = False

    def _attack_for(self, pipeline: UpdatePipeline) -> Dager:
        """The configured attack, or for multi-step clients a new one derived from it with the
        thresholds loosened (`Dager.with_options`; the configured attack is never modified)."""
        steps = pipeline.client.local_steps()
        if steps <= 1 or self.multi_step_threshold is None:
            return self.attack
        span = self.attack.options.span
        return self.attack.with_options(span={
            "l1_threshold": max(span.l1_threshold, self.multi_step_threshold),
            "l2_threshold": max(span.l2_threshold, self.multi_step_threshold),
        })

    def _trajectory(self, pipeline: UpdatePipeline) -> tuple[float, ...]:
        """Offsets t * lr of a multi-step client's local steps (the update DAGER reads is the mean of
        their gradients: `gradient_scale`), or () for FedSGD and when not following."""
        return local_step_offsets(pipeline.client) if self.follow_trajectory else ()

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor,
             pipeline: UpdatePipeline, stage: str) -> None:
        data: AttackData = trainer.datamodule
        start = time.perf_counter()
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if ids.dim() == 2:  # one sequence per update
            ids = ids[:, None]
            mask = None if mask is None else mask[:, None]
        updates, per_update, length = ids.shape
        # The attack is told the protocol's sequences per update and block length (what the server
        # knows), never sizes read off the client's data.
        protocol_batch = data.samples_per_update
        protocol_length = data.seq_len if data.seq_len is not None else length
        count = self._count(updates)
        split = pipeline.split(update[:count])
        decode = data.tokenizer.decode if data.tokenizer is not None else (lambda t: " ".join(map(str, t)))
        totals = ScoreTotals()
        certified = 0
        records = []
        attack = self._attack_for(pipeline)
        trajectory = self._trajectory(pipeline)
        for u in range(count):
            result = attack.attack(
                pipeline.target, {name: grads[u] for name, grads in split.items()},
                batch_size=protocol_batch, max_length=protocol_length, trajectory=trajectory,
                sequence_update=pipeline.sequence_update,
            )
            self._say_feasibility(pl_module, pipeline, result.diagnostics, attack.options.span.min_codimension,
                                   protocol_batch)
            scores = score_batch(
                result.sequences, ids[u].cpu(), None if mask is None else mask[u].cpu(), decode, result.exact
            )
            totals.add(scores)
            certified += int(result.exact)
            records.append((u, result, scores))
        seconds = time.perf_counter() - start
        prefix = f"{stage}/dager"
        common = dict(on_step=False, on_epoch=True, sync_dist=True)
        means, sequences = totals.means(), max(1, totals.sequences)
        pl_module.log(f"{prefix}/token_acc", means["token_acc"], batch_size=max(1, totals.tokens), **common)
        for key in (*ROUGE_TYPES, "exact_fraction"):
            pl_module.log(f"{prefix}/{key}", means[key], batch_size=sequences, **common)
        pl_module.log(f"{prefix}/certified_fraction", certified / max(1, count), batch_size=max(1, count), **common)
        pl_module.log(f"{prefix}/seconds_per_batch", seconds, batch_size=1, **common)
        if self.log_samples and isinstance(getattr(pl_module, "samples", None), list):
            self._add_samples(pl_module.samples, batch, records, updates)

    def _say_feasibility(self, pl_module: LightningModule, pipeline: UpdatePipeline, diagnostics: dict, min_codimension: int,
                         batch_size: int | None = None) -> None:
        """Once per run, after the first attack: why exact recovery may be impossible here, from what the
        server has (the width, the defense, the update's ranks) (console and the metrics file's `notes`)."""
        if self._feasibility_said:
            return
        self._feasibility_said = True
        target = pipeline.target
        width = getattr(target, "hidden_size", None) or target.embedding_matrix.shape[1]
        notes = [f"DAGER: {note}" for note in feasibility_notes(
            int(width), pipeline.defense.describe(), diagnostics.get("rank1"), diagnostics.get("rank2"), min_codimension,
            diagnostics.get("candidates_per_position"), batch_size, bool(diagnostics.get("bidirectional")))]
        for note in notes:
            print(f"lti: note: {note}")
        if notes and isinstance(getattr(pl_module, "run_notes", None), list):
            pl_module.run_notes.extend(notes)

    @staticmethod
    def _add_samples(samples: list, batch: dict, records: list, updates: int) -> None:
        index = batch.get("index")
        recent = samples[-updates:] if updates else []
        for u, result, scores in records:
            key = int(index[u]) if isinstance(index, torch.Tensor) and index.numel() > u else None
            # The m recovered sequences in the order of the references they were matched to.
            text = "\n".join(pred for pred, _ in scores["pairs"])
            fields = {
                "dager": text,
                "dager_exact": bool(scores["exact_fraction"] == 1.0),
                "dager_certified": bool(result.exact),
                "dager_token_acc": scores["token_acc"],
                **{f"dager_{k}": scores[k] for k in ROUGE_TYPES},
            }
            match = next((r for r in recent if key is not None and key >= 0 and r.get("index") == key), None)
            if match is not None:
                match.update(fields)
            else:
                reference = "\n".join(ref for _, ref in scores["pairs"])
                samples.append({"index": -1 if key is None else key, "reference": reference, **fields})
