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

`SpearCallback` runs SPEAR on one named ReLU layer (`layers.0` of a vision/table FCNN,
`encoder.layers.0.linear1` of transformer3) of every evaluation batch's defended update and logs

    {stage}/spear/exact_fraction, cosine, rows_recovered, seconds_per_batch
    {stage}/spear/psnr (image batches in [0, 1]), discrete_acc and continuous_mae (tables)

(`exact_fraction`: updates SPEAR certified exact, by its own sparsity-matching certificate;
`cosine`: mean over the true layer-input rows of the cosine with the best-matching recovered row;
`rows_recovered`: fraction of true rows with that cosine above `row_threshold`). The true layer
inputs, for the metrics only, come from running the global model (eval mode) on the batch's
`inputs` (images/tables) or `input_ids` (text) with a forward hook on the layer.

With `prior_samples > 0`, SPEAR is guided by the layer inputs of that many of the server's auxiliary
samples (`datamodule.auxiliary_inputs`, the same data LTI trains on; see `Spear._guided`): the threat
model of the learned attacks, and orders of magnitude fewer draws at B >= 20. 0 is the paper's SPEAR.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from exact.dager import Dager
from exact.metrics import ROUGE_KEYS, score_batch
from exact.spear import ReluLinear, Spear, relu_linear_layer


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
        """
        super().__init__(max_updates_per_batch, every_n_batches, stages)
        if multi_step_threshold is not None and not multi_step_threshold > 0:
            raise ValueError(f"multi_step_threshold={multi_step_threshold} must be > 0 or null")
        self.attack = attack if attack is not None else Dager()
        self.log_samples = log_samples
        self.multi_step_threshold = multi_step_threshold

    def _attack_for(self, pipeline: Any) -> Dager:
        """The configured attack, with thresholds loosened for multi-step clients (a shallow copy)."""
        client = getattr(pipeline, "client", None)
        steps = client.local_steps() if client is not None and hasattr(client, "local_steps") else 1
        if steps <= 1 or self.multi_step_threshold is None:
            return self.attack
        attack = copy.copy(self.attack)
        attack.l1_threshold = max(attack.l1_threshold, self.multi_step_threshold)
        attack.l2_threshold = max(attack.l2_threshold, self.multi_step_threshold)
        return attack

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor, pipeline: Any,
             stage: str) -> None:
        datamodule = trainer.datamodule
        start = time.perf_counter()
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if ids.dim() == 2:  # one sequence per update
            ids = ids[:, None]
            mask = None if mask is None else mask[:, None]
        updates, per_update, length = ids.shape
        count = self._count(updates)
        split = pipeline.split(update[:count])
        tokenizer = getattr(datamodule, "tokenizer", None)
        decode = tokenizer.decode if tokenizer is not None else (lambda t: " ".join(map(str, t)))
        totals = dict.fromkeys(ROUGE_KEYS, 0.0)
        sequences = tokens = correct = exact = certified = 0
        records = []
        attack = self._attack_for(pipeline)
        for u in range(count):
            result = attack.attack(
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


class SpearCallback(ExactAttackCallback):
    attack_name = "SPEAR"

    def __init__(
        self,
        layer: str,
        attack: Spear | None = None,
        max_updates_per_batch: int | None = None,
        every_n_batches: int = 1,
        stages: tuple[str, ...] = ("val", "test"),
        known_batch_size: bool = True,
        row_threshold: float = 0.999,
        prior_samples: int = 0,
    ) -> None:
        """
        Args:
            layer: Module name of the attacked `nn.Linear` followed by a ReLU, e.g. "layers.0" (FCNN) or
                "encoder.layers.0.linear1" (transformer3). Found by name, never by parameter position.
            attack: The configured attack (default: `Spear()`).
            max_updates_per_batch: Attack at most this many client updates of each batch (None: all).
            every_n_batches: Attack every n-th evaluation batch only.
            stages: Evaluation stages to run in (`val`, `test`).
            known_batch_size: Give SPEAR the number of layer-input rows per update (the client protocol:
                samples, or sequences x tokens for text); False lets it estimate the rank.
            row_threshold: A true row counts as recovered when its best cosine exceeds this.
            prior_samples: Guide SPEAR with the layer inputs of this many auxiliary samples of the server
                (`datamodule.auxiliary_inputs`); 0: unguided, as in the paper.
        """
        super().__init__(max_updates_per_batch, every_n_batches, stages)
        if not layer:
            raise ValueError("layer must name a Linear module, e.g. 'layers.0'")
        self.layer = layer
        self.attack = attack if attack is not None else Spear()
        self.known_batch_size = known_batch_size
        self.row_threshold = row_threshold
        if prior_samples < 0:
            raise ValueError(f"prior_samples={prior_samples} must be >= 0")
        self.prior_samples = int(prior_samples)
        self._prior_cache: tuple[Any, torch.Tensor] | None = None

    # ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _layer_inputs(target: torch.nn.Module, layer: ReluLinear, model_input: torch.Tensor) -> torch.Tensor:
        """True inputs of the layer (rows, n) for one update's samples, by a forward hook (eval mode)."""
        seen: list[torch.Tensor] = []
        handle = layer.module.register_forward_hook(lambda module, args, output: seen.append(args[0].detach()))
        was_training = target.training
        target.eval()
        try:
            with torch.no_grad():
                target(model_input)
        finally:
            handle.remove()
            target.train(was_training)
        return seen[0].reshape(-1, layer.module.in_features)

    def _prior(self, trainer: Trainer, target: torch.nn.Module, layer: ReluLinear) -> torch.Tensor | None:
        """Layer inputs of the auxiliary samples (computed once per target and layer; the global model is fixed)."""
        if self.prior_samples == 0:
            return None
        key = (id(target), self.layer)
        if self._prior_cache is not None and self._prior_cache[0] == key:
            return self._prior_cache[1]
        source = getattr(trainer.datamodule, "auxiliary_inputs", None)
        if source is None:
            self._warn("prior", "the datamodule has no auxiliary_inputs(); SPEAR runs without a prior")
            return None
        inputs = source(self.prior_samples)
        device = next(target.parameters()).device
        prior = torch.cat([self._layer_inputs(target, layer, chunk.to(device)).double().cpu()
                           for chunk in inputs.split(256)])
        self._prior_cache = (key, prior)
        return prior

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor, pipeline: Any,
             stage: str) -> None:
        target = pipeline.target
        try:
            layer = relu_linear_layer(target, self.layer)
        except (KeyError, TypeError) as error:
            self._warn("layer", f"{error}; SPEAR is skipped")
            return
        if layer.followed_by_relu is False:
            self._warn("relu", f"layer {self.layer!r} is not followed by a ReLU; SPEAR's assumptions do not hold")
        if "inputs" in batch:
            model_inputs, text = batch["inputs"], False
        elif "input_ids" in batch:
            model_inputs, text = batch["input_ids"], True
            if model_inputs.dim() == 2:  # one sequence per update
                model_inputs = model_inputs[:, None]
        else:
            self._warn("truth", "the batch has neither 'inputs' nor 'input_ids'; SPEAR is skipped")
            return
        start = time.perf_counter()
        updates = model_inputs.shape[0]
        count = self._count(updates)
        split = pipeline.split(update[:count])
        if layer.weight_name not in split:
            self._warn("observed", f"{layer.weight_name!r} is not among the observed parameters; SPEAR is skipped")
            return
        columns = list(getattr(trainer.datamodule, "table_columns", None) or [])
        data = getattr(trainer.datamodule, "data", None)
        images = not text and model_inputs.dim() == 5
        prior = self._prior(trainer, target, layer)
        certified = rows = recovered = 0
        cosine_sum = psnr_sum = 0.0
        psnr_count = discrete_total = discrete_correct = 0
        mae_sum, mae_count = 0.0, 0
        for u in range(count):
            truth = self._layer_inputs(target, layer, model_inputs[u]).double().cpu()
            bias_grad = split[layer.bias_name][u] if layer.bias_name in split else None
            result = self.attack.attack(
                split[layer.weight_name][u], bias_grad, batch_size=truth.shape[0] if self.known_batch_size else None,
                weight=layer.module.weight, bias=layer.module.bias, prior=prior,
            )
            certified += int(result.exact)
            rows += truth.shape[0]
            recovered_rows = result.inputs.double().cpu()
            if recovered_rows.shape[0] == 0:
                continue
            cos = torch.nn.functional.normalize(truth, dim=1) @ torch.nn.functional.normalize(recovered_rows, dim=1).T
            best, match = cos.max(dim=1)
            cosine_sum += float(best.sum())
            recovered += int((best > self.row_threshold).sum())
            matched = recovered_rows[match]
            flat = model_inputs[u].reshape(truth.shape[0], -1).double().cpu() if not text else None
            first_layer = flat is not None and flat.shape == truth.shape and torch.allclose(flat, truth)
            if images and first_layer and float(flat.min()) >= 0.0 and float(flat.max()) <= 1.0:
                mse = ((matched - truth) ** 2).mean(dim=1).clamp_min(1e-30)
                psnr_sum += float((10 * torch.log10(1.0 / mse)).sum())
                psnr_count += truth.shape[0]
            if columns and first_layer:
                for column in columns:
                    kind, where = (column.kind, column.slice) if hasattr(column, "kind") else (column[1], column[2])
                    if kind == "discrete":
                        discrete_correct += int((matched[:, where].argmax(1) == truth[:, where].argmax(1)).sum())
                        discrete_total += truth.shape[0]
                if data is not None and hasattr(data, "destandardize"):
                    raw_true, raw_pred = data.destandardize(truth), data.destandardize(matched)
                    for column in columns:
                        kind, where = (column.kind, column.slice) if hasattr(column, "kind") else (column[1], column[2])
                        if kind == "continuous":
                            mae_sum += float((raw_pred[:, where] - raw_true[:, where]).abs().sum())
                            mae_count += truth.shape[0]
        seconds = time.perf_counter() - start
        prefix = f"{stage}/spear"
        common = dict(on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log(f"{prefix}/exact_fraction", certified / max(1, count), batch_size=max(1, count), **common)
        pl_module.log(f"{prefix}/cosine", cosine_sum / max(1, rows), batch_size=max(1, rows), **common)
        pl_module.log(f"{prefix}/rows_recovered", recovered / max(1, rows), batch_size=max(1, rows), **common)
        pl_module.log(f"{prefix}/seconds_per_batch", seconds, batch_size=1, **common)
        if psnr_count:
            pl_module.log(f"{prefix}/psnr", psnr_sum / psnr_count, batch_size=psnr_count, **common)
        if discrete_total:
            pl_module.log(f"{prefix}/discrete_acc", discrete_correct / discrete_total, batch_size=discrete_total, **common)
        if mae_count:
            pl_module.log(f"{prefix}/continuous_mae", mae_sum / mae_count, batch_size=mae_count, **common)
