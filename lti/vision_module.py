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
import struct
import warnings
import zlib
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor, nn
from torchmetrics import MeanMetric, MeanSquaredError
from torchmetrics.image import StructuralSimilarityIndexMeasure

from lti.module import STAGES, LearnedInversionModule
from lti.registry import materialize


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


def match_samples(preds: Tensor, targets: Tensor) -> Tensor:
    """Reorder each update's m reconstructions to best match its references (Hungarian on per-sample MSE)."""
    if preds.shape[1] == 1:
        return preds
    from scipy.optimize import linear_sum_assignment

    cost = torch.cdist(preds.detach().flatten(2).float(), targets.flatten(2).float()).pow(2).cpu().numpy()
    order = torch.empty(preds.shape[:2], dtype=torch.long)
    for u in range(cost.shape[0]):
        rows, cols = linear_sum_assignment(cost[u])  # prediction rows[i] -> reference cols[i]
        order[u, torch.as_tensor(cols)] = torch.as_tensor(rows)
    return preds.gather(1, order.to(preds.device).view(*order.shape, *[1] * (preds.dim() - 2)).expand_as(preds))


def write_png(path: Path, image: np.ndarray) -> None:
    """A (H, W) or (H, W, 3) uint8 array as a PNG file (zlib only, no imaging library needed)."""
    if image.ndim == 2:
        image = image[:, :, None]
    height, width, channels = image.shape
    colour = {1: 0, 3: 2}[channels]
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


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
    def __init__(
        self,
        inverter: ImageMLPInverter = lazy_instance(ImageMLPInverter),
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        scheduler: Literal["constant", "cosine"] = "constant",
        warmup_steps: int = 0,
        match_order: bool = True,
        grid_samples: int = 16,
    ) -> None:
        """
        Args:
            inverter: The inversion network (default: the paper's 3-layer MLP, hidden 3000).
            lr: Adam learning rate.
            weight_decay: Adam weight decay.
            scheduler: `constant` or `cosine` decay to 0 over `trainer.max_steps` (or the estimated steps).
            warmup_steps: Linear warm-up steps.
            match_order: With m > 1 samples per update, match reconstructions to references per update
                (Hungarian) before the loss and the metrics.
            grid_samples: Reference/reconstruction pairs in each evaluation's PNG grid (0: no grid).
        """
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr={lr} must be > 0")
        if scheduler not in ("constant", "cosine"):
            raise ValueError(f"scheduler {scheduler!r} is not allowed; use 'constant' or 'cosine'")
        self.save_hyperparameters(ignore=["inverter"])
        self.inverter = materialize(inverter)
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
            psnr = 10 * torch.log10(1.0 / per_sample_mse.clamp_min(1e-10))
            ssim = self._ssim(flat_preds, flat_targets)
            getattr(self, f"{stage}_psnr").update(psnr)
            getattr(self, f"{stage}_ssim").update(ssim)
            records.update(psnr=psnr, ssim=ssim)
            if self._grid is None and self.hparams.grid_samples > 0:
                n = self.hparams.grid_samples
                self._grid = (flat_targets[:n].cpu(), flat_preds[:n].cpu())
        else:
            accuracy = self._discrete_accuracy(flat_preds, flat_targets)
            getattr(self, f"{stage}_discrete_acc").update(accuracy)
            records["discrete_acc"] = accuracy
        for u in range(targets.shape[0]):
            part = slice(u * m, (u + 1) * m)
            self.samples.append({
                "index": int(batch["index"][u]), "labels": batch["labels"][u].tolist(),
                **{f"lti_{k}": float(v[part].mean()) for k, v in records.items()},
            })

    @staticmethod
    def _ssim(preds: Tensor, targets: Tensor) -> Tensor:
        size = min(11, *(s if s % 2 else s - 1 for s in targets.shape[-2:]))
        metric = StructuralSimilarityIndexMeasure(data_range=1.0, kernel_size=size, reduction="none").to(targets.device)
        return metric(preds.float(), targets.float()).view(-1)

    def _discrete_accuracy(self, preds: Tensor, targets: Tensor) -> Tensor:
        """Fraction of discrete columns whose one-hot argmax is recovered, per row."""
        columns = [s for _, kind, s in self.data.table_columns if kind == "discrete"]
        if not columns:
            return torch.ones(preds.shape[0], device=preds.device)
        hits = torch.stack([preds[:, s].argmax(dim=1) == targets[:, s].argmax(dim=1) for s in columns], dim=1)
        return hits.float().mean(dim=1)

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
        write_png(path, grid)
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
