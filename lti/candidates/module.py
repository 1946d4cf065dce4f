"""Lightning wrappers of the candidate pointer: the data (evidence files) and the training step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from datamodules.metrics import RougeScores, rouge_f
from lti.candidates.evidence_file import load
from lti.candidates.pointer import CandidatePointer, pointer_targets, predict_tokens


class CandidateData(LightningDataModule):
    """Training candidates (the server's auxiliary text) and evaluation candidates (held-out client text)."""

    def __init__(self, train_files: Sequence[str], eval_files: Sequence[str], batch_size: int = 128,
                 holdout: int = 0) -> None:
        """`holdout`: the training files' last blocks kept out of training, to choose decoding settings on
        (never the evaluation files)."""
        super().__init__()
        self.train_set, self.eval_set = load(train_files), load(eval_files)
        if not 0 <= holdout < len(self.train_set):
            raise ValueError(f"--holdout {holdout} must be in [0, {len(self.train_set)}) (the training blocks)")
        self.holdout_set = self.train_set.tail(holdout) if holdout else None
        self.train_set = self.train_set.head(len(self.train_set) - holdout)
        differ = [k for k in ("config", "overrides", "count", "coefficient_width", "seq_len")
                  if self.train_set.metadata.get(k) != self.eval_set.metadata.get(k)]
        if differ:
            raise ValueError(f"the training and evaluation candidates differ in {', '.join(differ)}")
        if self.train_set.metadata["split"] == self.eval_set.metadata["split"]:
            raise ValueError(f"training and evaluation candidates both come from the {self.train_set.metadata['split']} split")
        self.batch_size = batch_size

    @staticmethod
    def _dataset(data) -> TensorDataset:
        return TensorDataset(data.ids, data.scores, data.coefficients, data.truth)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.train_set), batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.eval_set), batch_size=256)


class CandidatePointerModule(LightningModule):
    """Cross-entropy of each position's pointer at its true token's candidate (or "none")."""

    def __init__(self, embedding: torch.Tensor, coefficient_width: int, positions: int, hidden: int = 256,
                 layers: int = 4, heads: int = 4, dropout: float = 0.1, lr: float = 3e-4, weight_decay: float = 0.01,
                 max_steps: int = 10_000, decode: Callable[[torch.Tensor], list[str]] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["embedding", "decode"])
        self.pointer = CandidatePointer(embedding, coefficient_width, positions, hidden, layers, heads, dropout)
        self.decode = decode
        self.rouge = RougeScores()

    def _step(self, batch):
        ids, scores, coefficients, truth = batch
        logits = self.pointer(ids, scores, coefficients)
        targets = pointer_targets(ids, truth)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, targets, loss

    def training_step(self, batch, batch_idx):
        _, _, loss = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, _, _, truth = batch
        logits, targets, loss = self._step(batch)
        preds = predict_tokens(ids, logits)
        size = truth.shape[0]
        self.log("val/loss", loss, batch_size=size)
        self.log("val/token_acc", (preds == truth).float().mean(), batch_size=size, prog_bar=True)
        self.log("val/bag_ceiling", (targets < ids.shape[1]).float().mean(), batch_size=size)
        self.log("val/top_candidate_acc", (ids[:, :1] == truth).float().mean(), batch_size=size)  # no learning: the top candidate everywhere
        if self.decode is not None:
            self.rouge.update(scores=[rouge_f(p, r) for p, r in zip(self.decode(preds), self.decode(truth))])

    def on_validation_epoch_end(self) -> None:
        if self.decode is not None:
            for name, value in self.rouge.compute().items():
                self.log(f"val/{name}", value)
            self.rouge.reset()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = min(500, self.hparams.max_steps // 10)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
            torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, max(1, warmup)),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, self.hparams.max_steps - warmup))], [warmup])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
