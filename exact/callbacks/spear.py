"""`SpearCallback` runs SPEAR on one named ReLU layer (`layers.0` of a vision/table FCNN,
`encoder.layers.0.linear1` of transformer3) of every evaluation batch's defended update and logs

    {stage}/spear/exact_fraction, certified_fraction, cosine, rows_recovered, seconds_per_batch
    {stage}/spear/psnr (image batches in [0, 1]), discrete_acc and continuous_mae (tables)

(`exact_fraction`: updates whose every true row was recovered (cosine above `row_threshold`), judged
against the truth as DAGER's is; `certified_fraction`: updates SPEAR certified exact, by its own
sparsity-matching certificate, which reads no truth; `cosine`: mean over the true layer-input rows of the cosine with the best-matching recovered row;
`rows_recovered`: fraction of true rows with that cosine above `row_threshold`). The true layer
inputs, for the metrics only, come from running the global model (eval mode) on the batch's
`inputs` (images/tables) or `input_ids` (text) with a forward hook on the layer.

With `prior_samples > 0`, SPEAR is guided by the layer inputs of that many of the server's auxiliary
samples (`datamodule.auxiliary_inputs`, the same data LTI trains on; see `exact.spear.prior.guided`):
the threat model of the learned attacks, and orders of magnitude fewer draws at B >= 20. 0 is the
paper's SPEAR.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from datamodules.attack_data import AttackData
from datamodules.federated.pipeline import UpdatePipeline
from datamodules.federated.protocols.base import model_mode
from datamodules.float_noise import same_up_to_float_noise
from datamodules.metrics import discrete_accuracy, psnr
from exact.callbacks.base import ExactAttackCallback
from exact.spear import ReluLinear, Spear, relu_linear_layer
from exact.spear.layer import attack_layer


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
        try:
            with torch.no_grad(), model_mode(target, "eval"):
                target(model_input)
        finally:
            handle.remove()
        return seen[0].reshape(-1, layer.module.in_features)

    def _prior(self, trainer: Trainer, target: torch.nn.Module, layer: ReluLinear) -> torch.Tensor | None:
        """Layer inputs of the auxiliary samples (computed once per target and layer; the global model is fixed)."""
        if self.prior_samples == 0:
            return None
        key = (id(target), self.layer)
        if self._prior_cache is not None and self._prior_cache[0] == key:
            return self._prior_cache[1]
        data: AttackData = trainer.datamodule
        inputs = data.auxiliary_inputs(self.prior_samples)
        device = next(target.parameters()).device
        prior = torch.cat([self._layer_inputs(target, layer, chunk.to(device)).double().cpu()
                           for chunk in inputs.split(256)])
        self._prior_cache = (key, prior)
        return prior

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: dict, update: torch.Tensor,
             pipeline: UpdatePipeline, stage: str) -> None:
        target = pipeline.target
        try:
            layer = relu_linear_layer(target, self.layer)
        except (KeyError, TypeError) as error:
            self._warn("layer", f"{error}; SPEAR is skipped")
            return
        if layer.followed_by_relu is False:
            self._warn("relu", f"layer {self.layer!r} is not followed by a ReLU; SPEAR's assumptions do not hold")
        found = _model_inputs(batch)
        if found is None:
            self._warn("truth", "the batch has neither 'inputs' nor 'input_ids'; SPEAR is skipped")
            return
        model_inputs, text = found
        start = time.perf_counter()
        updates = model_inputs.shape[0]
        count = self._count(updates)
        split = pipeline.split(update[:count])
        if layer.weight_name not in split:
            self._warn("observed", f"{layer.weight_name!r} is not among the observed parameters; SPEAR is skipped")
            return
        data: AttackData = trainer.datamodule
        columns = list(data.table_columns)
        images = not text and model_inputs.dim() == 5
        prior = self._prior(trainer, target, layer)
        tally = _Tally()
        for u in range(count):
            truth = self._layer_inputs(target, layer, model_inputs[u]).double().cpu()
            result = attack_layer(self.attack, layer, {name: grads[u] for name, grads in split.items()},
                                  truth.shape[0] if self.known_batch_size else None, prior)
            tally.certified += int(result.exact)
            tally.rows += truth.shape[0]
            recovered_rows = result.inputs.double().cpu()
            if recovered_rows.shape[0] == 0:
                continue
            matched = tally.add_match(truth, recovered_rows, self.row_threshold)
            flat = model_inputs[u].reshape(truth.shape[0], -1).double().cpu() if not text else None
            first_layer = flat is not None and same_up_to_float_noise(flat, truth)  # the layer reads the inputs as given
            if images and first_layer and float(flat.min()) >= 0.0 and float(flat.max()) <= 1.0:
                tally.add_psnr(matched, truth)
            if columns and first_layer:
                tally.add_table(matched, truth, columns, data)
        tally.log(pl_module, f"{stage}/spear", count, time.perf_counter() - start)


def _model_inputs(batch: dict) -> tuple[torch.Tensor, bool] | None:
    """(What the global model is run on per update, whether it is text); None when the batch has neither."""
    if "inputs" in batch:
        return batch["inputs"], False
    if "input_ids" in batch:
        model_inputs = batch["input_ids"]
        if model_inputs.dim() == 2:  # one sequence per update
            model_inputs = model_inputs[:, None]
        return model_inputs, True
    return None


@dataclass
class _Tally:
    """Sums over one batch's attacked updates; `log` writes their means."""

    certified: int = 0
    complete: int = 0  # updates whose every true row was recovered
    rows: int = 0
    recovered: int = 0
    cosine_sum: float = 0.0
    psnr_sum: float = 0.0
    psnr_count: int = 0
    discrete_correct: int = 0
    discrete_total: int = 0
    mae_sum: float = 0.0
    mae_count: int = 0

    def add_match(self, truth: torch.Tensor, recovered_rows: torch.Tensor, row_threshold: float) -> torch.Tensor:
        """Count each true row's best cosine with a recovered row; return the best-matching recovered rows."""
        cos = torch.nn.functional.normalize(truth, dim=1) @ torch.nn.functional.normalize(recovered_rows, dim=1).T
        best, match = cos.max(dim=1)
        self.cosine_sum += float(best.sum())
        self.recovered += int((best > row_threshold).sum())
        self.complete += int(bool((best > row_threshold).all()))
        return recovered_rows[match]

    def add_psnr(self, matched: torch.Tensor, truth: torch.Tensor) -> None:
        mse = ((matched - truth) ** 2).mean(dim=1)
        self.psnr_sum += float(psnr(mse, min_mse=1e-30).sum())  # exact rows: up to 300 dB
        self.psnr_count += truth.shape[0]

    def add_table(self, matched: torch.Tensor, truth: torch.Tensor, columns: list[tuple[str, str, slice]],
                  data: AttackData) -> None:
        """Discrete accuracy over all one-hot blocks of all rows; MAE of continuous columns in original units."""
        columns = [(kind, where) for _, kind, where in columns]
        discrete = [where for kind, where in columns if kind == "discrete"]
        if discrete:
            # discrete_accuracy gives each row's fraction of recovered blocks; times the block count that is
            # the row's (integer) number of recovered blocks, so the logged ratio stays correct / total.
            fractions = discrete_accuracy(matched, truth, discrete)
            self.discrete_correct += int((fractions * len(discrete)).round().sum())
            self.discrete_total += truth.shape[0] * len(discrete)
        raw_true, raw_pred = data.destandardize(truth), data.destandardize(matched)
        for kind, where in columns:
            if kind == "continuous":
                self.mae_sum += float((raw_pred[:, where] - raw_true[:, where]).abs().sum())
                self.mae_count += truth.shape[0]

    def log(self, pl_module: LightningModule, prefix: str, count: int, seconds: float) -> None:
        common = {"on_step": False, "on_epoch": True, "sync_dist": True}
        pl_module.log(f"{prefix}/exact_fraction", self.complete / max(1, count), batch_size=max(1, count), **common)
        pl_module.log(f"{prefix}/certified_fraction", self.certified / max(1, count), batch_size=max(1, count), **common)
        pl_module.log(f"{prefix}/cosine", self.cosine_sum / max(1, self.rows), batch_size=max(1, self.rows), **common)
        pl_module.log(f"{prefix}/rows_recovered", self.recovered / max(1, self.rows), batch_size=max(1, self.rows),
                      **common)
        pl_module.log(f"{prefix}/seconds_per_batch", seconds, batch_size=1, **common)
        if self.psnr_count:
            pl_module.log(f"{prefix}/psnr", self.psnr_sum / self.psnr_count, batch_size=self.psnr_count, **common)
        if self.discrete_total:
            pl_module.log(f"{prefix}/discrete_acc", self.discrete_correct / self.discrete_total,
                          batch_size=self.discrete_total, **common)
        if self.mae_count:
            pl_module.log(f"{prefix}/continuous_mae", self.mae_sum / self.mae_count, batch_size=self.mae_count,
                          **common)
