"""The options of `lti matrix`: a dataclass that becomes its `--help` (`lti.command_line`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: The launchers of `lti.matrix.launchers.LAUNCHERS`, as a type the parser checks.
Launcher = Literal["inline", "local", "slurm"]


@dataclass
class MatrixOptions:
    """`lti matrix`: runs, resumes, submits, follows, collects or plans a grid.

    Args:
        grid: Grid YAML (see configs/matrix/).
        out_dir: Where cells, tables and plots go; None: the grid's out_dir.
        attacks: Only these attacks' cells; None: all of them.
        protocols: Only these protocols' cells; None: all of them.
        defenses: Only these defenses' cells; None: all of them.
        resume_from: Count the finished cells of an earlier table (a matrix.json) as done where their arguments match.
        launcher: Where cells run: inline (this process, one at a time), local (a process per cell, submitit),
            slurm (a SLURM job per cell, submitit; returns once submitted). None: local.
        inline: The same as `--launcher inline`.
        max_parallel: Cells at once with `--launcher local`; each gets cores / max_parallel CPU threads unless
            `--resource+ cpus=N` says otherwise.
        resource: Resources for every cell, or only learned/exact ones: `[KIND.]KEY=VALUE` each (see below);
            `--resource+ KEY=VALUE` adds one.
        collect: Build the tables and plots from the cells finished so far; run nothing.
        status: List the cells as done / running / failed / pending, with job ids; run nothing.
        dry_run: Print the lti commands of the selected cells still to run, and the time estimate; run nothing.
    """

    grid: str
    out_dir: str | None = None
    attacks: list[str] | None = None
    protocols: list[str] | None = None
    defenses: list[str] | None = None
    resume_from: str | None = None
    launcher: Launcher | None = None
    inline: bool = False
    max_parallel: int = 1
    resource: list[str] = field(default_factory=list)
    collect: bool = False
    status: bool = False
    dry_run: bool = False

    def check(self) -> None:
        actions = [f"--{name}" for name in ("collect", "status", "dry_run") if getattr(self, name)]
        if len(actions) > 1:
            raise ValueError(f"{' and '.join(actions)} exclude each other: give one")
        if self.max_parallel < 1:
            raise ValueError(f"--max_parallel {self.max_parallel} must be at least 1")
