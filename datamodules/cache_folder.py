"""A cache folder that proves what it holds and that one process at a time builds.

Checksums: every file of a finished folder is cut into chunks of `CHUNK_BYTES`, and the SHA-256 digest
of each chunk is recorded when the build ends (`checksums`). Opening checks them (`first_mismatch`):
`full` reads every chunk; `sampled` checks every file's size (a truncated file) and the first, last
and a few random chunks, so a cache of many gigabytes opens in a fraction of a second and damage is
still found by a later open, which draws other chunks; `none` checks nothing. Chunks are hashed in
threads (hashlib and `os.pread` release the GIL). The random chunks come from a private generator:
no global random state is touched.

Building: `build_lock` holds an exclusive `fcntl.flock` on `<folder>.lock` (the holder's host and PID
written in it, for the message of a process that waits) while a process checks, removes or builds
the folder; the kernel releases it when the holder dies, so a lock is never stale. A build writes into
`partial_folder` and renames it into place when complete; `remove_dead_partials` removes only the
partial folders whose builder is dead, never a live build. Plain Python (Linux: `fcntl`).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import random
import shutil
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from datamodules.processes import process_alive

log = logging.getLogger(__name__)

#: Bytes per checksummed chunk: the unit a sampled check reads (costs: benchmarks/results/cache_checksums_cpu.md).
CHUNK_BYTES = 16 << 20
#: Random chunks a sampled check reads per file, besides the first and the last.
SAMPLED_CHUNKS = 4
ALGORITHM = "sha256-128"  # SHA-256 cut to 128 bits; twice blake2b's speed on CPUs with SHA extensions


def _threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _chunk_count(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


def _digests(path: Path, chunk_bytes: int, indices: Iterable[int]) -> list[str]:
    """The digests of chunks `indices` of the file, in that order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def digest(index: int) -> str:
            data, offset = bytearray(), index * chunk_bytes
            while len(data) < chunk_bytes:  # pread may return less than asked (network file systems)
                part = os.pread(fd, chunk_bytes - len(data), offset + len(data))
                if not part:
                    break
                data += part
            return hashlib.sha256(data).hexdigest()[:32]

        with ThreadPoolExecutor(_threads()) as pool:
            return list(pool.map(digest, indices))
    finally:
        os.close(fd)


def checksums(folder: Path, names: Iterable[str], chunk_bytes: int | None = None) -> dict:
    """The checksums of files `names` of `folder`, JSON-safe (what `first_mismatch` checks)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    files = {}
    for name in names:
        size = (folder / name).stat().st_size
        files[name] = {"bytes": size, "chunks": _digests(folder / name, chunk_bytes, range(_chunk_count(size, chunk_bytes)))}
    return {"algorithm": ALGORITHM, "chunk_bytes": chunk_bytes, "files": files}


def first_mismatch(folder: Path, recorded: dict, mode: str) -> str | None:
    """How the first file of `folder` that differs from its recorded checksums differs ("file 'path' is
    missing", "file ... has N bytes ...", "file ... does not match ..."), or None; `mode`: full, sampled or none."""
    if mode not in ("full", "sampled", "none"):
        raise ValueError(f"checksum verification {mode!r} must be full, sampled or none")
    if mode == "none":
        return None
    if recorded.get("algorithm") != ALGORITHM:
        return f"{str(folder)!r} has checksums of an unknown kind ({recorded.get('algorithm')!r})"
    chunk_bytes, files = recorded["chunk_bytes"], recorded["files"]
    for name, expected in files.items():  # sizes first: a truncated file is found in every mode, at no cost
        path = folder / name
        if not path.is_file():
            return f"file {str(path)!r} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"file {str(path)!r} has {size} bytes, {expected['bytes']} when it was built (truncated or replaced)"
    draw = random.Random()  # its own generator, seeded from the system: the global random state is left alone
    for name, expected in files.items():
        count = len(expected["chunks"])
        if mode == "full" or count <= SAMPLED_CHUNKS + 2:
            indices = list(range(count))
        else:
            indices = sorted({0, count - 1, *draw.sample(range(1, count - 1), SAMPLED_CHUNKS)})
        for index, digest in zip(indices, _digests(folder / name, chunk_bytes, indices)):
            if digest != expected["chunks"][index]:
                start = index * chunk_bytes
                end = min(start + chunk_bytes, expected["bytes"])
                return (f"file {str(folder / name)!r} does not match its checksum (bytes {start}-{end} of {expected['bytes']}): "
                        "changed or damaged after the build")
    return None


# ------------------------------------------------------------------ one builder at a time
def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def partial_folder(folder: Path) -> Path:
    """Where this process builds `folder` (renamed into place when complete)."""
    return folder.with_name(f"{folder.name}.partial-{_owner()}")


def remove_dead_partials(folder: Path) -> None:
    """Removes the partial builds of `folder` left by builders that died on this host; a live builder's
    and another host's (whose builder this host cannot see) are left alone."""
    host = socket.gethostname()
    for partial in folder.parent.glob(f"{folder.name}.partial-*"):
        owner = partial.name.rsplit(".partial-", 1)[1]
        builder_host, _, pid = owner.rpartition("-")  # "<host>-<pid>", or "<pid>" from older versions
        if (builder_host or host) != host or not pid.isdigit() or process_alive(int(pid)):
            continue
        shutil.rmtree(partial, ignore_errors=True)


@contextmanager
def build_lock(folder: Path, what: str = "cache") -> Iterator[None]:
    """Holds the exclusive lock of `folder` (file `<folder>.lock`, kept afterwards: removing it would let
    two processes lock two different files); waits, saying so in one line, while another process holds
    it. Where the lock file cannot be created (a read-only place), nothing can be built or removed
    there either, and no lock is taken."""
    lock = folder.with_name(f"{folder.name}.lock")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            log.warning(f"{what} {str(folder)!r} is being built or checked by {holder} (lock {str(lock)!r}); waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock
