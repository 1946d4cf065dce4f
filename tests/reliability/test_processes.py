"""`process_alive`: a lock holder that is exiting, a zombie, or reaped between two looks is dead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from datamodules import processes
from datamodules.processes import process_alive

linux_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_this_process_is_alive_and_a_reaped_one_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_alive(os.getpid()) and not process_alive(child.pid)


@linux_proc
def test_a_zombie_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert Path(f"/proc/{child.pid}/stat").exists() and not process_alive(child.pid)
    finally:
        child.wait()


@linux_proc
def test_a_process_reaped_between_the_signal_probe_and_the_proc_read_is_dead(monkeypatch):
    # The race that left a dead builder's partial folder behind: `os.kill(pid, 0)` still saw the zombie,
    # then its parent reaped it, and the missing /proc entry was read as "alive".
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    monkeypatch.setattr(processes.os, "kill", lambda pid, signal: None)  # the probe saw it
    assert not process_alive(child.pid)
