"""`SpearCallback` runs SPEAR on one named ReLU layer (`layers.0` of a vision/table FCNN,
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

import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from datamodules.metrics import psnr
from exact.callbacks.base import ExactAttackCallback
from exact.spear import ReluLinear, Spear, relu_linear_layer


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
                mse = ((matched - truth) ** 2).mean(dim=1)
                psnr_sum += float(psnr(mse, min_mse=1e-30).sum())  # exact rows: up to 300 dB
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
