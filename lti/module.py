"""The LightningModule: trains an inverter on hashed updates and evaluates its reconstructions.

A thin wrapper: the inverter (`lti.inverters`), the metrics (`datamodules.metrics`) and everything about
updates (`datamodules`) are plain PyTorch. One step function serves train/val/test; every stage has
its own metric objects.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal

import torch
from jsonargparse import lazy_instance
from lightning.pytorch import LightningModule
from torch import Tensor

from datamodules.attack_data import AttackData, TextAttackData, require
from datamodules.metrics import RougeScores, TokenAccuracy, match_sequences, reorder_sequences, rouge_f, token_accuracy
from datamodules.registry import materialize
from datamodules.training_stream import NEGATIVES, step_generator
from exact.span_evidence import EvidenceOptions, SpanEvidence
from lti.decoding import check_rule, decode
from lti.evidence_prior import EvidencePrior
from lti.inverters import EmbeddingInverter, Inverter
from lti.loss import InverterLoss

STAGES = ("train", "val", "test")
#: Module arguments that change how an evaluation reads the logits, not what was trained.
EVALUATION_ONLY = ("decoding",)

#: Sizes of the inversion problem that fix an inverter's shapes: (what it is, how to match it).
PROBLEM_SIZES = {
    "num_positions": ("positions per update (sequence length x sequences per update)",
                      "use the checkpoint's data.seq_len and data.client samples_per_update"),
    "vocab_size": ("a vocabulary of", "use the checkpoint's target model and tokenizer"),
    "num_features": ("hashed features", "use the checkpoint's hash settings"),
}

#: Learning-rate factor as a function of training progress in [0, 1] (after warm-up).
SCHEDULES = {
    "constant": lambda progress: 1.0,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    # The LTI paper's: the learning rate divided by 10 once, at the halfway epoch.
    "halfway_drop": lambda progress: 1.0 if progress < 0.5 else 0.1,
}


class LearnedInversionModule(LightningModule):
    """What every learned-inversion module shares: Adam with warm-up + cosine/constant schedule,
    checkpoints that carry the threat model (hash spec + setting), and one step function `_step(batch,
    stage)` for train/val/test. Subclasses own the inverter, the loss and the metrics, and name what
    they read from the DataModule (`data_interface`, checked once in `setup`)."""

    data_interface: type = AttackData

    def _init_training(self, inverter, lr: float, scheduler: str):
        """Checks the optimiser arguments, records the hyperparameters, returns a fresh inverter."""
        if lr <= 0:
            raise ValueError(f"lr={lr} must be > 0")
        if scheduler not in SCHEDULES:
            raise ValueError(f"scheduler {scheduler!r} is not allowed; use one of {', '.join(map(repr, SCHEDULES))}")
        # The subclass's __init__ frame holds every init argument (not just the three checked here).
        # Evaluation-only choices are not saved: Lightning's CLI puts a checkpoint's hyperparameters over
        # the command line's, so a saved `decoding` would silently replace `--model.decoding` on test.
        self.save_hyperparameters(ignore=["inverter", *EVALUATION_ONLY], frame=inspect.currentframe().f_back)
        self.run_notes: list[str] = []  # said once per run (e.g. an exact attack that cannot be exact); in results files
        #: The inverter's config ({class_path, init_args}), set by the CLI that parsed it: stored in checkpoints so
        #: that the inverter loads from its checkpoint alone.
        self.inverter_record: dict | None = None
        return materialize(inverter)

    @property
    def data(self) -> AttackData:
        return self.trainer.datamodule

    def setup(self, stage: str) -> None:
        # After the DataModule's setup, before the inverter is built: a DataModule without what this
        # module reads fails here in one line, not with an AttributeError mid-step.
        require(self.trainer.datamodule, self.data_interface, type(self).__name__)

    def configure_optimizers(self):
        # The fused Adam kernel updates the 60M first-layer weights in one pass; torch's default
        # (foreach) builds several weight-sized temporaries per step: 0.04 s vs 0.25 s a step on a
        # 2-core CPU (benchmarks/step_components.py). Same update rule.
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay,
                                     fused=self.device.type in ("cpu", "cuda"))
        warmup = self.hparams.warmup_steps
        total = max(1, self.trainer.estimated_stepping_batches)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return SCHEDULES[self.hparams.scheduler](min(1.0, (step - warmup) / max(1, total - warmup)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        # Zero in place: freeing and reallocating the first layer's 240 MB gradient every step costs
        # page faults (kernel time) on a CPU.
        optimizer.zero_grad(set_to_none=False)

    # ---------------------------------------------------------------- checkpoints carry the threat model
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lti"] = {"hash_spec": self.data.pipeline.spec.to_dict(), "setting": self.data.describe(),
                             "problem": self._problem()}
        # By content, where the CLI recorded it: the checkpoint means the same after its config file changes.
        threat_model = getattr(self.data, "threat_model", None)
        if threat_model is not None and threat_model.has_content:
            checkpoint["lti"]["threat_model"] = threat_model.to_dict()
        if self.inverter_record is not None:
            checkpoint["lti"]["inverter"] = self.inverter_record

    def _problem(self) -> dict:
        """The data-side sizes that fix the inverter's shapes (none here: the state dict's shapes say them)."""
        return {}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from datamodules.federated.hashing import HashSpec

        saved = checkpoint.get("lti", {}).get("hash_spec")
        if saved is None:
            raise ValueError("checkpoint has no hash spec: it was not written by this workbench")
        difference = self.data.pipeline.spec.difference(HashSpec.from_dict(saved))
        if difference is not None:
            raise ValueError(f"checkpoint was trained on other observed updates ({difference}); use the same target, observed parameters and hash settings")
        problem, now = checkpoint["lti"].get("problem", {}), self._problem()
        for name, (label, fix) in PROBLEM_SIZES.items():
            if name in problem and name in now and problem[name] != now[name]:
                raise ValueError(f"checkpoint was trained for {label} {problem[name]}, this run has {now[name]}; {fix}")
        mine = self.state_dict()
        for name, tensor in checkpoint.get("state_dict", {}).items():
            if name in mine and tuple(mine[name].shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint's {name} has shape {tuple(tensor.shape)}, this model's {tuple(mine[name].shape)}: "
                                 "use the checkpoint's model.inverter settings (hidden sizes)")
        self.trained_under = checkpoint["lti"].get("setting")

    # ---------------------------------------------------------------- one step for all stages
    def _step(self, batch: dict, stage: str) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self.samples = []  # per-update records of the current evaluation (for results files)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()


class InversionModule(LearnedInversionModule):
    data_interface = TextAttackData

    def __init__(
        self,
        inverter: Inverter = lazy_instance(EmbeddingInverter),
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        scheduler: Literal["constant", "cosine", "halfway_drop"] = "constant",
        warmup_steps: int = 0,
        negatives: int | None = None,
        evidence: EvidenceOptions = EvidenceOptions(),
        decoding: Literal["argmax", "distinct"] = "argmax",
    ) -> None:
        """
        Args:
            inverter: The inversion network (default: `EmbeddingInverter`; the paper's is `MLPInverter`).
            lr: Adam learning rate (paper: per defense from {1e-3, 1e-4, 1e-5}).
            weight_decay: Adam weight decay.
            scheduler: `constant`, `cosine` decay to 0, or `halfway_drop` (the LTI paper's: lr / 10 from
                half of the steps after warm-up on), over `trainer.max_steps` (or the estimated steps).
            warmup_steps: Linear warm-up steps.
            negatives: Sampled softmax in training: score the batch's target tokens plus this many
                uniformly drawn token ids instead of the whole vocabulary (a few times cheaper per
                step on a CPU; evaluation always scores every token). None: full softmax.
            evidence: The hybrid attack: DAGER's first-layer span test, computed by the server from each
                defended update, scores every token at every position; a learned function of the scores
                is added to the inverter's logits (`enabled: true`; exact/span_evidence.py).
            decoding: How logits become tokens in evaluation: `argmax` per position and sequence slot, or
                `distinct` (the m slots of a position take m different tokens; lti/decoding.py).
        """
        super().__init__()
        self.inverter = self._init_training(inverter, lr, scheduler)
        self.loss = InverterLoss(negatives)
        check_rule(decoding)
        self.evidence_options, self.decoding = evidence, decoding
        self.evidence_prior = EvidencePrior() if evidence.enabled else None
        self.span_evidence: SpanEvidence | None = None  # built in setup, from the DataModule's target
        # One metric object per stage (e.g. `val_token_acc`), so stages never share state.
        for stage in STAGES:
            setattr(self, f"{stage}_token_acc", TokenAccuracy())
            if stage != "train":
                setattr(self, f"{stage}_rouge", RougeScores())
                setattr(self, f"{stage}_baseline_acc", TokenAccuracy())
        self.samples: list[dict] = []  # per-update records of the current evaluation (for results files)

    # ---------------------------------------------------------------- set-up
    @property
    def data(self) -> TextAttackData:
        return self.trainer.datamodule

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.evidence_prior is not None and self.span_evidence is None:
            data = self.data
            if stage == "fit" and data.observation.cache.path:
                raise ValueError("model.evidence reads every training update's first layer, which the observation cache "
                                 "does not hold; set data.cache.path null (updates computed on the fly)")
            if not data.keep_eval_updates:
                raise ValueError("model.evidence reads the evaluation updates: set data.keep_eval_updates true")
            data.keep_train_updates = True
            self.span_evidence = SpanEvidence(data.pipeline.target, list(data.pipeline.names),
                                              data.samples_per_update * data.seq_len, data.seq_len, self.evidence_options)

    def configure_model(self) -> None:
        # Called after the DataModule's setup and before a checkpoint is restored.
        if not self.inverter.is_bound:
            self.inverter.bind(self.data.inversion_spec)

    def _problem(self) -> dict:
        spec = self.data.inversion_spec
        return {"num_positions": spec.num_positions, "vocab_size": spec.vocab_size, "num_features": spec.num_features}

    # ---------------------------------------------------------------- one step for all stages
    def forward(self, features: Tensor) -> Tensor:
        return self.inverter(features)

    def _evidence_bonus(self, batch: dict):
        """(token ids or None: all, indices of the uniform draws among them) -> the (U, m*L, len) logit bonus
        of the batch's span evidence; None without evidence."""
        if self.evidence_prior is None:
            return None
        if "update" not in batch:
            raise ValueError("model.evidence needs the defended update in every batch; it was not kept "
                             "(computed on the fly with data.cache.path null and data.keep_eval_updates true)")
        update = self.data.pipeline.split(batch["update"])
        sequences, dtype = self.data.samples_per_update, batch["features"].dtype

        def bonus(tokens: Tensor | None, reference: Tensor | None) -> Tensor:
            with torch.no_grad():
                scores = self.span_evidence(update, tokens, reference).to(dtype)
            return self.evidence_prior(scores, sequences)

        return bonus

    def _step(self, batch: dict, stage: str) -> Tensor:
        features = batch["features"]  # (U, k): the attack sees only the hashed update
        updates = features.shape[0]
        targets = batch["input_ids"].reshape(updates, -1)
        mask = batch["attention_mask"].reshape(updates, -1)
        training = stage == "train"
        # Negatives of the sampled softmax are drawn from the step, so a resumed run draws the same.
        generator = None
        if training and self.loss.negatives:
            step = int(batch["step"]) if "step" in batch else self.global_step
            generator = step_generator(NEGATIVES, self.data.seed, self.global_rank, step)
        sequences = self.data.samples_per_update
        loss, logits = self.loss(self.inverter, features, targets, mask, training=training, generator=generator,
                                 sequences=sequences, bonus=self._evidence_bonus(batch))
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=updates)
        if logits is None:  # sampled softmax: no full scores, so no training accuracy
            return loss
        preds = decode(logits, sequences, self.decoding if stage != "train" else "argmax")
        if sequences > 1:  # score the m predicted sequences against the true ones they match (no order)
            shape = (updates, sequences, -1)
            order = match_sequences(preds.view(shape), targets.view(shape), mask.view(shape))
            targets, mask = reorder_sequences(order, targets, mask)
        getattr(self, f"{stage}_token_acc").update(preds, targets, mask)
        self.log(f"{stage}/lti/token_acc", getattr(self, f"{stage}_token_acc"), prog_bar=True, batch_size=updates,
                 on_step=stage == "train", on_epoch=True)
        if stage != "train":
            self._evaluate_texts(batch, preds, targets, mask, stage)
        return loss

    def _evaluate_texts(self, batch: dict, preds: Tensor, targets: Tensor, mask: Tensor, stage: str) -> None:
        references = self.data.decode(targets, mask)
        reconstructions = self.data.decode(preds, mask)
        scores = [rouge_f(p, r) for p, r in zip(reconstructions, references)]
        getattr(self, f"{stage}_rouge").update(scores=scores)
        baseline = self.data.majority_tokens.to(targets.device).expand_as(targets)
        getattr(self, f"{stage}_baseline_acc").update(baseline, targets, mask)
        accuracy = token_accuracy(preds, targets, mask).tolist()
        for i, (ref, rec, score, acc) in enumerate(zip(references, reconstructions, scores, accuracy)):
            self.samples.append({
                "index": int(batch["index"][i]), "reference": ref, "lti": rec,
                "lti_token_acc": acc, **{f"lti_{k}": v for k, v in score.items()},
            })

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        logits = self(batch["features"])
        bonus = self._evidence_bonus(batch)
        preds = decode(logits if bonus is None else logits + bonus(None, None), self.data.samples_per_update, self.decoding)
        texts = self.data.decode(preds)
        return [{"index": int(i), "reconstruction": t} for i, t in zip(batch["index"], texts)]

    # ---------------------------------------------------------------- epoch ends
    def _end_evaluation(self, stage: str) -> None:
        rouge = getattr(self, f"{stage}_rouge").compute()
        self.log_dict({f"{stage}/lti/{name}": value for name, value in rouge.items()})
        self.log(f"{stage}/baseline/token_acc", getattr(self, f"{stage}_baseline_acc").compute())
        getattr(self, f"{stage}_rouge").reset()
        getattr(self, f"{stage}_baseline_acc").reset()

    def on_validation_epoch_end(self) -> None:
        self._end_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._end_evaluation("test")
