"""Lightning wrappers of the candidate pointer: the data (evidence files) and the training step."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from datamodules.atomic_files import write_text_atomically
from datamodules.metrics import RougeScores, rouge_f
from lti.candidates.evidence_file import differing, load
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
        differ = differing(self.train_set.metadata, self.eval_set.metadata)
        if differ:
            raise ValueError(f"the training and evaluation candidates differ in {', '.join(differ)}")
        if self.train_set.metadata["split"] == self.eval_set.metadata["split"]:
            raise ValueError(f"training and evaluation candidates both come from the {self.train_set.metadata['split']} split")
        self.batch_size = batch_size

    def majority_tokens(self) -> torch.Tensor:
        """(L,) each position's most frequent training token: the attack-free baseline."""
        return self.train_set.truth.mode(dim=0).values

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
                 max_steps: int = 10_000, decode: Callable[[torch.Tensor], list[str]] | None = None,
                 majority: torch.Tensor | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["embedding", "decode", "majority"])
        self.register_buffer("majority", majority, persistent=False)
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
        if self.majority is not None:
            self.log("val/baseline/token_acc", (self.majority[None] == truth).float().mean(), batch_size=size)
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


def fit(args, command: str) -> dict:
    """`lti candidates fit` (`lti.candidates.cli` parses `args`): train, validate the final weights, save
    them with `result.json`; returns the result. A second run never replaces a first one's files unasked."""
    from lti.checkpoint_folder import checkpoint_files, claim

    out = Path(args.out_dir)
    earlier = [p for p in (out / "pointer.safetensors", out / "result.json") if p.exists()]
    earlier += checkpoint_files(out / "checkpoints")
    if earlier and args.ckpt_path is None and not args.overwrite:
        # a second run never replaces a first one's weights, curve or checkpoints unasked
        raise ValueError(f"--out_dir {out} holds an earlier run ({', '.join(p.name for p in earlier)}): resume it with "
                         f"--ckpt_path {out / 'checkpoints' / 'last.ckpt'}, choose another --out_dir, or --overwrite")
    folder = claim(out / "checkpoints", args.ckpt_path, args.overwrite)  # one run at a time in this folder
    try:
        if args.overwrite and args.ckpt_path is None:
            (out / "curve.csv").unlink(missing_ok=True)  # claim removed the earlier checkpoints; the curve goes too
        return _fit(args, command, out)
    finally:
        folder.release()


def _fit(args, command: str, out: Path) -> dict:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lti.candidates.weights import save_pointer
    from lti.console import StepProgressBar
    from lti.curves import LearningCurve
    from lti.trainer_cli import instantiate, use_atomic_checkpoints

    seed_everything(args.seed)
    data = CandidateData(args.train, args.eval, args.batch_size, args.holdout)
    meta = data.train_set.metadata
    _, threat = instantiate(meta["config"], json.loads(meta["overrides"]))  # the target's embedding and tokenizer
    module = CandidatePointerModule(threat.pipeline.target.embedding_matrix, int(meta["coefficient_width"]),
                                    int(meta["seq_len"]), args.hidden, args.layers, args.heads, args.dropout, args.lr,
                                    args.weight_decay, args.max_steps, decode=threat.decode,
                                    majority=data.majority_tokens())
    trainer = Trainer(accelerator=args.accelerator, devices=1, max_steps=args.max_steps, max_time=args.max_time,
                      val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      logger=CSVLogger(out, name="logs"), default_root_dir=out, precision=args.precision,
                      callbacks=[LearningCurve(str(out / "curve.csv")), StepProgressBar(),
                                 ModelCheckpoint(out / "checkpoints", save_last=True, every_n_train_steps=args.val_every)])
    use_atomic_checkpoints(trainer)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    trainer.validate(module, datamodule=data, verbose=False)  # the final weights, whatever the last interval
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    result = {"command": command, "steps": trainer.global_step,
              "wall_minutes": round((time.perf_counter() - start) / 60, 2), "train_blocks": len(data.train_set),
              "eval_blocks": len(data.eval_set), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              **metrics}
    if data.holdout_set is not None:
        result["holdout_blocks"] = len(data.holdout_set)
    trained = data.train_set.blocks
    save_pointer(module.pointer, out / "pointer.safetensors", meta, len(data.train_set),
                 0 if data.holdout_set is None else len(data.holdout_set),
                 None if trained is None else int(trained.max()) + 1)
    write_text_atomically(out / "result.json", json.dumps(result, indent=2) + "\n")
    return result
