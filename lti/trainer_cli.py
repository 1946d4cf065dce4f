"""`lti fit|validate|test|predict --config configs/....yaml`: the Lightning CLI of the workbench (the Trainer entry points)."""

from __future__ import annotations

import contextlib
import difflib
import errno
import importlib
import inspect
import json
import os
import re
import warnings
from pathlib import Path

from jsonargparse import ArgumentError
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger

# Make the registered classes importable by short name in configs (`class_path: Sign`).
import datamodules.federated  # noqa: F401,E402
import datamodules.targets  # noqa: F401,E402
import datamodules.targets.vision  # noqa: F401,E402
import datamodules.text  # noqa: F401,E402
import datamodules.vision  # noqa: F401,E402
import lti.inverters  # noqa: F401,E402
from datamodules.atomic_files import WriteFailed
from datamodules.text.corpora import TEXT_CACHE_VARIABLE
from exact.callbacks import ExactAttackCallback
from lti.checkpoint_files import LOAD_ERRORS, check_checkpoint, damaged, load_checked, save_checkpoint
from lti.checkpoint_folder import RESUME_KEYWORDS, FolderClaim, checkpoint_files, claim
from lti.console import describe_checkpoints, quiet_known_noise, quiet_wandb, use_step_progress_bar
from lti.curves import LearningCurve
from lti.exact_only import ExactAttacksOnly
from lti.final_validation import ValidateAtLastStep
from lti.module import EVALUATION_ONLY
from lti.results import ResultsWriter

# `model` and `data` take any LightningModule / LightningDataModule by `class_path` (subclass mode);
# a config that gives no `class_path` gets text inversion, so text configs need none:
#   model: {class_path: lti.vision_module.ImageInversionModule, init_args: {...}}
#   data: {class_path: datamodules.vision_inversion.ImageInversionDataModule, init_args: {...}}
DEFAULT_MODEL = "lti.module.InversionModule"
DEFAULT_DATA = "datamodules.text_inversion.TextInversionDataModule"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, but a checkpoint is written beside its final name and renamed over it
    (`lti.checkpoint_files`): Lightning's own writes a temporary file in `$TMPDIR` and moves it, a copy
    when `$TMPDIR` is on another file system, which a kill or a full disk cuts short under the final
    name. Loading refuses a damaged file in one line."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)  # raises Lightning's TypeError
        save_checkpoint(checkpoint, path)

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None):
        return load_checked(path, lambda: super(AtomicCheckpointIO, self).load_checkpoint(path, map_location, weights_only))


def use_atomic_checkpoints(trainer: Trainer) -> None:
    """Installs `AtomicCheckpointIO`, unless the config chose a checkpoint IO of its own."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()


#: W&B's folders for artifact staging copies (each logged table: client text) and its artifact cache.
WANDB_FOLDERS = {"WANDB_DATA_DIR": "", "WANDB_CACHE_DIR": "cache"}


def keep_wandb_files_in_run_folder(loggers) -> None:
    """W&B stages a copy of every logged table (the evaluated clients' text) for upload, by default in
    `~/.local/share/wandb/artifacts/staging`, where it stays (an offline run needs it for a later
    `wandb sync`). Pointed into the logger's `<save_dir>/wandb/`, the copies stay with the run they
    belong to. A folder the user set in the environment is kept."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            folder = Path(logger.save_dir or ".").absolute() / "wandb"
            for variable, sub in WANDB_FOLDERS.items():
                os.environ.setdefault(variable, str(folder / sub) if sub else str(folder))
            return


#: The folder under the trainer's `default_root_dir` for the corpus' copies of the text it reads
#: (`$LTI_TEXT_CACHE_DIR`, datamodules/text/corpora.py), as `lti audit` keeps them in its `--out_dir`.
TEXT_CACHE_FOLDER = "corpus_cache"


def keep_corpus_text_in_run_folder(trainer: Trainer) -> None:
    """The embedded corpus writes its splits as text files under `~/.cache/lti/corpora` and `datasets` keeps
    an Arrow copy of every local or embedded file (and of its tokenisation) in `~/.cache/huggingface/datasets`:
    copies of the clients' (evaluation) text outside the run. Pointed to `<default_root_dir>/corpus_cache`
    before the DataModule prepares its data, they stay with the run. A folder the user set is kept; a remote
    `default_root_dir` (s3://…) leaves the usual caches."""
    root = trainer.default_root_dir
    if not os.environ.get(TEXT_CACHE_VARIABLE) and _is_local_file_protocol(root):
        os.environ[TEXT_CACHE_VARIABLE] = str(Path(root).absolute() / TEXT_CACHE_FOLDER)


def check_trainer_values(trainer: Trainer) -> None:
    """Values Lightning accepts but then divides by (a ZeroDivisionError mid-run)."""
    interval = trainer.val_check_interval
    if isinstance(interval, int) and interval < 1:
        raise ValueError(f"bad value for 'trainer.val_check_interval': {interval}; give a number of steps >= 1 "
                         "or a fraction of an epoch in (0.0, 1.0]")
    every = trainer.check_val_every_n_epoch
    if every is not None and every < 1:
        raise ValueError(f"bad value for 'trainer.check_val_every_n_epoch': {every}; give a number of epochs >= 1, "
                         "or null to validate by steps only (trainer.val_check_interval)")


class RunFailed(RuntimeError):
    """A run stopped by its machine (a full disk, a failed save), not by its arguments: exit code 1."""


def last_good_checkpoint(folder: Path) -> str | None:
    last = folder / "last.ckpt"
    if last.exists():
        return f"{last} -> {os.readlink(last)}" if last.is_symlink() else str(last)
    files = [f for f in checkpoint_files(folder) if f.exists()]
    return str(max(files, key=lambda f: f.stat().st_mtime)) if files else None


def failure_message(error: OSError, folder: Path | None = None, root: str | None = None) -> str:
    """One line for an operating-system error that stopped a run: what could not be written (or where the
    run writes, when the error does not say), and the checkpoint the run can be resumed from."""
    if isinstance(error, WriteFailed):
        text = str(error)
    elif error.filename:
        text = f"could not write {error.filename}: {error.strerror}"
    else:
        text = error.strerror or str(error)
        places = [str(p) for p in (root, folder) if p is not None]
        if places:
            text += f" (this run writes to {' and '.join(dict.fromkeys(places))})"
    if error.errno == errno.ENOSPC:
        text = f"disk full: {text}"
    if folder is not None:
        kept = last_good_checkpoint(folder)
        text += f"; the last good checkpoint is {kept}" if kept else "; no checkpoint was saved"
    return text


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
        parser.add_argument("--overwrite_checkpoints", type=bool, default=False,
                            help="lti fit: replace the checkpoints an earlier run left in checkpoint.dirpath "
                                 "(without it such a folder is refused)")

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint's hyperparameters here, before the trainer exists: a damaged file
        # is refused in one line already.
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not path or path in RESUME_KEYWORDS:
            return super()._parse_ckpt_path()  # none, or a keyword Lightning resolves ("last")
        check_checkpoint(path)
        # The checkpoint's hyperparameters go over the command line's; evaluation-only choices (decoding)
        # stay the command line's, also for checkpoints written before they were left out of them.
        given = self._model_arguments(subcommand)
        chosen = {key: given[key] for key in EVALUATION_ONLY if given is not None and key in given}
        try:
            super()._parse_ckpt_path()
        except LOAD_ERRORS as error:
            raise damaged(path, error) from None
        for key, value in chosen.items():
            self._model_arguments(subcommand)[key] = value

    def _model_arguments(self, subcommand: str):
        """The model's arguments in the parsed config (`model.init_args` in subclass mode)."""
        return init_args(self.config[subcommand].get("model"))

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        record_configs(self.model, self.datamodule, self.config[self.subcommand] if self.subcommand else self.config)

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        use_step_progress_bar(trainer, configured if isinstance(configured, list) else [configured])
        quiet_wandb(trainer.loggers)
        keep_wandb_files_in_run_folder(trainer.loggers)
        if self.subcommand is not None:  # a run, not `instantiate` (the audit and `lti candidates` choose their own)
            keep_corpus_text_in_run_folder(trainer)
        use_atomic_checkpoints(trainer)
        check_trainer_values(trainer)
        return trainer

    def _checkpoint_folder(self) -> Path | None:
        checkpoint = self.trainer.checkpoint_callback
        return Path(checkpoint.dirpath) if checkpoint is not None and checkpoint.dirpath else None

    def _claim_checkpoint_folder(self) -> FolderClaim | None:
        """Before a fit: the checkpoint folder is this run's alone (`lti.checkpoint_folder`)."""
        folder = self._checkpoint_folder()
        if folder is None or not self.trainer.is_global_zero:
            return None
        config = self.config_init["fit"]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None and SLURMEnvironment.detect() and self.trainer._checkpoint_connector._hpc_resume_path:
            ckpt_path = "hpc"  # a requeued SLURM job: Lightning resumes from its HPC checkpoint (as it decides)
        claimed = claim(folder, ckpt_path, bool(config.get("overwrite_checkpoints")))
        for note in claimed.notes:
            self._say(note)
        return claimed

    def _run_subcommand(self, subcommand: str) -> None:
        claimed = self._claim_checkpoint_folder() if subcommand == "fit" else None
        try:
            super()._run_subcommand(subcommand)
        except OSError as error:
            if isinstance(error, USER_ERRORS):  # a missing file the user named
                raise
            folder = self._checkpoint_folder() if subcommand == "fit" else None
            raise RunFailed(failure_message(error, folder, self.trainer.default_root_dir)) from error
        finally:
            if claimed is not None:
                claimed.release()

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


def init_args(section):
    """A config section's own arguments: its `init_args` when it names its class (`{class_path, init_args}`,
    subclass mode), else the section itself; None when there is none. A parsed section (a jsonargparse
    Namespace) is returned itself, not a copy: what is written into it changes the parsed config."""
    if section is None or "class_path" not in section:
        return section
    return section.get("init_args", section)


def record_configs(model: LightningModule, data: LightningDataModule, config) -> None:
    """Give the DataModule's threat model and the module's inverter the config they were built from, so that
    checkpoints store both by content (`ThreatModel.to_dict`, `inverter_record`) and an inverter loads from
    its checkpoint alone (`lti.audit.attacks.LearnedInverter.from_checkpoint`)."""
    def plain(section) -> dict:
        if section is None:
            return {}
        return section.as_dict() if hasattr(section, "as_dict") else dict(section)

    threat_model = getattr(data, "threat_model", None)
    if threat_model is not None:
        section = plain(init_args(config.get("data")))
        threat_model.record_content(section)
        # The rest of the data side (corpus, packing), for files that must name the text they were built from.
        data.recorded_config = section
    inverter = plain(init_args(config.get("model"))).get("inverter")
    if inverter is not None and hasattr(model, "inverter"):
        record = inverter.as_dict() if hasattr(inverter, "as_dict") else dict(inverter)
        # Plain JSON values only: a checkpoint is loaded with weights_only, which refuses other objects.
        model.inverter_record = json.loads(json.dumps(record, default=str))


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
# Invalid trainer values (`--trainer.max_steps -5`) are Lightning's MisconfigurationException.
USER_ERRORS = (ValueError, FileNotFoundError, ModuleNotFoundError, FloatingPointError, ArgumentError,
               MisconfigurationException)

#: The top-level options of `lti fit|validate|test|predict`, for "did you mean" on a top-level typo.
TOP_LEVEL = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path", "weights_only",
             "checkpoint", "results", "curve", "config", "print_config", "overwrite_checkpoints")


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


#: Top-level option groups whose init arguments may name classes: group -> its class.
GROUP_CLASSES = {"trainer": "lightning.pytorch.Trainer", "checkpoint": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "curve": "lti.curves.LearningCurve", "results": "lti.results.ResultsWriter"}
#: Top-level options that are a class themselves (subclass mode).
TOP_LEVEL_BASES = {"data": LightningDataModule, "model": LightningModule}
TOP_LEVEL_MODULES = ("lti.module", "lti.vision_module", "datamodules.text_inversion", "datamodules.vision_inversion")
#: The project's packages: their classes are the ones listed when an unknown name could be one of them.
PROJECT_PACKAGES = ("datamodules", "exact", "lti")


def _unknown_class(line: str, class_path: str | None) -> str | None:
    """The class name jsonargparse could not resolve, when `line` of its report says so."""
    for pattern in (r"Expected a dot import path string: (\S+)", r"Expected a path but (\S+) either not accessible or invalid"):
        if match := re.fullmatch(pattern, line):
            return match.group(1)
    if (match := re.fullmatch(r"module '([\w.]+)' has no attribute '(\w+)'", line)) and class_path == ".".join(match.groups()):
        return class_path
    if (match := re.fullmatch(r"No module named '([\w.]+)'", line)) and class_path and class_path.startswith(match.group(1)):
        return class_path
    return None


def _import_class(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if inspect.isclass(found) else None


def _classes_in(hint) -> list[type]:
    """The classes a type hint allows (`Optional[Defense]` -> Defense, `Logger | Iterable[Logger] | bool` -> Logger)."""
    import typing

    if inspect.isclass(hint) and not typing.get_args(hint):
        return [] if hint.__module__ in ("builtins", "typing", "collections.abc", "pathlib") else [hint]
    return [c for arg in typing.get_args(hint) for c in _classes_in(arg)]


def _expected_bases(owner: str | None, keys: list[str]) -> list[type]:
    """The base classes the option `keys` takes a subclass of."""
    *group, param = ".".join(keys).split(".")
    if owner is None:
        if not group:
            for module in TOP_LEVEL_MODULES:  # loaded only when configs name them: list them too
                with contextlib.suppress(ImportError):
                    importlib.import_module(module)
            return [TOP_LEVEL_BASES[param]] if param in TOP_LEVEL_BASES else []
        owner = GROUP_CLASSES.get(".".join(group))
    cls = _import_class(owner) if owner else None
    import typing

    for klass in cls.__mro__ if cls is not None else ():
        try:
            hint = typing.get_type_hints(klass.__init__).get(param)
        except Exception:  # a hint that cannot be resolved: its raw annotation, if any
            parameter = inspect.signature(klass.__init__).parameters.get(param)
            hint = None if parameter is None or isinstance(parameter.annotation, str) else parameter.annotation
        if hint is not None:
            return _classes_in(hint)
    return []


def known_classes(bases: list[type]) -> list[str]:
    """Names of the concrete subclasses of `bases` that are loaded: the project's, or else all of them."""
    found: dict[str, type] = {}
    stack = list(bases)
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        # jsonargparse's `lazy_instance` defaults are generated subclasses (LazyInstance_X): not names to give
        if not cls.__name__.startswith(("_", "LazyInstance_")) and not inspect.isabstract(cls):
            found.setdefault(cls.__name__, cls)
    project = [name for name, cls in found.items() if cls.__module__.split(".")[0] in PROJECT_PACKAGES]
    return sorted(project or found)


def unknown_class_message(name: str, keys: list[str], owners: list[str | None]) -> str | None:
    """"unknown class 'X' for 'data.defense' (did you mean 'Y'?); known: ..." (None when no class is
    known for that option, or `name` is one after all)."""
    names = known_classes(_expected_bases(owners[-1], keys))
    short = name.rpartition(".")[2]
    if not names or short in names and _import_class(name) is not None:
        return None
    close = difflib.get_close_matches(short, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown class '{name}' for '{'.'.join(keys)}'{hint}; known: {', '.join(names)}"


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
    owners: list[str | None] = []  # the class_path each key is an init argument of (None: a top-level group)
    class_path = None
    detail = None
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or line.startswith("Expected a <class 'NoneType'>"):
            if line:
                break
            continue
        if keys and (unknown := _unknown_class(line, class_path)) and (said := unknown_class_message(unknown, keys, owners)):
            return said
        if match := re.fullmatch(r'Parser key "([^"]+)":', line):
            keys.append(match.group(1))
            owners.append(class_path)
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
    if isinstance(error, MisconfigurationException):
        return trainer_value_message(str(error))
    return str(error)


def trainer_value_message(message: str) -> str:
    """Lightning's report of a bad Trainer value ("`max_steps` must be ...", "invalid value -2 for
    val_check_interval") names the option as `lti` does: 'trainer.max_steps'."""
    message = " ".join(message.split())
    parameters = inspect.signature(Trainer.__init__).parameters
    match = re.match(r"`(\w+)`\s*(.*)", message)
    if match and match.group(1) in parameters:
        return f"bad value for 'trainer.{match.group(1)}': {match.group(2)}"
    named = [(m.start(), m.group(0)) for m in re.finditer(r"\w+", message) if m.group(0) in parameters and m.group(0) != "self"]
    return f"bad value for 'trainer.{min(named)[1]}': {message}" if named else message


def run(args: list[str] | None = None) -> None:
    quiet_known_noise()
    # `lti` hands the CLI its arguments explicitly; Lightning's warning about also seeing sys.argv is noise.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    # Our training streams restart at the trainer's restored step (datamodules.training_stream), so a
    # mid-epoch checkpoint resumes exactly (tests/lti/test_resume.py); Lightning cannot see that.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    # A checkpoint folder is claimed before a fit (lti.checkpoint_folder: its lock file is in it, an earlier
    # run's checkpoints are refused), so Lightning's warning about a folder that is not empty says nothing.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    environment = {variable: os.environ.get(variable) for variable in (*WANDB_FOLDERS, TEXT_CACHE_VARIABLE)}
    try:
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
    finally:  # W&B's and the corpus text's folders were this run's (`keep_wandb_files_in_run_folder`,
        # `keep_corpus_text_in_run_folder`): the next run in this process sets its own
        for variable, value in environment.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def instantiate(config: str, overrides: list[str] | None = None) -> tuple[LightningModule, LightningDataModule]:
    """The model and DataModule an `lti fit --config CONFIG` would build, without a trainer run (for the
    commands on top: `lti audit` reads its threat model from such a config). Nothing is written."""
    quiet_known_noise()
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    args = ["--config", config, *(overrides or []), "--trainer.logger", "false"]
    cli = LTICLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 trainer_defaults=trainer_defaults(), args=args, run=False, save_config_callback=None,
                 parser_kwargs={"default_env": False, "exit_on_error": False})
    return cli.model, cli.datamodule
