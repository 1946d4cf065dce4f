"""What an audit folder holds, proven: the threat model's resolved content and hashes in `audit.json`,
checksums of every round's files in its `round.json`, and one-line errors naming the file when a read
fails.

A folder is one audit: its threat model (compared by content: the resolved `lti fit` config after every
overlay, the target model's weights with their initial LoRA adapters, the clients' token ids), its
federation (but the number of rounds: rounds can be added) and Flower's DP. A rerun with another of
these is refused naming the first setting that differs, never mixed into the folder's rounds.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

#: The sections of the resolved threat model the audit is built from: what the clients train and send
#: (target, LoRA, defense, corpus, tokenizer, sizes) and the seed that initialises the model. `trainer`,
#: `model` (the server's inverter, checked against its own checkpoint) and `checkpoint` do not change
#: what the audit records.
COMPARED_SECTIONS = ("seed_everything", "data")


class AuditFileDamaged(ValueError):
    """A file of an audit folder cannot be read or does not match its checksum (exit code 2)."""


def plain(value):
    """A JSON-plain copy: dataclasses as dicts, non-finite floats as strings."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def canonical_sha256(value) -> str:
    return hashlib.sha256(json.dumps(plain(value), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tensors_sha256(tensors) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in the given order."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def instantiate_with_config(config: str, overrides: list[str]):
    """`lti.trainer_cli.instantiate` that also returns the resolved config (every overlay applied, class
    names resolved, defaults filled in) as plain JSON."""
    import warnings

    from lti.trainer_cli import LTICLI, LightningDataModule, LightningModule, quiet_known_noise, trainer_defaults

    quiet_known_noise()
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    args = ["--config", config, *overrides, "--trainer.logger", "false"]
    cli = LTICLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 trainer_defaults=trainer_defaults(), args=args, run=False, save_config_callback=None,
                 parser_kwargs={"default_env": False, "exit_on_error": False})
    content = json.loads(cli.parser.dump(cli.config, format="json", skip_check=True))
    content.pop("config", None)  # the config files' paths: the content is what counts
    return cli.model, cli.datamodule, plain(content)


def compared_content(content: dict) -> dict:
    return {key: content.get(key) for key in COMPARED_SECTIONS}


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Dotted keys as the command line spells them (`data.defense.class_path`: jsonargparse's `init_args`
    levels left out) -> leaf values."""
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            name = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
            out.update(flatten(item, name))
        return out
    return {prefix: value}


_UNSET = object()


def first_difference(previous, current, prefix: str = "") -> str | None:
    """`key was A, now B` for the first dotted key (in sorted order) whose value differs, else None."""
    old, new = flatten(previous, prefix), flatten(current, prefix)
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if a != b:
            return f"{key} was {_shown(a)}, now {_shown(b)}"
    return None


def _shown(value) -> str:
    if value is _UNSET:
        return "unset"
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def read_json(path: Path, fix: str) -> dict:
    """A JSON file of the folder, or `AuditFileDamaged` naming it and saying `fix`."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AuditFileDamaged(f"audit file {path} is missing; {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise AuditFileDamaged(f"audit file {path} is unreadable ({type(error).__name__}: {reason}); {fix}") from None
    if not isinstance(value, dict):
        raise AuditFileDamaged(f"audit file {path} is unreadable (not a JSON object); {fix}")
    return value


def read_tensors(path: Path, expected_sha256: str | None, fix: str) -> dict[str, torch.Tensor]:
    """A safetensors file of the folder, checked against its recorded sha256 (None: not checked), or
    `AuditFileDamaged` naming it and saying `fix`."""
    from safetensors.torch import load

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise AuditFileDamaged(f"audit file {path} is missing; {fix}") from None
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise AuditFileDamaged(f"audit file {path} does not match its checksum in round.json (changed or damaged after "
                               f"it was written); {fix}")
    try:
        return load(data)
    except Exception as error:  # safetensors reports a short or garbled file as its own error types
        reason = str(error).splitlines()[0] if str(error) else ""
        raise AuditFileDamaged(f"audit file {path} cannot be read ({type(error).__name__}: {reason}); {fix}") from None
