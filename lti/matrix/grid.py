"""The grid and its cells: a grid file's axes (`Entry`), `load_grid`, and each cell's id, folder, `lti`
commands and fingerprint; `select_cells` picks the cells of some names per axis."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lti.matrix.resources import KINDS, parse_resources

# What a cell reports, read from `test_metrics.json` under the attack's metric prefix.
METRICS = ("token_acc", "rouge1", "rouge2", "rougeL")


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
    # Where cells run (lti.matrix.resources): {"all" | "learned" | "exact": {resource: value}}.
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)

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
    unknown = set(raw) - {"out_dir", "base", "overrides", "attacks", "defenses", "protocols", "wandb", "resources"}
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
        resources=parse_resources(raw.get("resources"), f"grid {path}"),
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


def cell_list(ids: list[str], shown: int = 4) -> str:
    """Cell ids for a one-line message: the first `shown`, then how many more."""
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def not_applicable(protocol: Entry, defense: Entry, attack: Entry) -> str | None:
    """The grid's reason the attack does not apply to this protocol or defense (None: it applies)."""
    return attack.not_applicable.get(protocol.name) or attack.not_applicable.get(defense.name)


def cell_folder(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> Path:
    """Where one cell's run, checkpoint, log and `cell.json` record live."""
    return grid.out_dir / "cells" / cell_id(protocol, defense, attack)


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
    # Every learned cell keeps its learning curve (rows only where the grid validates during training).
    fit = ["fit", *args, *_flag("curve.path", str(folder / "curve.csv"))]
    return [fit, ["test", *args, "--ckpt_path", str(folder / "ckpt" / "last.ckpt")]]


def cell_fingerprint(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> str:
    """A digest of the cell's arguments. The cell's own folder is left out, so a table made under one
    out_dir still counts under another (`--resume_from`)."""
    folder = str(cell_folder(grid, protocol, defense, attack))
    commands = [[a.replace(folder, "{cell}") for a in c] for c in cell_commands(grid, protocol, defense, attack)]
    return hashlib.sha256(json.dumps(commands).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------
# Selecting cells


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
