"""Writes what an evaluation found: `<stage>_metrics.json`, `<stage>_samples.jsonl`, a printed table,
and a W&B table; `predictions.jsonl` for `lti predict`. Files go to `trainer.default_root_dir`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from datamodules.atomic_files import write_text_atomically


def _gather(records: list) -> list:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        parts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, records)
        return [r for part in parts for r in part]
    return list(records)


def format_metrics(metrics: dict[str, float]) -> str:
    """A readable two-column table; fractions shown as percentages, raw values (loss, MSE, PSNR dB) as numbers."""
    width = max((len(k) for k in metrics), default=10)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -------"]
    raw = ("loss", "seconds", "mse", "psnr")
    for key, value in sorted(metrics.items()):
        shown = f"{value:.4g}" if any(r in key.rsplit("/", 1)[-1] for r in raw) else f"{100 * value:6.2f}%"
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


#: Parts of the threat model an inverter is trained for; evaluating under others is a transfer experiment.
TRAINED_FOR = ("defense", "client")


def trained_elsewhere(trained: dict | None, setting: dict) -> dict:
    """{part: what the checkpoint was trained under} for the parts of `setting` that differ."""
    if not trained:
        return {}
    return {part: trained[part] for part in TRAINED_FOR if part in trained and part in setting and trained[part] != setting[part]}


def describe_mismatch(mismatch: dict) -> str:
    return ", ".join(f"{part} {value.get('name', value) if isinstance(value, dict) else value}" for part, value in mismatch.items())


#: Reconstructions shown under each reference in the printed samples: sample key -> label.
RECONSTRUCTIONS = {"lti": "LTI reconstruction", "dager": "DAGER reconstruction"}
UNTRAINED = "untrained inverter"
UNTRAINED_NOTE = ("no checkpoint was loaded: the inverter is untrained (random weights); its scores are a "
                  "reference for the trained inverter's, not an attack result")


def format_samples(samples: list[dict], rows: int, untrained: bool = False) -> str:
    """Each of the first `rows` references with every attack's reconstruction of it, one per line."""
    labels = {**RECONSTRUCTIONS, **({"lti": UNTRAINED} if untrained else {})}
    shown = [r for r in samples if "reference" in r][:rows]
    keys = [key for key in labels if any(key in r for r in shown)]
    width = max([len("reference"), *(len(labels[key]) for key in keys)])
    lines = []
    for r in shown:
        lines.append(f"  {'reference':<{width}}: {r['reference']!r}")
        lines += [f"  {labels[key]:<{width}}: {r[key]!r}" for key in keys if key in r]
    return "\n".join(lines)


class ResultsWriter(Callback):
    def __init__(self, table_rows: int = 10, print_table: bool = True) -> None:
        """
        Args:
            table_rows: Reference/reconstruction pairs printed and logged to W&B per evaluation.
            print_table: Print the metrics and sample tables to stdout.
        """
        self.table_rows, self.print_table = table_rows, print_table
        # Set by the CLI when it evaluates without a checkpoint (lti.trainer_cli): said in the table and the file.
        self.untrained_inverter = False
        self._predictions: list[dict] = []
        self._said_mismatch = False

    def _write(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        samples = sorted(_gather(getattr(pl_module, "samples", [])), key=lambda r: r.get("index", 0))
        if trainer.global_rank != 0:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}/")}
        root = Path(trainer.default_root_dir)
        setting = self._setting(trainer, pl_module)
        payload = {"stage": stage, "metrics": metrics, "num_updates": len(samples), "setting": setting,
                   "global_step": trainer.global_step}
        notes = ([UNTRAINED_NOTE] if self.untrained_inverter else []) + list(getattr(pl_module, "run_notes", None) or [])
        if notes:
            payload["notes"] = notes
        write_text_atomically(root / f"{stage}_metrics.json", json.dumps(payload, indent=2) + "\n")
        write_text_atomically(root / f"{stage}_samples.jsonl", "".join(json.dumps(r) + "\n" for r in samples))
        wanted = ("index", "reference", "lti", "dager", "lti_token_acc", "lti_rouge1",  # text
                  "labels", "lti_mse", "lti_psnr", "lti_ssim", "lti_discrete_acc", "spear_psnr", "spear_mse")  # images/tables
        columns = [c for c in wanted if any(c in r for r in samples)]
        rows = [[r.get(c) for c in columns] for r in samples[: self.table_rows]]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and rows:
                logger.log_table(key=f"{stage}/samples", columns=columns, data=rows)
        if self.print_table:
            inverter = f", {UNTRAINED}" if self.untrained_inverter else ""
            updates = f"{len(samples)} update{'' if len(samples) == 1 else 's'}"
            print(f"\n{stage} results ({updates}{inverter}) -> {root / f'{stage}_metrics.json'}")
            if self.untrained_inverter:
                print(f"lti: note: {UNTRAINED_NOTE}")
            print(format_metrics(metrics))
            shown = format_samples(samples, min(3, self.table_rows), self.untrained_inverter)
            if shown:
                print(shown)

    def _setting(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        """The run's threat model, with `trained_under` where the loaded checkpoint was trained under another."""
        setting = trainer.datamodule.describe()  # AttackData: the attack modules require it at setup
        mismatch = trained_elsewhere(getattr(pl_module, "trained_under", None), setting)
        if mismatch:
            setting["trained_under"] = mismatch
            if not self._said_mismatch:
                # A non-adaptive attacker is a real experiment: allowed, but said once and recorded.
                print(f"lti: note: the inverter was trained under {describe_mismatch(mismatch)}; "
                      f"it is evaluated under this run's {', '.join(mismatch)}")
                self._said_mismatch = True
        return setting

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, pl_module, "val")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(trainer, pl_module, "test")

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._predictions = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._predictions.extend(outputs)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        records = sorted(_gather(self._predictions), key=lambda r: r["index"])
        if trainer.global_rank == 0:
            self._setting(trainer, pl_module)  # predictions have no metadata: a transfer is said, at least
            path = Path(trainer.default_root_dir) / "predictions.jsonl"
            write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in records))
            if self.print_table:
                print(f"\n{len(records)} reconstructions -> {path}")
