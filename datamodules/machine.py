"""What machine a timing was measured on: the processor, the logical CPUs this process may use, torch's threads and
the vector instructions its CPU kernels picked, the GPU the work ran on. Recorded beside wall times (the audit's
report, `LeakageAudit`'s summary, the batched investigations' rows), because two 2-core machines that both call
themselves "AMD EPYC" ran the same four updates at least 1.6 times apart (docs/audit.md, "Time"): the family, model
and kernel capability tell them apart.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

#: /proc/cpuinfo's fields kept (x86, then ARM's names for the same): the vendor's name alone does not tell two
#: generations apart.
_CPUINFO_FIELDS = {"model name": "processor", "cpu family": "cpu_family", "model": "cpu_model",
                   "CPU implementer": "cpu_family", "CPU part": "cpu_model"}


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's `_CPUINFO_FIELDS` from a Linux cpuinfo file (empty elsewhere or unreadable)."""
    try:
        text = path.read_text(errors="replace")
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


def usable_cpus() -> int:
    """The logical CPUs this process may run on: its affinity where the platform says (Python 3.13's
    `os.process_cpu_count`, else `sched_getaffinity`), else every CPU. A container's CPU quota is not counted."""
    counted = getattr(os, "process_cpu_count", None)
    if counted is not None:
        return counted() or 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_machine(device: torch.device | str | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """JSON-ready facts of this machine for a timing's record. `device`: the device the timed work ran on (a CUDA
    device adds its name; None or a CPU: no GPU named, whatever the machine has)."""
    facts = {"processor": platform.processor() or platform.machine(), **_cpuinfo(cpuinfo),
             "cpus": usable_cpus(), "torch_threads": torch.get_num_threads(),
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": str(torch.__version__)}
    if device is not None and torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return facts


def machine_line(facts: dict) -> str:
    """`describe_machine`'s facts in one line for a report."""
    cpu = facts.get("processor", "unknown processor")
    if "cpu_family" in facts:
        cpu += f" (family {facts['cpu_family']}, model {facts.get('cpu_model', '?')})"
    line = (f"{cpu}, {facts.get('cpus', '?')} CPUs, {facts.get('torch_threads', '?')} torch threads, "
            f"{facts.get('cpu_capability', '?')} kernels, torch {facts.get('torch', '?')}")
    return line + (f"; GPU {facts['gpu']}" if "gpu" in facts else "")
