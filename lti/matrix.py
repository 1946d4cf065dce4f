"""`lti matrix --grid configs/matrix/small.yaml`: attacks x defenses x client protocols in one table.

A grid file names config overlays per axis; every cell of the grid is an ordinary `lti` run built by
stacking them (base configs, protocol, defense, attack, then the grid's overrides):

* a **learned** attack (LTI, LTI-P) is `lti fit` (adaptive: the inverter trains on updates made by the
  same protocol and defense) followed by `lti test` on held-out clients;
* an **exact** attack (DAGER, SPEAR) is `lti test` with its callback overlay and no checkpoint.

Each finished cell writes `cells/<protocol>__<defense>__<attack>/cell.json`; a rerun skips cells whose
file exists with the same arguments (so a partly finished grid resumes where it stopped) and redoes
cells whose arguments changed or that failed. A cell that does not apply is written as "n/a" with the
grid's reason, never run. `--resume_from matrix.json` seeds the cells from a table written earlier
(e.g. the one committed under docs/): its records count as finished where their arguments match.
`--jobs N` runs N cells at once as subprocesses (each with its share of the CPU cores), and two
`lti matrix` runs on disjoint slices of one grid may share its folder (records are written whole).
The table goes to `matrix.csv`, `matrix.json`, `matrix.md`, the plots to
`*.png`, and all of them to one W&B run (offline unless the grid says otherwise).

This module drives the CLI; it holds no model code.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# What a cell reports, read from `test_metrics.json` under the attack's metric prefix.
METRICS = ("token_acc", "rouge1", "rouge2", "rougeL")
KINDS = ("learned", "exact")
#: Record statuses that count as done (a rerun skips them); "failed" cells are retried.
FINISHED_STATUSES = ("ok", "n/a")


@dataclass
class Entry:
    """One value on one axis of the grid: config overlays and dotted overrides."""

    name: str
    configs: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    # Attacks only:
    kind: str = "learned"
    metrics_prefix: str = "test/lti"
    extra_metrics: list[str] = field(default_factory=list)
    # Which settings the attack does not apply to: {protocol or defense name: reason}.
    not_applicable: dict[str, str] = field(default_factory=dict)
    # Defenses only: the noise level on the privacy-utility plot's x axis.
    noise: float | None = None
    # Attacks only: the metric of the attack's protocol x defense table in matrix.md (SPEAR reports
    # rows recovered, not tokens).
    headline: str = "token_acc"


@dataclass
class Grid:
    out_dir: Path
    base: list[str]
    overrides: dict[str, Any]
    attacks: list[Entry]
    defenses: list[Entry]
    protocols: list[Entry]
    wandb: dict[str, Any]

    def cells(self) -> list[tuple[Entry, Entry, Entry]]:
        return [(p, d, a) for p in self.protocols for d in self.defenses for a in self.attacks]


_ENTRY_KEYS = {"configs", "overrides", "kind", "metrics_prefix", "extra_metrics", "not_applicable", "noise", "headline"}


def _entries(raw: Any, axis: str, source: Path) -> list[Entry]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"grid {source}: '{axis}' must be a non-empty mapping of name -> overlays")
    entries = []
    for name, spec in raw.items():
        spec = {} if spec is None else spec
        if isinstance(spec, (str, list)):
            spec = {"configs": [spec] if isinstance(spec, str) else spec}
        unknown = set(spec) - _ENTRY_KEYS
        if unknown:
            raise ValueError(f"grid {source}: {axis}.{name} has unknown keys {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
        entry = Entry(name=str(name), **spec)
        if "__" in entry.name or "/" in entry.name:
            raise ValueError(f"grid {source}: name {entry.name!r} may not contain '__' or '/'")
        if entry.kind not in KINDS:
            raise ValueError(f"grid {source}: {axis}.{name}.kind={entry.kind!r}; use one of {list(KINDS)}")
        if entry.headline not in (*METRICS, *entry.extra_metrics):
            raise ValueError(f"grid {source}: {axis}.{name}.headline={entry.headline!r} is not one of its metrics "
                             f"{[*METRICS, *entry.extra_metrics]}")
        entries.append(entry)
    return entries


def load_grid(path: str | Path, out_dir: str | Path | None = None) -> Grid:
    """Reads a grid file; relative config paths are taken from the current directory (the repo root)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grid file {str(path)!r} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {"out_dir", "base", "overrides", "attacks", "defenses", "protocols", "wandb"}
    if unknown:
        raise ValueError(f"grid {path}: unknown top-level keys {sorted(unknown)}")
    grid = Grid(
        out_dir=Path(out_dir or raw.get("out_dir") or Path("runs/matrix") / path.stem),
        base=list(raw.get("base") or []),
        overrides=dict(raw.get("overrides") or {}),
        attacks=_entries(raw.get("attacks"), "attacks", path),
        defenses=_entries(raw.get("defenses"), "defenses", path),
        protocols=_entries(raw.get("protocols"), "protocols", path),
        wandb={"project": "lti", "mode": "offline", **(raw.get("wandb") or {})},
    )
    for entry in [*grid.attacks, *grid.defenses, *grid.protocols]:
        for config in [*grid.base, *entry.configs]:
            if not Path(config).is_file():
                raise FileNotFoundError(f"grid {path}: config {config!r} ({entry.name}) does not exist")
    return grid


# --------------------------------------------------------------------------------------------------------
# One cell


def _flag(key: str, value: Any) -> list[str]:
    return [f"--{key}", value if isinstance(value, str) else json.dumps(value)]


def cell_id(protocol: Entry, defense: Entry, attack: Entry) -> str:
    return f"{protocol.name}__{defense.name}__{attack.name}"


def cell_folder(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> Path:
    """Where one cell's run, checkpoint, log and `cell.json` record live."""
    return grid.out_dir / "cells" / cell_id(protocol, defense, attack)


def _save_record(grid: Grid, cell: tuple[Entry, Entry, Entry], record: dict) -> None:
    path = cell_folder(grid, *cell) / "cell.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename, so that a second `lti matrix` filling another slice of the same grid (they
    # read every cell's record to write the tables) never reads a half-written record.
    partial = path.with_name(f"cell.json.{os.getpid()}.partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)


def cell_commands(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> list[list[str]]:
    """The `lti` argument lists that make one cell: [fit, test] for learned attacks, [test] for exact ones."""
    folder = cell_folder(grid, protocol, defense, attack)
    configs = [c for entry in (protocol, defense, attack) for c in entry.configs]
    args = [a for c in [*grid.base, *configs] for a in ("--config", c)]
    overrides = {
        # Cells log to the matrix's W&B run, not one run each; their files stay in the cell folder.
        "trainer.logger": False,
        "trainer.enable_progress_bar": False,
        **grid.overrides, **protocol.overrides, **defense.overrides, **attack.overrides,
        "trainer.default_root_dir": str(folder / "run"),
        "checkpoint.dirpath": str(folder / "ckpt"),
        "results.print_table": False,
    }
    args += [a for key, value in overrides.items() for a in _flag(key, value)]
    if attack.kind == "exact":
        return [["test", *args]]
    return [["fit", *args], ["test", *args, "--ckpt_path", str(folder / "ckpt" / "last.ckpt")]]


def cell_fingerprint(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> str:
    """A digest of the cell's arguments. The cell's own folder is left out, so a table made under one
    out_dir still counts under another (`--resume_from`)."""
    folder = str(cell_folder(grid, protocol, defense, attack))
    commands = [[a.replace(folder, "{cell}") for a in c] for c in cell_commands(grid, protocol, defense, attack)]
    return hashlib.sha256(json.dumps(commands).encode()).hexdigest()[:16]


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
# The grid


def select_cells(grid: Grid, only: dict[str, list[str]] | None = None) -> list[tuple[Entry, Entry, Entry]]:
    """The grid's cells, restricted to some names per axis, e.g. {"attack": ["dager"], "protocol": [...]}
    (an empty or missing list keeps the whole axis)."""
    only = {axis: set(names) for axis, names in (only or {}).items() if names}
    unknown = set(only) - {"protocol", "defense", "attack"}
    if unknown:
        raise ValueError(f"cannot select cells by {sorted(unknown)}; use protocol, defense or attack")
    for axis, names in only.items():
        known = {e.name for e in getattr(grid, f"{axis}s")}
        if names - known:
            raise ValueError(f"unknown {axis} {sorted(names - known)}; the grid has {sorted(known)}")
    return [cell for cell in grid.cells()
            if all(entry.name in only.get(axis, {entry.name}) for axis, entry in zip(("protocol", "defense", "attack"), cell))]


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


def importable_records(grid: Grid, table: str | Path) -> dict[str, dict]:
    """{cell id: record} of a `matrix.json` written earlier (e.g. on another machine) that count for
    this grid: a cell of the grid, the same arguments (fingerprint) and a finished status (ok or n/a)."""
    table = Path(table)
    if not table.is_file():
        raise FileNotFoundError(f"table {str(table)!r} does not exist")
    records = json.loads(table.read_text())
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"table {table}: expected the list of cell records that `lti matrix` writes as matrix.json")
    cells = {cell_id(*cell): cell for cell in grid.cells()}
    usable = {}
    for record in records:
        key = "__".join(str(record.get(axis)) for axis in ("protocol", "defense", "attack"))
        if key not in cells or record.get("status") not in FINISHED_STATUSES:
            continue
        if record.get("fingerprint") != cell_fingerprint(grid, *cells[key]):
            continue  # made with other arguments: the cell runs again
        usable[key] = record
    return usable


def import_records(grid: Grid, table: str | Path) -> int:
    """Seeds the grid's cells from `importable_records(grid, table)`; cells that already hold a record
    keep it. Returns how many were imported."""
    cells = {cell_id(*cell): cell for cell in grid.cells()}
    imported = 0
    for key, record in importable_records(grid, table).items():
        if (cell_folder(grid, *cells[key]) / "cell.json").is_file():
            continue
        _save_record(grid, cells[key], record)
        imported += 1
    return imported


def _finished(grid: Grid, protocol: Entry, defense: Entry, attack: Entry, failed_too: bool = False) -> dict | None:
    """The cell's stored record if it was made with the cell's current arguments (else None)."""
    path = cell_folder(grid, protocol, defense, attack) / "cell.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("fingerprint") != cell_fingerprint(grid, protocol, defense, attack):
        return None
    return record if failed_too or record.get("status") in FINISHED_STATUSES else None


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


def _summary(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['status']} ({record.get('reason')})"
    m = record["metrics"]
    parts = [f"{k} {100 * m[k]:.1f}%" for k in ("token_acc", "rouge1") if m.get(k) is not None]
    parts += [f"{k} {100 * m[k]:.1f}%" for k in m if k not in METRICS and k != "baseline_token_acc" and m[k] is not None]
    return ", ".join(parts) + f" ({record.get('seconds', 0):.0f} s)"


def _cell_text(record: dict | None) -> str:
    if record is None:
        return ""
    if record["status"] != "ok":
        return f"{record['status']}: {record.get('reason', '')}".replace("|", "/")
    m = record["metrics"]
    shown = [f"{100 * m[k]:.1f}" if m.get(k) is not None else "-" for k in ("token_acc", "rouge1")]
    extra = [f"{k} {100 * m[k]:.1f}" for k in m if k not in METRICS and k != "baseline_token_acc" and m[k] is not None]
    return " / ".join(shown) + (f" ({', '.join(extra)})" if extra else "")


def write_outputs(grid: Grid, records: list[dict]) -> None:
    out = grid.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(records, indent=2) + "\n")
    with open(out / "matrix.csv", "w", newline="") as handle:
        extra = sorted({k for r in records for k in (r.get("metrics") or {}) if k not in METRICS})
        writer = csv.writer(handle)
        writer.writerow(["protocol", "defense", "attack", "status", *METRICS, *extra, "epsilon", "seconds", "reason"])
        for r in records:
            m = r.get("metrics") or {}
            writer.writerow([r["protocol"], r["defense"], r["attack"], r["status"], *(m.get(k) for k in (*METRICS, *extra)),
                             r.get("epsilon"), r.get("seconds"), r.get("reason", "")])
    (out / "matrix.md").write_text(markdown_table(grid, records))
    plots = write_plots(grid, records)
    log_to_wandb(grid, records, plots)


def markdown_table(grid: Grid, records: list[dict]) -> str:
    by_key = {(r["protocol"], r["defense"], r["attack"]): r for r in records}
    attacks = [a.name for a in grid.attacks if any(r["attack"] == a.name for r in records)]
    lines = ["Cells: token accuracy / ROUGE-1 (%) on held-out clients; extra metrics in brackets.", "",
             "| protocol | defense | epsilon | " + " | ".join(attacks) + " | baseline |",
             "|---|---|---|" + "---|" * (len(attacks) + 1)]
    for p in grid.protocols:
        for d in grid.defenses:
            row = [by_key.get((p.name, d.name, a)) for a in attacks]
            if not any(row):
                continue
            eps = next((r.get("epsilon") for r in row if r and r.get("epsilon") is not None), None)
            base = next((r["metrics"].get("baseline_token_acc") for r in row if r and r.get("metrics")), None)
            lines.append(f"| {p.name} | {d.name} | {'' if eps is None else f'{eps:.3g}'} | "
                         + " | ".join(_cell_text(r) for r in row)
                         + f" | {'' if base is None else f'{100 * base:.1f}'} |")
    for attack in (a for a in grid.attacks if a.name in attacks):
        lines += ["", *headline_table(grid, attack, by_key)]
    return "\n".join(lines) + "\n"


def headline_table(grid: Grid, attack: Entry, by_key: dict[tuple[str, str, str], dict]) -> list[str]:
    """One attack's headline metric (%) as protocols x defenses: blank = not run yet."""
    defenses = [d.name for d in grid.defenses]
    lines = [f"**{attack.name}: {attack.headline} (%)**", "",
             "| protocol | " + " | ".join(defenses) + " |", "|---|" + "---|" * len(defenses)]
    for p in grid.protocols:
        row = [by_key.get((p.name, d, attack.name)) for d in defenses]
        if not any(row):
            continue
        texts = []
        for record in row:
            value = None if record is None else (record.get("metrics") or {}).get(attack.headline)
            texts.append("" if record is None else f"{100 * value:.1f}" if value is not None
                         else "n/a" if record["status"] == "n/a" else record["status"] if record["status"] != "ok" else "-")
        lines.append(f"| {p.name} | " + " | ".join(texts) + " |")
    return lines


def write_plots(grid: Grid, records: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["status"] == "ok"]
    attacks = [a.name for a in grid.attacks if any(r["attack"] == a.name for r in ok)]
    protocols = [p.name for p in grid.protocols if any(r["protocol"] == p.name for r in ok)]
    defenses = [d.name for d in grid.defenses if any(r["defense"] == d.name for r in ok)]
    paths = []
    if not ok:
        return paths
    columns = min(4, len(protocols))  # one panel per protocol, wrapped into rows of four
    rows = -(-len(protocols) // columns)
    for metric in ("rouge1", "token_acc"):
        fig, axes = plt.subplots(rows, columns, figsize=(max(3.2, 0.9 * len(defenses) + 1.5) * columns, 3.4 * rows),
                                 squeeze=False, sharey=True)
        width = 0.8 / max(1, len(attacks))
        for ax in axes.flat[len(protocols):]:
            ax.set_visible(False)
        for ax, protocol in zip(axes.flat, protocols):
            for i, attack in enumerate(attacks):
                values = []
                for d in defenses:
                    r = next((r for r in ok if (r["protocol"], r["defense"], r["attack"]) == (protocol, d, attack)), None)
                    values.append(float("nan") if r is None or r["metrics"].get(metric) is None else 100 * r["metrics"][metric])
                ax.bar([x + i * width for x in range(len(defenses))], values, width, label=attack)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(defenses))], defenses, rotation=30, ha="right")
            ax.set_title(protocol)
            ax.set_ylim(0, 100)
        for row in axes:
            row[0].set_ylabel(f"{metric} (%)")
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        path = grid.out_dir / f"{metric}_by_defense.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    noisy = [r for r in ok if r.get("noise") is not None]
    if noisy:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for protocol in protocols:
            for attack in attacks:
                points = sorted((r["noise"], 100 * r["metrics"]["rouge1"]) for r in noisy
                                if r["protocol"] == protocol and r["attack"] == attack and r["metrics"].get("rouge1") is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=f"{attack} ({protocol})")
        for r in noisy:  # annotate epsilon where the accountant gave one
            if r.get("epsilon") is not None and r["attack"] == attacks[0]:
                ax.annotate(f"eps={r['epsilon']:.3g}", (r["noise"], 100 * (r["metrics"].get("rouge1") or 0)), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("noise (DP-SGD noise multiplier / Gaussian sigma)")
        ax.set_ylabel("ROUGE-1 (%)")
        ax.set_title("privacy vs recovery")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = grid.out_dir / "privacy_utility.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def log_to_wandb(grid: Grid, records: list[dict], plots: list[Path]) -> None:
    if grid.wandb.get("mode") == "disabled":
        return
    import wandb

    run = wandb.init(project=grid.wandb.get("project", "lti"), mode=grid.wandb.get("mode", "offline"),
                     name=grid.wandb.get("name", f"matrix-{grid.out_dir.name}"), dir=str(grid.out_dir), reinit=True)
    columns = ["protocol", "defense", "attack", "status", *METRICS, "epsilon", "reason"]
    rows = [[r["protocol"], r["defense"], r["attack"], r["status"], *((r.get("metrics") or {}).get(k) for k in METRICS),
             r.get("epsilon"), r.get("reason", "")] for r in records]
    run.log({"matrix": wandb.Table(columns=columns, data=rows), **{p.stem: wandb.Image(str(p)) for p in plots}})
    run.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lti matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, help="grid YAML (see configs/matrix/)")
    parser.add_argument("--out_dir", help="where cells, tables and plots go (default: the grid's out_dir)")
    for axis in ("attack", "protocol", "defense"):
        parser.add_argument(f"--{axis}s", nargs="+", metavar=axis.upper(), help=f"run only these {axis}s' cells")
    parser.add_argument("--resume_from", metavar="MATRIX_JSON",
                        help="count the finished cells of an earlier table (matrix.json) as done where their arguments match")
    parser.add_argument("--inline", action="store_true", help="run cells in this process (faster, less isolated)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="run this many cells at once, as subprocesses (not with --inline); on a CPU each gets "
                             "an equal share of the cores")
    parser.add_argument("--threads_per_job", type=int,
                        help="CPU threads of each cell when --jobs > 1 (default: cores // jobs)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the lti commands of the selected cells still to run, and the time estimate; run nothing")
    args = parser.parse_args(argv)
    try:
        grid = load_grid(args.grid, args.out_dir)
        only = {"attack": args.attacks, "protocol": args.protocols, "defense": args.defenses}
        if args.dry_run:
            plan_grid(grid, only, args.resume_from, jobs=args.jobs)
            return
        if args.resume_from:
            print(f"imported {import_records(grid, args.resume_from)} finished cells from {args.resume_from}")
        records = run_grid(grid, inline=args.inline, only=only, jobs=args.jobs, threads_per_job=args.threads_per_job)
    except (ValueError, FileNotFoundError) as error:
        print(f"lti matrix: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    failed = [r for r in records if r["status"] == "failed"]
    print(f"\n{len(records)} cells ({len(failed)} failed) -> {grid.out_dir / 'matrix.md'}")
    print((grid.out_dir / "matrix.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
