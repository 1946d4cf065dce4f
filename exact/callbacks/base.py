"""What every exact-attack callback shares: argument checks, the evaluation hooks, the stage and batch
filter, one warning per problem, and reading the defended update and the global model."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


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
        pipeline = getattr(trainer.datamodule, "pipeline", None)
        if update is None or pipeline is None:
            self._warn("update", "the evaluation batch has no 'update' (set data.keep_eval_updates: true) or the "
                                 f"datamodule has no pipeline; {self.attack_name} is skipped")
            return
        client = getattr(pipeline, "client", None)
        if client is not None and hasattr(client, "gradient_scale"):
            # FedAvg sends a weight delta, lr times the sum of its local gradients: attack the mean gradient.
            update = update * client.gradient_scale()
        self._run(trainer, pl_module, batch, update, pipeline, stage)

    def _count(self, updates: int) -> int:
        return updates if self.max_updates_per_batch is None else min(updates, self.max_updates_per_batch)

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor, pipeline: Any,
             stage: str) -> None:
        raise NotImplementedError
