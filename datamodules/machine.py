"""What machine a timing was measured on: the processor, the cores this process may use, torch's threads and the
vector instructions its CPU kernels picked, the GPU if one is used. Recorded beside wall times (the audit's
report, the investigations' rows), because the same attack takes 1.6 times as long on one 2-core "AMD EPYC" as on
another that reports the same name (docs/audit.md, "Time"): the family, model and kernel capability tell them
apart.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

#: /proc/cpuinfo's fields kept: the vendor's name alone does not tell two generations apart.
_CPUINFO_FIELDS = {"model name": "processor", "cpu family": "cpu_family", "model": "cpu_model"}


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's `_CPUINFO_FIELDS` from a Linux cpuinfo file (empty elsewhere or unreadable)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the first processor's block ends here
            break
        key, _, value = line.partition(":")
        key = key.strip()
        if key in _CPUINFO_FIELDS and _CPUINFO_FIELDS[key] not in found:
            found[_CPUINFO_FIELDS[key]] = value.strip()
    return found


def _usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_machine(device: torch.device | str | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """JSON-ready facts of this machine for a timing's record. `device`: the device the timed work ran on (a CUDA
    device adds its name)."""
    facts = {"processor": platform.processor() or platform.machine(), **_cpuinfo(cpuinfo),
             "cores": _usable_cores(), "torch_threads": torch.get_num_threads(),
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
    if device is not None and torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return facts


#: The facts two records must share to be timings of one machine (a GPU is compared when both name one).
_IDENTITY = ("processor", "cpu_family", "cpu_model", "cores", "cpu_capability")


def same_machine(a: dict, b: dict) -> bool:
    """Whether two `describe_machine` records are of one machine (as far as timings go)."""
    if any(a.get(key) != b.get(key) for key in _IDENTITY):
        return False
    return "gpu" not in a or "gpu" not in b or a["gpu"] == b["gpu"]


def machine_line(facts: dict) -> str:
    """`describe_machine`'s facts in one line for a report."""
    cpu = facts.get("processor", "unknown processor")
    if "cpu_family" in facts:
        cpu += f" (family {facts['cpu_family']}, model {facts.get('cpu_model', '?')})"
    line = (f"{cpu}, {facts.get('cores', '?')} cores, {facts.get('torch_threads', '?')} torch threads, "
            f"{facts.get('cpu_capability', '?')} kernels, torch {facts.get('torch', '?')}")
    return line + (f"; GPU {facts['gpu']}" if "gpu" in facts else "")
