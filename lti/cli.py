"""`lti fit|validate|test|predict --config configs/....yaml`: the Lightning CLI of the workbench."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from datamodules.text_inversion import TextInversionDataModule
from lti.module import InversionModule
from lti.results import ResultsWriter

# Make the registered classes importable by short name in configs (`class_path: Sign`).
import datamodules.federated  # noqa: F401,E402
import datamodules.text  # noqa: F401,E402
import lti.inverters  # noqa: F401,E402
import lti.targets  # noqa: F401,E402


class LTICLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.dirpath": "checkpoints", "checkpoint.save_last": True,
                             "checkpoint.filename": "step{step}", "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(ResultsWriter, "results")


def trainer_defaults() -> dict:
    # W&B is the default logger and stays offline unless the user opts in (logger.init_args.offline: false).
    return {
        "logger": {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"project": "lti", "offline": True, "save_dir": "runs"},
        },
        "default_root_dir": "runs",
        "log_every_n_steps": 10,
    }


# Bad input surfaces as one of these; the CLI prints one line instead of a traceback
# (set LTI_DEBUG=1 to see the traceback).
USER_ERRORS = (ValueError, FileNotFoundError, ModuleNotFoundError, FloatingPointError)


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("LTI_DEBUG"):
        return run(args)
    try:
        run(args)
    except USER_ERRORS as error:
        print(f"lti: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args: list[str] | None = None) -> None:
    LTICLI(
        InversionModule,
        TextInversionDataModule,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=args,
        parser_kwargs={"default_env": False},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
