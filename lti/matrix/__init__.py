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
`--launcher` says where cells run: `inline` (this process), `local` (a process per cell through
submitit, `--max_parallel` at once) or `slurm` (a SLURM job per cell through submitit), with resources
per cell from the grid's `resources:` block and `--resource`. Every cell writes its own record, so
`--collect` builds the tables from whatever has finished and `--status` lists done / running / failed
/ pending cells with their job ids; two `lti matrix` runs on disjoint slices of one grid may share its
folder (records are written whole).
The table goes to `matrix.csv`, `matrix.json`, `matrix.md`, the plots to
`*.png`, and all of them to one W&B run (offline unless the grid says otherwise).
Before any cell runs (and with `--dry_run`), every cell's arguments are parsed by the parser of `lti fit`:
a misspelled override stops the grid with the CLI's own line ("did you mean ..."). A failed cell's
record holds its reason on one line; `lti matrix` exits 1 when a selected cell failed, 2 on bad input,
130 on Ctrl-C (finished cells keep their records).

This package drives the CLI; it holds no model code. Its modules, each importing only those above it:

* `resources`: the resources a cell may ask for, from the grid file and `--resource`;
* `grid`: the grid file (`Entry`, `Grid`, `load_grid`) and each cell's id, folder, commands, fingerprint;
* `records`: the cells' `cell.json` records, and importing them from an earlier `matrix.json`;
* `validation`: the cells' `lti` arguments checked by the Lightning CLI's parser before anything runs;
* `report`: the tables, plots and W&B run;
* `cell`: one cell's `lti` runs in the current process, and its record;
* `launchers`: where cells run (`inline`, `local`, `slurm`), their jobs' files and states;
* `runner`: the grid through a launcher, `--collect`, `--status`, the `--dry_run` plan, the time estimate;
* `options`: `MatrixOptions`, the command line's options (parsed by `lti.command_line`);
* `cli`: `main`, the `lti matrix` command line (also `python -m lti.matrix`).
"""

from lti.matrix.cell import run_cell
from lti.matrix.cli import main  # last: the command line sits on top of the rest
from lti.matrix.grid import (
                             KINDS,
                             METRICS,
                             Entry,
                             Grid,
                             cell_commands,
                             cell_fingerprint,
                             cell_folder,
                             cell_id,
                             load_grid,
                             select_cells,
)
from lti.matrix.launchers import LAUNCHERS, execute_cell, make_launcher
from lti.matrix.records import FINISHED_STATUSES, import_records, importable_records
from lti.matrix.report import headline_table, log_to_wandb, markdown_table, write_outputs, write_plots
from lti.matrix.resources import RESOURCE_KEYS
from lti.matrix.runner import collect, estimate_remaining, grid_status, plan_grid, run_grid

__all__ = [
    "KINDS", "METRICS", "Entry", "Grid", "cell_commands", "cell_fingerprint", "cell_folder", "cell_id", "load_grid",
    "select_cells", "FINISHED_STATUSES", "import_records", "importable_records", "headline_table", "log_to_wandb",
    "markdown_table", "write_outputs", "write_plots", "run_cell", "LAUNCHERS", "execute_cell", "make_launcher",
    "RESOURCE_KEYS", "collect", "estimate_remaining", "grid_status", "plan_grid", "run_grid", "main",
]
