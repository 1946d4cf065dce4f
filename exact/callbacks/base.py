"""What every exact-attack callback shares: argument checks, the evaluation hooks, the stage and batch
filter, one warning per problem, and reading the defended update and the global model. The callbacks
read the DataModule through `datamodules.attack_data.AttackData`, checked once in `setup`."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from datamodules.attack_data import AttackData, require
from datamodules.federated.pipeline import UpdatePipeline


class ExactAttackCallback(Callback):
    """What every exact-attack callback shares: argument checks, the evaluation hooks, the stage and
    batch filter, one warning per problem, and reading the defended update and the global model."""

    attack_name = "exact attack"

    def __init__(self, max_updates_per_batch: int | None, every_n_batches: int, stages: tuple[str, ...]) -> None:
        if every_n_batches < 1:
            raise ValueError(f"every_n_batches={every_n_batches} must be >= 1")
        if max_updates_per_batch is not None and max_updates_per_batch < 1:
            raise ValueError(f"max_updates_per_batch={max_updates_per_batch} must be >= 1 or null")
        unknown = set(stages) - {"val", "test"}
        if unknown:
            raise ValueError(f"stages {sorted(unknown)} not allowed; use 'val' and/or 'test'")
        self.max_updates_per_batch = max_updates_per_batch
        self.every_n_batches = every_n_batches
        self.stages = tuple(stages)
        self._warned: set[str] = set()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require(trainer.datamodule, AttackData, type(self).__name__)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._dispatch(trainer, pl_module, batch, batch_idx, "val")

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._dispatch(trainer, pl_module, batch, batch_idx, "test")

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)
            self._warned.add(key)

    def _dispatch(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, stage: str) -> None:
        if stage not in self.stages or batch_idx % self.every_n_batches:
            return
        update = batch.get("update") if isinstance(batch, dict) else None
        if update is None:
            self._warn("update", f"the evaluation batch has no 'update' (set data.keep_eval_updates: true); "
                                 f"{self.attack_name} is skipped")
            return
        data: AttackData = trainer.datamodule
        # FedAvg sends a weight delta, lr times the sum of its local gradients: attack the mean gradient
        # (FedSGD: a factor 1).
        update = update * data.pipeline.client.gradient_scale()
        self._run(trainer, pl_module, batch, update, data.pipeline, stage)

    def _count(self, updates: int) -> int:
        return updates if self.max_updates_per_batch is None else min(updates, self.max_updates_per_batch)

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor,
             pipeline: UpdatePipeline, stage: str) -> None:
        raise NotImplementedError
