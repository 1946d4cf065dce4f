"""`ExactAttacksOnly`: what `lti validate|test` evaluates when there is no learned attack to evaluate.

Without `--ckpt_path` the inverter has random weights, and its reconstructions ('the the the ...') and
scores say nothing about the learned attack. When exact-attack callbacks are configured (DAGER, SPEAR),
the CLI (`lti.trainer_cli`) evaluates this module instead of the inverter: every evaluation batch
still reaches the callbacks, which log their metrics and add their reconstructions to `samples`.
The module itself inverts nothing; it keeps what the results files need of each update (its index
and reference text, or its labels) and the attack-free baseline the attacks are read against
(`{stage}/baseline/token_acc`: the per-position majority token of the server's data, text;
`{stage}/baseline/mse`: the mean input, images and tables), as the inversion modules log it.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule
from torchmetrics import MeanSquaredError

from datamodules.metrics import TokenAccuracy

EVALUATION_STAGES = ("val", "test")


class ExactAttacksOnly(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        for stage in EVALUATION_STAGES:  # one metric object per stage, so stages never share state
            setattr(self, f"{stage}_baseline_acc", TokenAccuracy())
            setattr(self, f"{stage}_baseline_mse", MeanSquaredError())
        self.samples: list[dict] = []  # per-update records of the current evaluation (for results files)
        self.run_notes: list[str] = []  # the exact attacks' notes (e.g. why recovery cannot be exact)

    @property
    def data(self):
        return self.trainer.datamodule

    def _step(self, batch: dict, stage: str) -> None:
        index = batch["index"].reshape(-1)
        updates = index.shape[0]
        if "input_ids" in batch:  # text: (U, [m,] T) token ids
            targets = batch["input_ids"].reshape(updates, -1)
            mask = batch["attention_mask"].reshape(updates, -1)
            baseline = self.data.majority_tokens.to(targets.device).expand_as(targets)
            getattr(self, f"{stage}_baseline_acc").update(baseline, targets, mask)
            references = self.data.decode(targets, mask)
            self.samples.extend({"index": int(i), "reference": r} for i, r in zip(index, references))
        else:  # images and tables: (U, m, *input_shape)
            targets = batch["inputs"].float().flatten(0, 1)
            baseline = self.data.mean_input.to(targets).expand_as(targets)
            getattr(self, f"{stage}_baseline_mse").update(baseline.flatten(), targets.flatten())
            self.samples.extend({"index": int(i), "labels": batch["labels"][u].tolist()} for u, i in enumerate(index))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self.samples = []

    def on_test_epoch_start(self) -> None:
        self.samples = []

    def _end_evaluation(self, stage: str) -> None:
        for name, key in (("baseline_acc", "baseline/token_acc"), ("baseline_mse", "baseline/mse")):
            metric = getattr(self, f"{stage}_{name}")
            if metric.update_called:
                self.log(f"{stage}/{key}", metric.compute())
            metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._end_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._end_evaluation("test")
