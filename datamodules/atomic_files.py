"""Files written whole or not at all: checkpoints, results files and caches (every layer writes through it).

A file is written to a temporary name beside its target (`<folder>/.<name>.tmp-<pid>`), flushed to the
disk and renamed over the target. A rename within one folder is atomic, so a crash, a kill or a full
disk leaves the previous file (or none) under the target's name, never a short one; and the temporary
file stays in the target's folder (a rename across file systems would be a copy, which is not atomic,
so `$TMPDIR` is never used). A failed write removes its temporary file and raises an `OSError` naming
the target; a process killed mid-write leaves its temporary file, which the next run into that folder
finds by its PID (`orphaned_temp_files`) and removes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from datamodules.processes import process_alive

TEMP_MARK = ".tmp-"
_TEMP_NAME = re.compile(rf"^\.(?P<name>.+){re.escape(TEMP_MARK)}(?P<pid>\d+)$")


class WriteFailed(OSError):
    """A file could not be written; its message names the file and the reason, in one line."""

    def __str__(self) -> str:
        return str(self.strerror)


def temp_path(path: Path) -> Path:
    """The temporary name this process writes `path` under: hidden, beside it, with this process's PID."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def _fsync_folder(folder: Path) -> None:
    """Makes a rename in `folder` durable (not possible everywhere, e.g. on Windows: then skipped)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def first_os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, or one it was raised from (torch's writer turns a full disk
    into a RuntimeError raised while handling the OSError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, what: str = "write") -> Iterator[IO[bytes]]:
    """Yields a binary file; when the block ends without error its content replaces `path` at once.

    Any failure removes the temporary file; one caused by the operating system (a full disk, no
    permission) is raised as `WriteFailed` naming `path` ("could not {what} PATH: reason")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = first_os_error(error)
        if cause is None or isinstance(error, KeyboardInterrupt):
            raise
        code = cause.errno or errno.EIO
        raise WriteFailed(code, f"could not {what} {path}: {cause.strerror or cause}", str(path)) from error
    _fsync_folder(path.parent)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    with atomic_writer(path) as file:
        file.write(text.encode("utf-8"))


def orphaned_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Temporary files in `folder` whose writer no longer runs (killed mid-write)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    orphans = []
    for entry in sorted(folder.iterdir()):
        match = _TEMP_NAME.match(entry.name)
        if match and entry.is_file() and int(match["pid"]) != os.getpid() and not process_alive(int(match["pid"])):
            orphans.append(entry)
    return orphans
