"""`lti fit|validate|test|predict --config configs/....yaml`: the Lightning CLI of the workbench (the Trainer entry points)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import warnings

from jsonargparse import ArgumentError
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

# Make the registered classes importable by short name in configs (`class_path: Sign`).
import datamodules.federated  # noqa: F401,E402
import datamodules.targets  # noqa: F401,E402
import datamodules.targets.vision  # noqa: F401,E402
import datamodules.text  # noqa: F401,E402
import datamodules.vision  # noqa: F401,E402
import lti.inverters  # noqa: F401,E402
from exact.callbacks import ExactAttackCallback
from lti.console import describe_checkpoints, quiet_known_noise, quiet_wandb, use_step_progress_bar
from lti.curves import LearningCurve
from lti.exact_only import ExactAttacksOnly
from lti.final_validation import ValidateAtLastStep
from lti.results import ResultsWriter

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
        # `last.ckpt` is a link to the newest step checkpoint, not a second full copy of it.
        parser.set_defaults({"checkpoint.dirpath": "checkpoints", "checkpoint.save_last": "link",
                             "checkpoint.filename": "step{step}", "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(ResultsWriter, "results")
        parser.add_lightning_class_args(LearningCurve, "curve")

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        use_step_progress_bar(trainer, configured if isinstance(configured, list) else [configured])
        quiet_wandb(trainer.loggers)
        return trainer

    def _say(self, line: str) -> None:
        if self.trainer.is_global_zero:
            print(line)

    def _results_writer(self) -> ResultsWriter | None:
        return next((c for c in self.trainer.callbacks if isinstance(c, ResultsWriter)), None)

    def _choose_what_to_evaluate(self, subcommand: str, stage: str) -> None:
        """Decides what `lti validate|test` evaluates: without a checkpoint the inverter is untrained, so
        when exact attacks run in this stage they are evaluated alone (`ExactAttacksOnly`); otherwise the
        untrained inverter is evaluated and its results say so."""
        writer = self._results_writer()
        if writer is not None and writer.print_table:
            self.config_init[subcommand]["verbose"] = False  # the results table replaces Lightning's copy of it
        if self.config_init[subcommand].get("ckpt_path") is not None:
            return
        exact = [c for c in self.trainer.callbacks if isinstance(c, ExactAttackCallback) and stage in c.stages]
        if exact:
            self.model = ExactAttacksOnly()
            names = " and ".join(dict.fromkeys(c.attack_name for c in exact))
            self._say(f"lti: note: no --ckpt_path, so no trained inverter to evaluate: {names} alone")
        elif writer is not None:
            writer.untrained_inverter = True

    def before_validate(self) -> None:
        self._choose_what_to_evaluate("validate", "val")

    def before_test(self) -> None:
        self._choose_what_to_evaluate("test", "test")

    def before_predict(self) -> None:
        if self.config_init["predict"].get("ckpt_path") is None:
            self._say("lti: note: no --ckpt_path: these predictions come from an untrained inverter (random weights)")

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        line = describe_checkpoints(checkpoint.dirpath) if checkpoint is not None and checkpoint.dirpath else None
        if line:
            self._say(line)


def trainer_defaults() -> dict:
    # W&B is the default logger and stays offline unless the user opts in (logger.init_args.offline: false).
    return {
        "logger": {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"project": "lti", "offline": True, "save_dir": "runs"},
        },
        "default_root_dir": "runs",
        "log_every_n_steps": 10,
        "callbacks": [ValidateAtLastStep()],  # added to the config's callbacks, never replacing them
    }


# Bad input surfaces as one of these; the CLI prints one line instead of a traceback
# (set LTI_DEBUG=1 to see the traceback). Parse errors (typos, bad values) are jsonargparse's
# ArgumentError: the parser raises it instead of printing its whole usage (exit_on_error=False).
USER_ERRORS = (ValueError, FileNotFoundError, ModuleNotFoundError, FloatingPointError, ArgumentError)

#: The top-level options of `lti fit|validate|test|predict`, for "did you mean" on a top-level typo.
TOP_LEVEL = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path", "weights_only",
             "checkpoint", "results", "curve", "config", "print_config")


def _accepted_options(class_path: str | None) -> list[str]:
    if not class_path:
        return list(TOP_LEVEL)
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    options: list[str] = []
    for owner in cls.__mro__:  # a subclass that forwards **kwargs accepts its base's options too
        try:
            parameters = inspect.signature(owner.__init__).parameters
        except (ValueError, TypeError):
            break
        options += [p for p, v in parameters.items() if p != "self" and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
        if not any(v.kind is v.VAR_KEYWORD for v in parameters.values()):
            break
    return options


def _group_options(class_path: str | None, group: list[str]) -> list[str]:
    """The fields of a dataclass-typed init argument of `class_path` (e.g. `hashing` of a DataModule)."""
    import dataclasses
    import typing

    if not class_path or len(group) != 1:
        return []
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        for owner in cls.__mro__:
            hint = typing.get_type_hints(owner.__init__).get(group[0])
            if hint is not None:
                return [f.name for f in dataclasses.fields(hint)] if dataclasses.is_dataclass(hint) else []
    except Exception:  # a hint that cannot be resolved: no suggestion
        return []
    return []


def parse_error_message(message: str) -> str:
    """jsonargparse's nested report of a bad option or value -> one line naming the dotted option.

    The report nests `Parser key "k":` and `Problem with given class_path 'C':` lines per level and
    lists the alternatives of a Union (`- Expected a <class 'NoneType'>`), which are skipped."""
    if match := re.match(r"unrecognized arguments: --([\w.]+)", message):
        *keys, option = match.group(1).split(".")
        owner = {(): None, ("trainer",): "lightning.pytorch.Trainer", ("checkpoint",): "lightning.pytorch.callbacks.ModelCheckpoint",
                 ("curve",): "lti.curves.LearningCurve", ("results",): "lti.results.ResultsWriter"}.get(tuple(keys), "?")
        close = difflib.get_close_matches(option, _accepted_options(owner) if owner != "?" else [], n=1)
        hint = f" (did you mean '{'.'.join([*keys, close[0]])}'?)" if close else ""
        return f"unknown option '{match.group(1)}'{hint}; `lti fit --help` lists every option"
    keys: list[str] = []
    class_path = None
    detail = None
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or line.startswith("Expected a <class 'NoneType'>"):
            if line:
                break
            continue
        if match := re.fullmatch(r'Parser key "([^"]+)":', line):
            keys.append(match.group(1))
        elif match := re.fullmatch(r"Problem with given class_path '([^']+)':", line):
            class_path = match.group(1)
        elif match := re.fullmatch(r"Option '([^']+)' is not accepted", line):
            option = match.group(1)
            dotted = ".".join([*keys, option])
            close = difflib.get_close_matches(option, _accepted_options(class_path), n=1)
            hint = f" (did you mean '{'.'.join([*keys, close[0]])}'?)" if close else ""
            return f"unknown option '{dotted}'{hint}; `lti fit --help` lists every option"
        elif match := (re.fullmatch(r"unrecognized arguments: --([\w.]+)=?.*", line)  # in a nested group (data.hashing)
                       or re.fullmatch(r"Group '(\w+)' does not accept option '(\w+)'\.?", line)):
            *group, option = ".".join(match.groups()).split(".")
            close = difflib.get_close_matches(option, _group_options(class_path, group), n=1)
            hint = f" (did you mean '{'.'.join([*keys, *group, close[0]])}'?)" if close else ""
            return f"unknown option '{'.'.join([*keys, *group, option])}'{hint}; `lti fit --help` lists every option"
        elif not line.startswith(("Does not validate against any of", "Subtypes:", "Errors:", "Given value")):
            detail = detail or line
    if keys and detail:
        return f"bad value for '{'.'.join(keys)}': {detail}"
    return message.strip().splitlines()[0] if message.strip() else "invalid arguments"


def user_message(error: BaseException) -> str:
    """The message of the error the user caused: jsonargparse wraps errors raised while it instantiates a
    `class_path` (subclass mode) in a multi-line "Does not validate ..." report; unwrap to the original."""
    if isinstance(error, ArgumentError):
        return parse_error_message(str(error))
    while str(error).startswith("Does not validate against any of the Union subtypes"):
        inner = error.__cause__ or error.__context__
        if not isinstance(inner, USER_ERRORS):
            break
        error = inner
    return str(error)


def run(args: list[str] | None = None) -> None:
    quiet_known_noise()
    # `lti` hands the CLI its arguments explicitly; Lightning's warning about also seeing sys.argv is noise.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    # Our training streams restart at the trainer's restored step (datamodules.training_stream), so a
    # mid-epoch checkpoint resumes exactly (tests/lti/test_resume.py); Lightning cannot see that.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    LTICLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=args,
        parser_kwargs={"default_env": False, "exit_on_error": False},
    )

