"""Who may write a checkpoint folder: one live `lti fit` at a time, and never over another run's model.

`claim(folder, ...)` is called before a fit starts (by the CLI, on rank zero):

* It takes the folder's lock, `<folder>/.lock`: an exclusive `flock` on that file, which the kernel
  drops when the process ends however it ends, with the owner's PID and host written in it for the
  message. A second fit into a folder whose lock is held is refused (`FolderInUse`); a lock file left
  by a killed run is not held by anyone, so it is simply taken over (a stale lock). Where the file
  system has no `flock`, a lock file naming a live process on this host, or any process on another
  host, counts as held.
* It removes the temporary files of saves that a killed process left (`datamodules.atomic_files`).
* A folder that holds an earlier run's checkpoints is refused (`EarlierRun`) unless this fit resumes
  from one of them, or the user asked to replace them (`overwrite=True`): otherwise `last.ckpt` would
  stay the earlier run's model while this run's files got `-v1` names.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from datamodules.atomic_files import orphaned_temp_files
from datamodules.processes import process_alive

LOCK_NAME = ".lock"
#: `--ckpt_path` values Lightning resolves inside the checkpoint folder itself (a resume).
RESUME_KEYWORDS = ("last", "hpc", "best", "registry")

try:
    import fcntl
except ImportError:  # Windows: the PID in the lock file is all there is
    fcntl = None


class FolderInUse(ValueError):
    """Another live run writes this checkpoint folder."""


class EarlierRun(ValueError):
    """The checkpoint folder holds an earlier run's checkpoints."""


def checkpoint_files(folder: Path) -> list[Path]:
    """The `*.ckpt` files and links in `folder`, by name."""
    return sorted(folder.glob("*.ckpt")) if folder.is_dir() else []


def _owner_text() -> str:
    return f"{os.getpid()} {socket.gethostname()}\n"


def _read_owner(path: Path) -> tuple[int | None, str | None]:
    try:
        pid, host = path.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None, None


def _describe_owner(pid: int | None, host: str | None) -> str:
    if pid is None:
        return "another run"
    return f"process {pid}" + ("" if host in (None, socket.gethostname()) else f" on {host}")


@dataclass
class FolderClaim:
    """A claimed checkpoint folder; `notes` are lines for the user (what was cleaned up or replaced)."""

    folder: Path
    notes: list[str] = field(default_factory=list)
    _fd: int | None = None

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.folder / LOCK_NAME).unlink()  # before unlocking: a waiting opener then retries on a new file
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None


def _lock(folder: Path, in_use=None) -> tuple[int, str | None]:
    """Takes the folder's lock; returns its file descriptor and a note when a stale lock was taken over.
    `in_use(folder, pid, host)`: the message of the refusal when a live process holds it."""
    in_use = in_use or _in_use_message
    path = folder / LOCK_NAME
    for _ in range(10):  # retried while a releasing owner deletes the file under us
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        pid, host = _read_owner(path)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise FolderInUse(in_use(folder, pid, host)) from None
                except OSError:  # no flock on this file system: judge by the PID written in the file
                    if pid is not None and pid != os.getpid() and (host != socket.gethostname() or process_alive(pid)):
                        os.close(fd)
                        raise FolderInUse(in_use(folder, pid, host)) from None
            elif pid is not None and pid != os.getpid() and (host != socket.gethostname() or process_alive(pid)):
                os.close(fd)
                raise FolderInUse(in_use(folder, pid, host)) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # the previous owner released (deleted) it between our open and lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, _owner_text().encode())
            stale = None
            if pid is not None and pid != os.getpid():
                stale = (f"lti: note: {folder} was locked by {_describe_owner(pid, host)}, which is gone "
                         "(stopped without cleaning up); lock taken over")
            return fd, stale
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise FolderInUse(f"folder {folder} is locked and unlocked too often to claim; is a run restarting in it?")


def lock(folder: str | os.PathLike, in_use) -> FolderClaim:
    """The lock alone, for another command's folder (`lti audit`'s out_dir): one live writer per folder,
    a stale lock taken over (said in `notes`); `in_use(folder, pid, host)` words the refusal. The folder
    must exist. Release with `.release()`."""
    folder = Path(folder)
    fd, stale = _lock(folder, in_use)
    return FolderClaim(folder, [stale] if stale else [], fd)


def describe_owner(pid: int | None, host: str | None) -> str:
    """`process PID` (`on HOST` when not this one), for a refusal's message."""
    return _describe_owner(pid, host)


def _in_use_message(folder: Path, pid: int | None, host: str | None) -> str:
    return (f"checkpoint folder {folder} is in use by {_describe_owner(pid, host)}, a live `lti fit`; "
            f"wait for it, or write elsewhere with --checkpoint.dirpath DIR")


def _resumes_from(folder: Path, ckpt_path: str | None) -> bool:
    if ckpt_path is None:
        return False
    if ckpt_path in RESUME_KEYWORDS:
        return True
    path = Path(ckpt_path)
    return path.absolute().parent == folder.absolute() or path.resolve().parent == folder.resolve()


def _describe_files(files: list[Path]) -> str:
    return ", ".join(f"{f.name} -> {os.readlink(f)}" if f.is_symlink() else f.name for f in files)


def claim(folder: str | os.PathLike, ckpt_path: str | None = None, overwrite: bool = False) -> FolderClaim:
    """Locks `folder` for one fit and clears it of what a killed run left; refuses a folder in use or one
    holding an earlier run's checkpoints (see the module's docstring). Release with `.release()`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, stale = _lock(folder)
    result = FolderClaim(folder, [stale] if stale else [], fd)
    try:
        orphans = orphaned_temp_files(folder)
        for orphan in orphans:
            orphan.unlink(missing_ok=True)
        if orphans:
            result.notes.append(f"lti: note: removed {len(orphans)} partial file{'s' if len(orphans) > 1 else ''} "
                                f"that an interrupted save left in {folder} ({', '.join(o.name for o in orphans)})")
        earlier = checkpoint_files(folder)
        if earlier and not _resumes_from(folder, ckpt_path):
            described = _describe_files(earlier)
            if not overwrite:
                raise EarlierRun(
                    f"checkpoint folder {folder} holds an earlier run's checkpoints ({described}); "
                    f"resume that run with --ckpt_path {folder / 'last.ckpt'}, write elsewhere with "
                    "--checkpoint.dirpath DIR, or replace them with --overwrite_checkpoints true")
            for old in earlier:
                old.unlink(missing_ok=True)
            result.notes.append(f"lti: note: replaced the earlier run's checkpoints in {folder} "
                                f"(--overwrite_checkpoints): removed {described}")
    except BaseException:
        result.release()
        raise
    return result
