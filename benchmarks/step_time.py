"""Seconds per training step of a config (update generation + inverter step), for time-per-epoch estimates.

    python -m benchmarks.step_time --config configs/paper/lti_wikitext103.yaml --offline --steps 12
    python -m benchmarks.step_time --config configs/quickstart.yaml --config configs/protocols/fedavg.yaml \
        -- --data.client.init_args.local_epochs 2   # any `lti fit` arguments after `--`

Runs `lti fit` in-process on the configs for `--warmup + --steps` steps with a callback that times
each step (batch transfer, which computes the updates, included), and prints the median seconds per
step and the implied time per epoch for the paper's 180,135 WikiText-103 training blocks.
`--offline` swaps the corpus for the embedded one (step time does not depend on the text).
"""

from __future__ import annotations

import argparse
import statistics
import time

from lightning.pytorch import Callback

PAPER_TRAINING_BLOCKS = 180_135


class StepTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.times.append(now - self._start)
        self._start = now  # includes the next batch's fetch + update computation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, action="append", help="a config file (repeat to layer several)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--offline", action="store_true", help="use the embedded corpus instead of the config's")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("overrides", nargs="*", help="further `lti fit` arguments (after `--`)")
    args = parser.parse_args()

    from lightning.pytorch import LightningDataModule, LightningModule

    from lti.trainer_cli import LTICLI, trainer_defaults

    timer = StepTimer()
    cli_args = [arg for config in args.config for arg in ("--config", config)] + args.overrides + [
        "--trainer.max_steps", str(args.warmup + args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1", "--data.num_workers", "0",
        "--checkpoint.dirpath", "/tmp/lti-step-time", "--trainer.default_root_dir", "/tmp/lti-step-time",
    ]
    if args.offline:
        cli_args += ["--data.corpus", "datamodules.text.EmbeddedCorpus"]
    # Same CLI as `lti` (subclass mode: configs name their model and data classes).
    cli = LTICLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 trainer_defaults=trainer_defaults(), run=False, args=cli_args, save_config_callback=None,
                 parser_kwargs={"default_env": False})
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    measured = timer.times[args.warmup :]
    seconds = statistics.median(measured)
    batch = cli.datamodule.batch_size
    print(f"config {' + '.join(args.config)} {' '.join(args.overrides)} ({'embedded corpus' if args.offline else 'config corpus'}), device {args.accelerator}, batch {batch}")
    print(f"seconds per step: median {seconds:.3f}, min {min(measured):.3f}, max {max(measured):.3f} over {len(measured)} steps")
    steps = PAPER_TRAINING_BLOCKS // batch
    print(f"paper epoch ({PAPER_TRAINING_BLOCKS} blocks = {steps} steps): {steps * seconds / 3600:.2f} h")


if __name__ == "__main__":
    main()
