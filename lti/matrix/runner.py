"""Running cells: one cell as `lti` runs (in this process or as subprocesses), the whole grid with
`--jobs` cells at once, the `--dry_run` plan, and the remaining-time estimate from finished cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from lti.matrix.grid import (METRICS, Entry, Grid, cell_commands, cell_fingerprint, cell_folder, cell_id,
                             select_cells)
from lti.matrix.records import FINISHED_STATUSES, _finished, _save_record, importable_records
from lti.matrix.report import write_outputs

# --------------------------------------------------------------------------------------------------------
# One cell


def _find(tree: Any, key: str) -> Any:
    """First value stored under `key` anywhere in a nested dict (e.g. the DP defense's epsilon)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _run_lti(args: list[str], inline: bool, log, threads: int | None = None) -> None:
    if inline:
        from lti.trainer_cli import run  # the caller's process: no interpreter or import start-up per cell

        argv, sys.argv = sys.argv, ["lti"]  # LightningCLI warns when it sees the grid's own arguments
        try:
            run(args)  # errors propagate with their message (`main` would print and exit)
        finally:
            sys.argv = argv
        return
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    if threads is not None:  # cells run side by side (`--jobs`): each gets its share of the cores
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    completed = subprocess.run([sys.executable, "-m", "lti.cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    if completed.returncode:
        raise RuntimeError(f"lti {args[0]} exited with status {completed.returncode}")


def run_cell(grid: Grid, protocol: Entry, defense: Entry, attack: Entry, inline: bool = False,
             threads: int | None = None) -> dict:
    """Runs one cell (in this process if `inline`, else as `lti` subprocesses with `threads` CPU
    threads each, None: inherited) and returns its record; a failing cell gives a "failed" record."""
    folder = cell_folder(grid, protocol, defense, attack)
    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"protocol": protocol.name, "defense": defense.name, "attack": attack.name,
                              "kind": attack.kind, "noise": defense.noise}
    reason = attack.not_applicable.get(protocol.name) or attack.not_applicable.get(defense.name)
    commands = cell_commands(grid, protocol, defense, attack)
    record["fingerprint"] = cell_fingerprint(grid, protocol, defense, attack)
    if reason:
        return {**record, "status": "n/a", "reason": reason}
    record["commands"] = [["lti", *c] for c in commands]
    start = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        try:
            for args in commands:
                _run_lti(args, inline, log, threads)
            result = json.loads((folder / "run" / "test_metrics.json").read_text())
        except (Exception, SystemExit) as error:  # noqa: BLE001 - one failed cell must not stop the grid
            if type(error).__name__ == "SIGTERMException":
                raise  # the grid was stopped (Lightning turns SIGTERM into this): not the cell's failure
            tail = (folder / "log.txt").read_text().strip().splitlines()[-1:] if not inline else []
            reason = tail[0] if tail else f"{type(error).__name__}: {error}"
            return {**record, "status": "failed", "reason": reason[:300],
                    "seconds": time.perf_counter() - start}
    metrics = result["metrics"]
    prefix = attack.metrics_prefix.rstrip("/")
    values = {m: metrics.get(f"{prefix}/{m}") for m in (*METRICS, *attack.extra_metrics)}
    values["baseline_token_acc"] = metrics.get("test/baseline/token_acc")
    return {**record, "status": "ok", "metrics": values, "epsilon": _find(result.get("setting"), "epsilon"),
            "num_updates": result.get("num_updates"), "seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------------------------------------
# Time estimate


def estimate_remaining(finished: list[dict], pending: list[tuple[Entry, Entry, Entry]]) -> tuple[float, int]:
    """(seconds, cells without an estimate) for the pending cells, from the finished cells' times.

    A pending cell is expected to take the mean time of the finished cells with its protocol and
    attack kind (a FedAvg learned cell costs several FedSGD ones), else of its attack kind; cells
    with neither, and cells that will be "n/a", count as unknown and free respectively.
    """
    times: dict[tuple[str, str], list[float]] = {}
    for record in finished:
        if record.get("status") == "ok" and record.get("seconds") is not None:
            for key in ((record["protocol"], record["kind"]), ("*", record["kind"])):
                times.setdefault(key, []).append(float(record["seconds"]))
    total, unknown = 0.0, 0
    for protocol, defense, attack in pending:
        if attack.not_applicable.get(protocol.name) or attack.not_applicable.get(defense.name):
            continue
        seen = times.get((protocol.name, attack.kind)) or times.get(("*", attack.kind))
        if seen:
            total += sum(seen) / len(seen)
        else:
            unknown += 1
    return total, unknown


def _eta_text(estimate: tuple[float, int]) -> str:
    seconds, unknown = estimate
    if not seconds:
        return ""
    minutes = round(seconds / 60)
    text = f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{max(minutes, 1)} min"
    more = f" plus {unknown} cell{'s' * (unknown != 1)} never timed" if unknown else ""
    return f" (grid: about {text} left{more}, from the finished cells' times)"


# --------------------------------------------------------------------------------------------------------
# The grid


def _summary(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['status']} ({record.get('reason')})"
    m = record["metrics"]
    parts = [f"{k} {100 * m[k]:.1f}%" for k in ("token_acc", "rouge1") if m.get(k) is not None]
    parts += [f"{k} {100 * m[k]:.1f}%" for k in m if k not in METRICS and k != "baseline_token_acc" and m[k] is not None]
    return ", ".join(parts) + f" ({record.get('seconds', 0):.0f} s)"


def run_grid(grid: Grid, inline: bool = False, only: dict[str, list[str]] | None = None, echo=print,
             jobs: int = 1, threads_per_job: int | None = None) -> list[dict]:
    """Runs (or resumes) the selected cells (`select_cells`) and writes the tables and plots.

    The tables cover every cell of the grid finished so far (this run or earlier ones), so a large
    grid can be filled in slices. `jobs` > 1 runs that many cells at once, as subprocesses with
    `threads_per_job` CPU threads each (default: the machine's cores shared out); worth it where one
    cell cannot use all cores (`benchmarks/results/step_time_threads_cpu.md`). Returns the records.
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs} must be at least 1")
    if jobs > 1 and inline:
        raise ValueError("cells that run side by side (jobs > 1) run as subprocesses; drop --inline")
    if threads_per_job is not None and threads_per_job < 1:
        raise ValueError(f"threads_per_job={threads_per_job} must be at least 1")
    if jobs > 1 and threads_per_job is None:
        threads_per_job = max(1, (os.cpu_count() or 1) // jobs)
    cells = select_cells(grid, only)
    # Finished records, read once and kept up to date: the time estimate needs all of them per cell.
    done = {cell_id(*c): r for c in grid.cells() if (r := _finished(grid, *c)) is not None}
    lock = threading.Lock()  # `done` and the echo are shared by the jobs' threads
    stopping = threading.Event()  # set by a job that raised (e.g. Ctrl-C): start no further cell

    def run_one(number: int) -> None:
        cell = cells[number - 1]
        name = f"[{number}/{len(cells)}] {cell[0].name} x {cell[1].name} x {cell[2].name}"
        with lock:
            if stopping.is_set():
                return
            if cell_id(*cell) in done:
                echo(f"{name}: done before, skipped")
                return
            pending = [c for c in cells[number - 1 :] if cell_id(*c) not in done]
            seconds, unknown = estimate_remaining(list(done.values()), pending)
            echo(f"{name}: running ...{_eta_text((seconds / jobs, unknown))}")
        try:
            record = run_cell(grid, *cell, inline=inline, threads=threads_per_job)
        except BaseException:
            stopping.set()
            raise
        _save_record(grid, cell, record)
        with lock:
            if record["status"] in FINISHED_STATUSES:
                done[cell_id(*cell)] = record
            echo(f"{name}: {_summary(record)}")

    numbers = range(1, len(cells) + 1)
    if jobs == 1:
        for number in numbers:
            run_one(number)
    else:
        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            for future in as_completed([pool.submit(run_one, number) for number in numbers]):
                future.result()  # re-raises at once what a job raised
        finally:  # after an error or Ctrl-C, the cells not started yet are dropped (`stopping`)
            pool.shutdown(wait=True, cancel_futures=True)
    records = [r for r in (_finished(grid, *c, failed_too=True) for c in grid.cells()) if r is not None]
    write_outputs(grid, records)
    return records


def plan_grid(grid: Grid, only: dict[str, list[str]] | None = None, resume_from: str | Path | None = None,
              echo=print, jobs: int = 1) -> int:
    """`--dry_run`: prints the `lti` commands of the selected cells that would run, a comment for the
    cells already finished (here or in `resume_from`, read only) or n/a, and the time estimate.
    Writes nothing; returns how many cells would run."""
    imported = importable_records(grid, resume_from) if resume_from else {}
    finished = {cell_id(*c): _finished(grid, *c) or imported.get(cell_id(*c)) for c in grid.cells()}
    pending = []
    for protocol, defense, attack in select_cells(grid, only):
        key = cell_id(protocol, defense, attack)
        reason = attack.not_applicable.get(protocol.name) or attack.not_applicable.get(defense.name)
        if reason:
            echo(f"# {key}: n/a ({reason})")
        elif finished[key] is not None:
            echo(f"# {key}: done")
        else:
            pending.append((protocol, defense, attack))
            for command in cell_commands(grid, protocol, defense, attack):
                echo("lti " + " ".join(command))
    known = [r for r in finished.values() if r is not None]
    seconds, unknown = estimate_remaining(known, pending)
    echo(f"# {len(pending)} cell{'s' * (len(pending) != 1)} to run{_eta_text((seconds / jobs, unknown))}")
    return len(pending)
