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
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from exact.dager import Dager
from exact.metrics import ROUGE_KEYS, score_batch


class DagerCallback(Callback):
    def __init__(
        self,
        attack: Dager | None = None,
        max_updates_per_batch: int | None = None,
        every_n_batches: int = 1,
        stages: tuple[str, ...] = ("val", "test"),
        log_samples: bool = True,
    ) -> None:
        """
        Args:
            attack: The configured attack (default: `Dager()` with its default thresholds).
            max_updates_per_batch: Attack at most this many client updates of each batch (None: all).
            every_n_batches: Attack every n-th evaluation batch only (DAGER on large models is slow).
            stages: Evaluation stages to run in (`val`, `test`).
            log_samples: Add reconstructions to `pl_module.samples` (key "dager").
        """
        if every_n_batches < 1:
            raise ValueError(f"every_n_batches={every_n_batches} must be >= 1")
        if max_updates_per_batch is not None and max_updates_per_batch < 1:
            raise ValueError(f"max_updates_per_batch={max_updates_per_batch} must be >= 1 or null")
        unknown = set(stages) - {"val", "test"}
        if unknown:
            raise ValueError(f"stages {sorted(unknown)} not allowed; use 'val' and/or 'test'")
        self.attack = attack if attack is not None else Dager()
        self.max_updates_per_batch = max_updates_per_batch
        self.every_n_batches = every_n_batches
        self.stages = tuple(stages)
        self.log_samples = log_samples
        self._warned = False

    # ------------------------------------------------------------------------------------------------------

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._run(trainer, pl_module, batch, batch_idx, "val")

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._run(trainer, pl_module, batch, batch_idx, "test")

    # ------------------------------------------------------------------------------------------------------

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, batch_idx: int, stage: str) -> None:
        if stage not in self.stages or batch_idx % self.every_n_batches:
            return
        update = batch.get("update") if isinstance(batch, dict) else None
        datamodule = trainer.datamodule
        pipeline = getattr(datamodule, "pipeline", None)
        if update is None or pipeline is None:
            if not self._warned:
                warnings.warn(
                    "DagerCallback: the evaluation batch has no 'update' (set data.keep_eval_updates: true) "
                    "or the datamodule has no pipeline; DAGER is skipped", stacklevel=2,
                )
                self._warned = True
            return
        start = time.perf_counter()
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if ids.dim() == 2:  # one sequence per update
            ids = ids[:, None]
            mask = None if mask is None else mask[:, None]
        updates, per_update, length = ids.shape
        count = updates if self.max_updates_per_batch is None else min(updates, self.max_updates_per_batch)
        split = pipeline.split(update[:count])
        tokenizer = getattr(datamodule, "tokenizer", None)
        decode = tokenizer.decode if tokenizer is not None else (lambda t: " ".join(map(str, t)))
        totals = dict.fromkeys(ROUGE_KEYS, 0.0)
        sequences = tokens = correct = exact = certified = 0
        records = []
        for u in range(count):
            result = self.attack.attack(
                pipeline.target, {name: grads[u] for name, grads in split.items()},
                batch_size=per_update, max_length=length,
            )
            scores = score_batch(
                result.sequences, ids[u].cpu(), None if mask is None else mask[u].cpu(), decode, result.exact
            )
            for key in ROUGE_KEYS:
                totals[key] += scores[key] * scores["count"]
            sequences += scores["count"]
            tokens += scores["tokens"]
            correct += scores["correct"]
            exact += round(scores["exact_fraction"] * scores["count"])
            certified += int(result.exact)
            records.append((u, result, scores))
        seconds = time.perf_counter() - start
        prefix = f"{stage}/dager"
        common = dict(on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log(f"{prefix}/token_acc", correct / max(1, tokens), batch_size=max(1, tokens), **common)
        for key in ROUGE_KEYS:
            pl_module.log(f"{prefix}/{key}", totals[key] / max(1, sequences), batch_size=max(1, sequences), **common)
        pl_module.log(f"{prefix}/exact_fraction", exact / max(1, sequences), batch_size=max(1, sequences), **common)
        pl_module.log(f"{prefix}/certified_fraction", certified / max(1, count), batch_size=max(1, count), **common)
        pl_module.log(f"{prefix}/seconds_per_batch", seconds, batch_size=1, **common)
        if self.log_samples and isinstance(getattr(pl_module, "samples", None), list):
            self._add_samples(pl_module.samples, batch, records, updates)

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
                **{f"dager_{k}": scores[k] for k in ROUGE_KEYS},
            }
            match = next((r for r in recent if key is not None and key >= 0 and r.get("index") == key), None)
            if match is not None:
                match.update(fields)
            else:
                reference = "\n".join(ref for _, ref in scores["pairs"])
                samples.append({"index": -1 if key is None else key, "reference": reference, **fields})
