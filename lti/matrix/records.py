"""Cell records: each finished cell's `cells/<cell id>/cell.json`, written whole, read back only while its
arguments (fingerprint) still match, and seeded from an earlier `matrix.json` (`--resume_from`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lti.matrix.grid import Entry, Grid, cell_fingerprint, cell_folder, cell_id

#: Record statuses that count as done (a rerun skips them); "failed" cells are retried.
FINISHED_STATUSES = ("ok", "n/a")

#: The longest reason a record keeps (a failed cell's error, shortened).
REASON_CHARS = 300


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """`text` on one line (a record's reason goes into one table cell and one `--status` row),
    shortened to `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _save_record(grid: Grid, cell: tuple[Entry, Entry, Entry], record: dict) -> None:
    path = cell_folder(grid, *cell) / "cell.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename, so that a second `lti matrix` filling another slice of the same grid (they
    # read every cell's record to write the tables) never reads a half-written record.
    partial = path.with_name(f"cell.json.{os.getpid()}.partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)


def _finished(grid: Grid, protocol: Entry, defense: Entry, attack: Entry, failed_too: bool = False) -> dict | None:
    """The cell's stored record if it was made with the cell's current arguments (else None)."""
    path = cell_folder(grid, protocol, defense, attack) / "cell.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("fingerprint") != cell_fingerprint(grid, protocol, defense, attack):
        return None
    return record if failed_too or record.get("status") in FINISHED_STATUSES else None


def stored_records(grid: Grid) -> list[dict]:
    """The records (finished or failed) of the grid's cells made with their current arguments, in grid order."""
    return [r for r in (_finished(grid, *c, failed_too=True) for c in grid.cells()) if r is not None]


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
