"""Seconds to checksum an observation cache at the end of its build, and to check it on open (full,
sampled), on a synthetic float16 `features.npy` of realistic size.

    python -m benchmarks.cache_checksums                    # 2 GB in a temporary folder
    python -m benchmarks.cache_checksums --gigabytes 11 --dir /scratch/me   # the size of a k = 10% cache

"cold" rows first drop the file from the page cache (`posix_fadvise(DONTNEED)`, no root needed), as
on a first open after a reboot or on another node; "warm" rows read it from memory, as right after a
build. The build of a real cache is dominated by computing the updates; compare the checksum row with
the time to write the file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from datamodules import cache_folder
from datamodules.cache_folder import checksums, first_mismatch


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(action, repeats: int, before=None) -> float:
    """Median seconds of `action()` over `repeats` runs, `before()` (untimed) ahead of each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=2.0, help="size of the synthetic features.npy")
    parser.add_argument("--bins", type=int, default=50_000, help="k, float16 columns per row")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.gigabytes <= 0 or args.bins < 1 or args.repeats < 1:
        parser.error("--gigabytes, --bins and --repeats must be positive")

    rows = max(1, int(args.gigabytes * 1e9) // (2 * args.bins))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        features = np.lib.format.open_memmap(folder / "features.npy", mode="w+", dtype=np.float16, shape=(rows, args.bins))
        block = np.random.default_rng(0).standard_normal((min(rows, 256), args.bins)).astype(np.float16)
        for first in range(0, rows, len(block)):
            features[first : first + len(block)] = block[: rows - first]
        features.flush()
        del features
        written = time.perf_counter() - start
        path = folder / "features.npy"
        size = path.stat().st_size
        recorded = checksums(folder, ["features.npy"])
        chunks = len(recorded["files"]["features.npy"]["chunks"])
        print(f"{size / 1e9:.2f} GB ({rows} rows x {args.bins} bins float16), {chunks} chunks of "
              f"{cache_folder.CHUNK_BYTES >> 20} MiB, {cache_folder._threads()} hashing threads, {os.cpu_count()} CPUs")
        cold = lambda: _drop_from_page_cache(path)  # noqa: E731
        steps = [
            ("write the file (reference)", lambda: None, None, written),
            ("checksum at the build's end, warm", lambda: checksums(folder, ["features.npy"]), None, None),
            ("full check, warm", lambda: first_mismatch(folder, recorded, "full"), None, None),
            ("full check, cold", lambda: first_mismatch(folder, recorded, "full"), cold, None),
            ("sampled check, warm", lambda: first_mismatch(folder, recorded, "sampled"), None, None),
            ("sampled check, cold", lambda: first_mismatch(folder, recorded, "sampled"), cold, None),
        ]
        print("| step | s (median) | GB/s of the file |")
        print("|---|---|---|")
        results = []
        for name, action, before, seconds in steps:
            seconds = seconds if seconds is not None else _timed(action, args.repeats, before)
            results.append({"step": name, "seconds": seconds})
            print(f"| {name} | {seconds:.3f} | {size / 1e9 / max(seconds, 1e-9):.2f} |")
    return results


if __name__ == "__main__":
    main()
