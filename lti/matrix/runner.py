"""The grid: running it through a launcher (lti.matrix.launchers), `--collect` (tables from the finished
cells), `--status` (done / running / failed / pending per cell), the `--dry_run` plan, and the
remaining-time estimate from finished cells."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lti.matrix.cell import run_cell
from lti.matrix.grid import METRICS, Entry, Grid, cell_commands, cell_id, not_applicable, select_cells
from lti.matrix.launchers import Launcher, job_states, make_launcher, read_job_file
from lti.matrix.records import FINISHED_STATUSES, _finished, _save_record, importable_records, stored_records
from lti.matrix.report import write_outputs
from lti.matrix.validation import check_arguments

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
        if not_applicable(protocol, defense, attack):
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


def run_grid(grid: Grid, launcher: str | Launcher = "inline", only: dict[str, list[str]] | None = None,
             echo=print, max_parallel: int = 1, resources: dict[str, dict[str, Any]] | None = None) -> list[dict]:
    """Runs (or resumes) the selected cells (`select_cells`) through `launcher` (a name of
    `LAUNCHERS` or a launcher) and, once the launcher has waited for them, writes the tables.

    Cells already finished with the same arguments are skipped; the tables cover every cell of the
    grid finished so far (this run or earlier ones), so a large grid can be filled in slices.
    `max_parallel` cells run at once (local launcher). Returns the records finished so far.
    The arguments of the cells to run are checked first (`check_arguments`): if any does not parse,
    ValueError says which and why, and nothing runs.
    """
    if isinstance(launcher, str):
        launcher = make_launcher(launcher, grid, max_parallel, resources)
    cells = select_cells(grid, only)
    # Finished records, read once and kept up to date: the time estimate needs all of them per cell.
    done = {cell_id(*c): r for c in grid.cells() if (r := _finished(grid, *c)) is not None}
    check_arguments(grid, [c for c in cells if cell_id(*c) not in done and not not_applicable(*c)])
    numbers = {cell_id(*cell): number for number, cell in enumerate(cells, 1)}

    def name(cell) -> str:
        return f"[{numbers[cell_id(*cell)]}/{len(cells)}] {cell[0].name} x {cell[1].name} x {cell[2].name}"

    todo = []
    for cell in cells:
        if cell_id(*cell) in done:
            echo(f"{name(cell)}: done before, skipped")
        elif not_applicable(*cell):
            record = run_cell(grid, *cell)  # "n/a" with the grid's reason, at once: no job for a cell never run
            _save_record(grid, cell, record)
            done[cell_id(*cell)] = record
            echo(f"{name(cell)}: {_summary(record)}")
        else:
            todo.append(cell)
    # A cell whose job (an earlier `lti matrix` run's) still runs or waits in the queue is not started twice.
    submitted = [(cell, job) for cell in todo if (job := read_job_file(grid, cell)) is not None]
    for (cell, job), state in zip(submitted, job_states([job for _, job in submitted])):
        if state in _LIVE_STATES:
            todo.remove(cell)
            echo(f"{name(cell)}: already {_JOB_STATES[state]} as {job['launcher']} job {job['job_id']}, skipped")

    # Launchers call these from this thread (the local one polls its jobs here): no lock needed.
    def on_start(cell) -> None:
        if not launcher.waits:
            echo(f"{name(cell)}: submitting ...")
            return
        pending = [c for c in todo[todo.index(cell):] if cell_id(*c) not in done]
        seconds, unknown = estimate_remaining(list(done.values()), pending)
        echo(f"{name(cell)}: running ...{_eta_text((seconds / launcher.max_parallel, unknown))}")

    def on_record(cell, record: dict) -> None:
        if record["status"] in FINISHED_STATUSES:
            done[cell_id(*cell)] = record
        echo(f"{name(cell)}: {_summary(record)}")

    launcher.launch(todo, on_start, on_record)
    if not launcher.waits:
        echo(f"{len(todo)} cell{'s' * (len(todo) != 1)} submitted ({launcher.name}); follow them with "
             f"`lti matrix --grid ... --status`, build the tables with `--collect`")
    records = stored_records(grid)
    write_outputs(grid, records)
    return records


def _require_cells_folder(grid: Grid) -> None:
    if not (grid.out_dir / "cells").is_dir():
        raise FileNotFoundError(f"no cells under {str(grid.out_dir)!r}: the grid has not run there "
                                "(check --out_dir, or the grid's out_dir)")


def collect(grid: Grid) -> list[dict]:
    """`--collect`: the tables and plots from every cell record on disk (finished or failed), whatever
    ran them; cells still running or pending are left out. Returns the records.

    Raises FileNotFoundError, and writes nothing, when no cell has a record there (a mistyped folder,
    or a grid whose cells have not finished yet)."""
    _require_cells_folder(grid)
    records = stored_records(grid)
    if not records:
        raise FileNotFoundError(f"no cell under {str(grid.out_dir)!r} has finished yet: nothing to collect "
                                "(`--status` lists the cells)")
    write_outputs(grid, records)
    return records


# The engine's job states, in the words of `--status` (SLURM's states; a local job is RUNNING or ENDED).
_JOB_STATES = {"RUNNING": "running", "COMPLETING": "running", "CONFIGURING": "running",
               "PENDING": "queued", "REQUEUED": "queued", "SUSPENDED": "queued", "UNKNOWN": "submitted"}
_LIVE_STATES = set(_JOB_STATES)


def grid_status(grid: Grid, only: dict[str, list[str]] | None = None) -> list[dict]:
    """`--status`: per selected cell, {"cell", "status", "job_id", "detail"}. A cell whose job (job.json)
    lives by the engine's account is running, queued or submitted (state unknown: sacct not
    reachable), even if an earlier attempt left a failed record; otherwise its record says done, n/a
    or failed; a cell without either is failed if its SLURM job ended in failure, and pending
    otherwise (never run, or its job was stopped before it wrote a record).

    Raises FileNotFoundError when the grid's folder holds no cells (a mistyped folder, a grid never run)."""
    cells = select_cells(grid, only)
    _require_cells_folder(grid)
    jobs = [read_job_file(grid, cell) for cell in cells]
    asked = [job for job in jobs if job is not None]
    states = dict(zip(map(id, asked), job_states(asked)))
    rows = []
    for cell, job in zip(cells, jobs):
        record = _finished(grid, *cell, failed_too=True)  # read after the job states: a job ending meanwhile counts
        state = states.get(id(job))
        row = {"cell": cell_id(*cell), "status": "pending", "job_id": job and job["job_id"], "detail": ""}
        if state in _LIVE_STATES and (record is None or record["status"] == "failed"):
            row["status"] = _JOB_STATES[state]
            row["detail"] = f"{job['launcher']} job {job['job_id']}: {state}"
        elif record is not None:
            row["status"] = {"ok": "done"}.get(record["status"], record["status"])
            row["detail"] = _summary(record)
        elif job is not None:
            row["status"] = "pending" if state in ("ENDED", "CANCELLED", "COMPLETED") else "failed"
            row["detail"] = f"{job['launcher']} job {job['job_id']}: {state} (ended without a record; it runs again with the grid)"
        rows.append(row)
    return rows


def plan_grid(grid: Grid, only: dict[str, list[str]] | None = None, resume_from: str | Path | None = None,
              echo=print, max_parallel: int = 1) -> int:
    """`--dry_run`: prints the `lti` commands of the selected cells that would run, a comment for the
    cells already finished (here or in `resume_from`, read only) or n/a, and the time estimate, then
    checks the arguments of the cells to run as a run would (ValueError if any does not parse).
    Writes nothing; returns how many cells would run."""
    imported = importable_records(grid, resume_from) if resume_from else {}
    finished = {cell_id(*c): _finished(grid, *c) or imported.get(cell_id(*c)) for c in grid.cells()}
    pending = []
    for protocol, defense, attack in select_cells(grid, only):
        key = cell_id(protocol, defense, attack)
        reason = not_applicable(protocol, defense, attack)
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
    echo(f"# {len(pending)} cell{'s' * (len(pending) != 1)} to run{_eta_text((seconds / max_parallel, unknown))}")
    check_arguments(grid, pending)
    return len(pending)
