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

from lightning.pytorch import LightningModule

from datamodules.federated.pipeline import UpdatePipeline
from exact.callbacks.attacks import AttackCallback
from exact.dager import Dager, local_step_offsets
from exact.dager.feasibility import feasibility_notes
from exact.interface import DagerAttack


class DagerCallback(AttackCallback):
    """DAGER through the attack callback (`AttackCallback` with one `DagerAttack`, named `dager`), adapted to the
    client protocol: a multi-step client's thresholds loosened and its local steps' path followed; the first update
    read says why exact recovery may be impossible here."""

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
        if multi_step_threshold is not None and not multi_step_threshold > 0:
            raise ValueError(f"multi_step_threshold={multi_step_threshold} must be > 0 or null")
        self.attack = attack if attack is not None else Dager()
        super().__init__([DagerAttack(self.attack)], max_updates_per_batch, every_n_batches, stages, log_samples)
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

    def _attacks_for(self, pipeline: UpdatePipeline) -> list[DagerAttack]:
        return [DagerAttack(self._attack_for(pipeline), self._trajectory(pipeline))]

    def _attacked(self, pl_module: LightningModule, pipeline: UpdatePipeline, attack: DagerAttack, found,
                  per_update: int) -> None:
        self._say_feasibility(pl_module, pipeline, found.diagnostics, attack.dager.options.span.min_codimension,
                              per_update)

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
