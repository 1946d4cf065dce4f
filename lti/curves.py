"""Learning curves as CSV files: one row per validation, appended across resumed runs."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

from lightning.pytorch import Callback

#: Columns written first; every other logged `val/...` metric follows in sorted order.
LEADING = ("step", "samples", "wall_minutes")


class LearningCurve(Callback):
    """Appends `step, samples, wall_minutes, val/...` to `path` after every validation (`samples`:
    client updates trained on, steps x batch size x ranks).

    `wall_minutes` is the run's wall time from the start of fitting (validation included; data set-up
    before it excluded, but an observation cache built by the first training loader is included),
    summed over resumes: the elapsed time is saved with checkpoints and
    restored. Rows beyond the step a run resumes from (written after its last checkpoint, by the
    interrupted run) are dropped, so a curve never holds two rows for one step.
    """

    def __init__(self, path: str | None = None) -> None:
        """
        Args:
            path: CSV file of the learning curve (None: no curve is written).
        """
        self.path = Path(path) if path else None
        self.elapsed = 0.0  # seconds of earlier (resumed-from) runs
        self._start: float | None = None

    def state_dict(self) -> dict:
        return {"elapsed": self._elapsed_now()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.elapsed = float(state_dict.get("elapsed", 0.0))

    def _elapsed_now(self) -> float:
        return self.elapsed + (time.perf_counter() - self._start if self._start is not None else 0.0)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        # Here (not at fit start) the trainer's step is the one a resumed run restored.
        if self.path is not None and trainer.is_global_zero and self.path.exists():
            self._write(self._rows(before=trainer.global_step + 1))

    def on_fit_end(self, trainer, pl_module) -> None:
        self.elapsed, self._start = self._elapsed_now(), None

    def _rows(self, before: int) -> list[dict]:
        """The curve's rows of steps < `before`."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return []
        with self.path.open(newline="") as f:
            return [row for row in csv.DictReader(f) if int(row["step"]) < before]

    def _write(self, rows: list[dict]) -> None:
        # Whole-file rewrite through a temporary file: an interrupted write never leaves half a row.
        columns = list(LEADING) + sorted({key for row in rows for key in row} - set(LEADING))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.path is None or trainer.sanity_checking or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and v.numel() == 1}
        batch = trainer.datamodule.batch_size if trainer.datamodule is not None else 0
        row = {
            "step": trainer.global_step,
            "samples": trainer.global_step * batch * trainer.world_size,
            "wall_minutes": round(self._elapsed_now() / 60, 3),
            **{k: round(v, 6) for k, v in sorted(metrics.items())},
        }
        # A validation repeated at a resumed step replaces that step's row.
        self._write(self._rows(before=trainer.global_step) + [row])
