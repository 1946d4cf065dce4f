"""Resources per cell (CPUs, GPUs, memory, time limit, SLURM partition/account/options): read from a grid
file's `resources:` block and `--resource+ [KIND.]KEY=VALUE` flags, checked, and merged per attack kind.

    resources:            # every cell
      cpus: 4
      timeout_min: 120
      learned: {gpus: 1, mem_gb: 32}    # learned-attack cells (LTI, LTI-P) on top
      exact: {cpus: 8}                  # exact-attack cells (DAGER, SPEAR) on top

Resources never enter a cell's fingerprint: they change where and how fast a cell runs, not its result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KINDS = ("learned", "exact")  # the attack kinds a resource block may single out (grid.KINDS)

#: Resource keys a grid file or `--resource` may set, with their types and what they mean.
RESOURCE_KEYS: dict[str, tuple[type, str]] = {
    "cpus": (int, "CPU cores (threads) per cell; local default: the machine's cores / max_parallel"),
    "gpus": (int, "GPUs per cell (local: the first N of the machine's; default: all of them)"),
    "mem_gb": (float, "memory per cell in GB (slurm)"),
    "timeout_min": (int, "time limit per cell in minutes (slurm default 1440; local: none)"),
    "partition": (str, "SLURM partition"),
    "account": (str, "SLURM account"),
    "sbatch": (dict, "extra sbatch options, e.g. {qos: high, constraint: a100}"),
    "setup": (list, "shell lines run before the cell (slurm), e.g. ['module load cuda']"),
}


def _typed(key: str, value: Any, source: str) -> Any:
    if key not in RESOURCE_KEYS:
        raise ValueError(f"{source}: unknown resource {key!r}; known: {', '.join(RESOURCE_KEYS)}")
    kind = RESOURCE_KEYS[key][0]
    if isinstance(value, str) and kind is not str:
        import yaml

        value = yaml.safe_load(value)  # "4" -> 4, "{qos: high}" -> {"qos": "high"}
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{source}: resource {key}={value!r} must be of type {kind.__name__}")
    if kind in (int, float) and value < (1 if key in ("cpus", "timeout_min") else 0):
        raise ValueError(f"{source}: resource {key}={value!r} is out of range")
    return value


def parse_resources(raw: Any, source: str) -> dict[str, dict[str, Any]]:
    """A grid's `resources:` block -> {"all": {...}, "learned": {...}, "exact": {...}}, checked."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: 'resources' must be a mapping of resource -> value")
    out: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        if key in KINDS:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: resources.{key} must be a mapping of resource -> value")
            out[key] = {k: _typed(k, v, f"{source}: resources.{key}") for k, v in value.items()}
        else:
            out.setdefault("all", {})[key] = _typed(key, value, f"{source}: resources")
    return out


def parse_resource_flags(flags: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`--resource+ [KIND.]KEY=VALUE` flags -> the same shape as `parse_resources`."""
    out: dict[str, dict[str, Any]] = {}
    for flag in flags:
        name, sep, value = flag.partition("=")
        if not sep or not name:
            raise ValueError(f"--resource {flag!r}: expected [KIND.]KEY=VALUE, e.g. learned.gpus=1")
        kind, _, key = name.rpartition(".")
        if kind and kind not in KINDS:
            raise ValueError(f"--resource {flag!r}: {kind!r} is not an attack kind; use one of {list(KINDS)}")
        out.setdefault(kind or "all", {})[key] = _typed(key, value, f"--resource {flag!r}")
    return out


def cell_resources(grid_resources: dict[str, dict[str, Any]], kind: str,
                   flags: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One cell's resources: the grid's for all cells, then for its kind; the flags' likewise, on top."""
    flags = flags or {}
    return {**grid_resources.get("all", {}), **grid_resources.get(kind, {}), **flags.get("all", {}), **flags.get(kind, {})}
