"""Whether a process that holds a lock (an observation cache build, a checkpoint folder) is still alive."""

from __future__ import annotations

import os
from pathlib import Path

PF_EXITING = 0x4  # Linux's flag of a process in exit (/proc/<pid>/stat, field 9)


def process_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this machine (an exiting or zombie process counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:  # Linux: a process that is exiting (it has let go of its lock) or not yet reaped (a zombie) is dead too
        state, *_, flags = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:7]
        return state not in ("Z", "X") and not int(flags) & PF_EXITING
    except FileNotFoundError:  # with /proc mounted, no entry means the process was reaped since `os.kill` saw it
        return not Path("/proc/self/stat").exists()
    except (OSError, ValueError):
        return True
