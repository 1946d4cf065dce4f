"""Checkpoint files: saved whole (`datamodules.atomic_files`), and read only when sound.

A checkpoint is a zip archive (`torch.save`) whose members each carry a CRC-32 of their bytes, but
`torch.load` does not check them: a flipped bit in a weight would load silently. `check_checkpoint`
reads the whole file once (about 0.4 s for the quickstart's 735 MB) and refuses, in one line, a file
that is cut short, fails a checksum or is no checkpoint at all (`DamagedCheckpoint`).
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from datamodules.atomic_files import atomic_writer


class DamagedCheckpoint(ValueError):
    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"not a checkpoint, or damaged: {path} ({reason})")


def save_checkpoint(checkpoint: dict, path: str | os.PathLike) -> None:
    """`torch.save` to `path`, atomically (the bytes are those Lightning's own save writes)."""
    with atomic_writer(path, what="save checkpoint") as file:
        torch.save(checkpoint, file)


def _first_line(error: BaseException) -> str:
    """The first sentence of the error's message (torch's run on for several)."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    return re.split(r"(?<=[a-z)])\. ", text, maxsplit=1)[0].rstrip(".")


#: What loading a damaged file or another kind of file raises (from torch.load or from reading its content).
LOAD_ERRORS = (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, KeyError, AttributeError,
               ImportError, TypeError)


def damaged(path: str | os.PathLike, error: BaseException) -> DamagedCheckpoint:
    """The one-line error for a file whose loading raised `error` (one of `LOAD_ERRORS`)."""
    if isinstance(error, (KeyError, AttributeError)):  # loaded, but not a dict with a model state
        return DamagedCheckpoint(path, "it holds no model state")
    return DamagedCheckpoint(path, _first_line(error))


def check_checkpoint(path: str | os.PathLike) -> None:
    """Raises `FileNotFoundError` or `DamagedCheckpoint` (one line each) unless `path` is an intact
    zip archive; a file in torch's older, non-zip format is left to the loader."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        # (a run killed between removing its previous checkpoint and moving `last.ckpt` to the new one)
        others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.exists() and not p.is_symlink())
        hint = f"; the folder holds {', '.join(others)}" if others else ""
        raise FileNotFoundError(f"checkpoint {path} links to {os.readlink(path)}, which does not exist{hint}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise DamagedCheckpoint(path, "a folder, not a file")
    stat = path.stat()
    _check_archive(str(path), str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _check_archive(path: str, resolved: str, size: int, mtime_ns: int) -> None:
    """The checksum pass, once per file version (the CLI reads a checkpoint's hyperparameters before the
    trainer loads it)."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as file:
            start = file.read(4)
        if start.startswith(b"PK\x03\x04"):
            raise DamagedCheckpoint(path, "cut short: the archive has no end")
        if not start.startswith(b"\x80"):  # torch's older format is a pickle (protocol 2): left to the loader
            raise DamagedCheckpoint(path, "not a zip archive, as torch.save writes")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:  # e.g. cut short inside a member
        raise DamagedCheckpoint(path, f"unreadable archive: {_first_line(error)}") from None
    if bad is not None:
        raise DamagedCheckpoint(path, f"the bytes of {bad} fail their checksum")


def load_checked(path: str | os.PathLike, load: Callable[[], object]) -> dict:
    """`load()` of the checkpoint at `path` after `check_checkpoint`; whatever fails to load, or loads
    as something without a model state, is a `DamagedCheckpoint`."""
    check_checkpoint(path)
    try:
        checkpoint = load()
    except LOAD_ERRORS as error:
        raise damaged(path, error) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise DamagedCheckpoint(path, "it holds no model state")
    return checkpoint
