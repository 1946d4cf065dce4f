"""Vision LTI: an MLP inverter from hashed client updates to the client's images (or table rows).

The LTI paper's image setting (Wu et al., UAI 2023, Table 1): a 3-layer MLP inverter (hidden width
3000) from the observed update to the pixels, sigmoid output, MSE loss. With m > 1 samples per update
the order of the reconstructed samples is arbitrary, so loss and metrics match reconstructions to
references per update (Hungarian assignment on the per-sample MSE), as the LTI code does.

Metrics per stage (own torchmetrics objects): `{stage}/lti/mse`; on evaluation also `psnr` (dB, mean
over images), `ssim` (images), `discrete_acc` (tables: argmax of every one-hot column), and the
attack-free baseline `{stage}/baseline/mse` (the mean auxiliary input). Every evaluation saves a PNG
grid (references on top, reconstructions below) under `<default_root_dir>/images/` and logs it to W&B.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.loggers import WandbLogger
from PIL import Image
from torch import Tensor, nn
from torchmetrics import MeanMetric, MeanSquaredError

from datamodules.attack_data import ImageAttackData
from datamodules.metrics import discrete_accuracy, match_samples, psnr, ssim
from lti.module import STAGES, LearnedInversionModule


class ImageMLPInverter(nn.Module):
    """k hashed features -> `num_layers` Linear layers (ReLU between) -> (m, *input_shape) reconstruction."""

    def __init__(
        self,
        hidden: int = 3000,
        num_layers: int = 3,
        input_norm: Literal["none", "rms"] = "rms",
        output: Literal["auto", "sigmoid", "linear"] = "auto",
    ) -> None:
        """
        Args:
            hidden: Width of the hidden layers (paper: 3000).
            num_layers: Linear layers (paper: 3, i.e. k -> hidden -> hidden -> m*C*H*W).
            input_norm: `rms` divides each update's features by their RMS (scale-free across defenses:
                raw gradients vs sign sums); `none` feeds them as they are (the paper).
            output: `sigmoid` (pixels in [0, 1]), `linear` (standardised table values) or `auto`
                (sigmoid for images, linear for tables).
        """
        super().__init__()
        if hidden < 1 or num_layers < 1:
            raise ValueError(f"ImageMLPInverter hidden={hidden} and num_layers={num_layers} must be >= 1")
        if input_norm not in ("none", "rms"):
            raise ValueError(f"input_norm {input_norm!r} is not allowed; use 'none' or 'rms'")
        if output not in ("auto", "sigmoid", "linear"):
            raise ValueError(f"output {output!r} is not allowed; use 'auto', 'sigmoid' or 'linear'")
        self.hidden, self.num_layers, self.input_norm, self.output = hidden, num_layers, input_norm, output
        self.output_shape: tuple[int, ...] | None = None
        self.net: nn.Sequential | None = None

    @property
    def is_bound(self) -> bool:
        return self.net is not None

    def bind(self, num_features: int, output_shape: tuple[int, ...], kind: str = "image") -> None:
        """Create the layers for k features and (m, *input_shape) outputs (idempotent for the same sizes)."""
        if self.net is not None:
            if self.output_shape != tuple(output_shape) or self.net[0].in_features != num_features:
                raise ValueError("inverter is already built for a different feature count or output shape")
            return
        self.output_shape = tuple(output_shape)
        sizes = [num_features] + [self.hidden] * (self.num_layers - 1) + [math.prod(output_shape)]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        sigmoid = self.output == "sigmoid" or (self.output == "auto" and kind == "image")
        if sigmoid:
            layers.append(nn.Sigmoid())
        self.net = nn.Sequential(*layers)

    def forward(self, features: Tensor) -> Tensor:
        if self.net is None:
            raise RuntimeError("call bind() before using the inverter")
        x = features.float()
        if self.input_norm == "rms":
            x = x / x.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-12)
        return self.net(x).view(features.shape[0], *self.output_shape)


def image_grid(references: Tensor, reconstructions: Tensor, min_size: int = 32) -> np.ndarray:
    """(N, C, H, W) pairs in [0, 1] -> uint8 grid: references on the top row, reconstructions below."""
    n, c, h, w = references.shape
    scale = max(1, -(-min_size // max(h, w)))
    pad = 2
    rows = []
    for images in (references, reconstructions):
        tiles = images.clamp(0, 1).repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
        tiles = nn.functional.pad(tiles, (pad, pad, pad, pad), value=1.0)  # white frame
        rows.append(torch.cat(list(tiles), dim=2))  # (C, H', n*W')
    grid = (torch.cat(rows, dim=1) * 255).round().to(torch.uint8)
    grid = grid.permute(1, 2, 0).cpu().numpy()
    return grid[:, :, 0] if c == 1 else grid


class ImageInversionModule(LearnedInversionModule):
    data_interface = ImageAttackData

    def __init__(
        self,
        inverter: ImageMLPInverter = lazy_instance(ImageMLPInverter),
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        scheduler: Literal["constant", "cosine", "halfway_drop"] = "constant",
        warmup_steps: int = 0,
        match_order: bool = True,
        grid_samples: int = 16,
    ) -> None:
        """
        Args:
            inverter: The inversion network (default: the paper's 3-layer MLP, hidden 3000).
            lr: Adam learning rate.
            weight_decay: Adam weight decay.
            scheduler: `constant`, `cosine` decay to 0, or `halfway_drop` (lr / 10 from half of the
                training on), over `trainer.max_steps` (or the estimated steps).
            warmup_steps: Linear warm-up steps.
            match_order: With m > 1 samples per update, match reconstructions to references per update
                (Hungarian) before the loss and the metrics.
            grid_samples: Reference/reconstruction pairs in each evaluation's PNG grid (0: no grid).
        """
        super().__init__()
        self.inverter = self._init_training(inverter, lr, scheduler)
        for stage in STAGES:  # one metric object per stage, so stages never share state
            setattr(self, f"{stage}_mse", MeanSquaredError())
            if stage != "train":
                setattr(self, f"{stage}_psnr", MeanMetric())
                setattr(self, f"{stage}_ssim", MeanMetric())
                setattr(self, f"{stage}_discrete_acc", MeanMetric())
                setattr(self, f"{stage}_baseline_mse", MeanSquaredError())
        self.samples: list[dict] = []
        self._grid: tuple[Tensor, Tensor] | None = None
        self._trained_steps = 0  # training steps of the loaded checkpoint (names test image grids)

    # ---------------------------------------------------------------- set-up
    @property
    def data(self) -> ImageAttackData:
        return self.trainer.datamodule

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._trained_steps = int(checkpoint.get("global_step", 0))

    def configure_model(self) -> None:
        # Called after the DataModule's setup and before a checkpoint is restored.
        if not self.inverter.is_bound:
            self.inverter.bind(self.data.num_features, self.data.output_shape, self.data.kind)

    def forward(self, features: Tensor) -> Tensor:
        return self.inverter(features)

    # ---------------------------------------------------------------- one step for all stages
    def _step(self, batch: dict, stage: str) -> Tensor:
        targets = batch["inputs"].float()  # (U, m, *input_shape): for the loss and metrics only
        preds = self(batch["features"])  # the attack sees only the hashed update
        if self.hparams.match_order:
            preds = match_samples(preds, targets)
        loss = nn.functional.mse_loss(preds, targets)
        updates = targets.shape[0]
        getattr(self, f"{stage}_mse").update(preds.detach().flatten(), targets.flatten())
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=updates)
        self.log(f"{stage}/lti/mse", getattr(self, f"{stage}_mse"), prog_bar=stage != "train", batch_size=updates,
                 on_step=stage == "train", on_epoch=True)
        if stage != "train":
            self._evaluate(batch, preds.detach(), targets, stage)
        return loss

    def _evaluate(self, batch: dict, preds: Tensor, targets: Tensor, stage: str) -> None:
        flat_preds, flat_targets = preds.flatten(0, 1), targets.flatten(0, 1)  # (U*m, *input_shape)
        per_sample_mse = (flat_preds - flat_targets).pow(2).flatten(1).mean(dim=1)
        baseline = self.data.mean_input.to(targets).expand_as(flat_targets)
        getattr(self, f"{stage}_baseline_mse").update(baseline.flatten(), flat_targets.flatten())
        m = targets.shape[1]
        records: dict[str, Tensor] = {"mse": per_sample_mse}
        if self.data.kind == "image":
            image_psnr, image_ssim = psnr(per_sample_mse), ssim(flat_preds, flat_targets)
            getattr(self, f"{stage}_psnr").update(image_psnr)
            getattr(self, f"{stage}_ssim").update(image_ssim)
            records.update(psnr=image_psnr, ssim=image_ssim)
            if self._grid is None and self.hparams.grid_samples > 0:
                n = self.hparams.grid_samples
                self._grid = (flat_targets[:n].cpu(), flat_preds[:n].cpu())
        else:
            accuracy = discrete_accuracy(flat_preds, flat_targets, [s for _, kind, s in self.data.table_columns if kind == "discrete"])
            getattr(self, f"{stage}_discrete_acc").update(accuracy)
            records["discrete_acc"] = accuracy
        for u in range(targets.shape[0]):
            part = slice(u * m, (u + 1) * m)
            self.samples.append({
                "index": int(batch["index"][u]), "labels": batch["labels"][u].tolist(),
                **{f"lti_{k}": float(v[part].mean()) for k, v in records.items()},
            })

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        preds = self(batch["features"])
        return [{"index": int(i), "reconstruction": np.round(p.cpu().numpy(), 4).tolist()} for i, p in zip(batch["index"], preds)]

    # ---------------------------------------------------------------- epoch ends
    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._grid = None

    def _end_evaluation(self, stage: str) -> None:
        names = ("baseline_mse",) + (("psnr", "ssim") if self.data.kind == "image" else ("discrete_acc",))
        for name in names:
            metric = getattr(self, f"{stage}_{name}")
            key = f"{stage}/baseline/mse" if name == "baseline_mse" else f"{stage}/lti/{name}"
            self.log(key, metric.compute())
            metric.reset()
        if self._grid is not None:
            self._save_grid(stage)

    def _save_grid(self, stage: str) -> None:
        references, reconstructions = self._grid
        self._grid = None
        if self.trainer.sanity_checking or self.global_rank != 0:
            return
        grid = image_grid(references, reconstructions)
        step = self.global_step or self._trained_steps  # validate/test from a checkpoint: its training steps
        path = Path(self.trainer.default_root_dir) / "images" / f"{stage}_step{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid).save(path)
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                try:
                    logger.log_image(key=f"{stage}/reconstructions", images=[grid], caption=["top: client data, bottom: LTI"])
                except Exception as error:  # an image logging problem must not end the run
                    warnings.warn(f"could not log the image grid to W&B: {error}", stacklevel=2)

    def on_validation_epoch_end(self) -> None:
        self._end_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._end_evaluation("test")
