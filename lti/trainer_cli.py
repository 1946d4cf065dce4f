"""`lti fit|validate|test|predict --config configs/....yaml`: the Lightning CLI of the workbench (the Trainer entry points)."""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from lti.curves import LearningCurve
from lti.results import ResultsWriter

# Make the registered classes importable by short name in configs (`class_path: Sign`).
import datamodules.federated  # noqa: F401,E402
import datamodules.targets  # noqa: F401,E402
import datamodules.targets.vision  # noqa: F401,E402
import datamodules.text  # noqa: F401,E402
import datamodules.vision  # noqa: F401,E402
import lti.inverters  # noqa: F401,E402


# `model` and `data` take any LightningModule / LightningDataModule by `class_path` (subclass mode);
# a config that gives no `class_path` gets text inversion, so text configs need none:
#   model: {class_path: lti.vision_module.ImageInversionModule, init_args: {...}}
#   data: {class_path: datamodules.vision_inversion.ImageInversionDataModule, init_args: {...}}
DEFAULT_MODEL = "lti.module.InversionModule"
DEFAULT_DATA = "datamodules.text_inversion.TextInversionDataModule"


class LTICLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_model and self.subclass_mode_data:
            parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.dirpath": "checkpoints", "checkpoint.save_last": True,
                             "checkpoint.filename": "step{step}", "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(ResultsWriter, "results")
        parser.add_lightning_class_args(LearningCurve, "curve")


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


def user_message(error: BaseException) -> str:
    """The message of the error the user caused: jsonargparse wraps errors raised while it instantiates a
    `class_path` (subclass mode) in a multi-line "Does not validate ..." report; unwrap to the original."""
    while str(error).startswith("Does not validate against any of the Union subtypes"):
        inner = error.__cause__ or error.__context__
        if not isinstance(inner, USER_ERRORS):
            break
        error = inner
    return str(error)


def run(args: list[str] | None = None) -> None:
    LTICLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=args,
        parser_kwargs={"default_env": False},
    )

