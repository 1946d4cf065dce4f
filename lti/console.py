"""What `lti fit|validate|test|predict` prints besides the results: the progress bar, where the
checkpoints went, and no messages that tell the user nothing about their run.

Silenced, each matched by its own text (so new messages still show): Lightning's advertisements
("💡 Tip: ... try installing litlogger / litmodels"), W&B's "The anonymous setting has no effect"
(Lightning's WandbLogger passes `anonymous=None`, which W&B reads as set), and Lightning's own
deprecation of `LeafSpec` (raised inside Lightning by newer torch versions). Warnings about the run
itself stay.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

from lightning.pytorch.callbacks import RichProgressBar

#: Lightning logs its tips through this logger (`rank_zero_info`), with its other run information.
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise() -> None:
    """Filters Lightning's tips and its internal `LeafSpec` deprecation (idempotent)."""
    logger = logging.getLogger(LIGHTNING_INFO_LOGGER)
    if not any(isinstance(f, _DropTips) for f in logger.filters):
        logger.addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"))


def quiet_wandb(loggers) -> None:
    """Drops the `anonymous=None` Lightning's WandbLogger hands to `wandb.init` (it only makes W&B warn
    that the setting has no effect); an explicit `anonymous` is passed on."""
    for logger in loggers:
        init = getattr(logger, "_wandb_init", None)
        if isinstance(init, dict) and init.get("anonymous", "given") is None:
            del init["anonymous"]


class StepProgressBar(RichProgressBar):
    """Lightning's progress bar, counting training steps up to `max_steps` when a run is bounded by steps
    (`max_epochs` -1), where the stock bar reads "Epoch 0/-2" and starts over at every epoch. Runs bounded
    by epochs keep the stock bar. The W&B run id (`v_num`) is left out."""

    description = "Training steps"

    def _counts_steps(self) -> bool:
        return self.trainer.max_epochs == -1 and self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._counts_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._counts_steps():
            return super()._get_train_description(current_epoch)
        return f"{self.description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._counts_steps() and self.progress is not None and self.train_progress_bar_id is not None:
            return  # one bar for the whole run: it goes on across epochs (its clock and rate too)
        super().on_train_epoch_start(trainer, pl_module)
        if self._counts_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)  # a resumed run starts where it was

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._counts_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed mid-epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def use_step_progress_bar(trainer, configured=()) -> None:
    """Replaces the trainer's default rich progress bar by `StepProgressBar`; a bar among the
    `configured` callbacks (the config chose it) stays."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar and not any(callback is c for c in configured):
            trainer.callbacks[i] = StepProgressBar()


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def describe_checkpoints(folder: str | os.PathLike) -> str | None:
    """One line: the checkpoint files in `folder`, their sizes (a link named with its target), and the
    one to pass to `--ckpt_path`; None when there is none."""
    folder = Path(folder)
    files = sorted(folder.glob("*.ckpt"), key=lambda f: (f.is_symlink(), f.name))  # files, then links to them
    if not files:
        return None
    parts = [f"{f.name} -> {os.readlink(f)}" if f.is_symlink() else f"{f.name} ({_size(f.stat().st_size)})" for f in files]
    line = f"lti: checkpoints in {folder}: {', '.join(parts)}"
    last = folder / "last.ckpt"
    if last.exists():
        line += f"; `--ckpt_path {last}` tests or resumes this run"
    return line
