"""The machine a timing was measured on (`datamodules.machine`)."""

from __future__ import annotations

import json
import os

import torch

from datamodules import machine
from datamodules.machine import describe_machine, machine_line

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx2

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 17
model name\t: Another
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


def test_the_first_processors_family_and_model_tell_two_of_one_name_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    facts = describe_machine(cpuinfo=cpuinfo)
    assert (facts["processor"], facts["cpu_family"], facts["cpu_model"]) == ("AMD EPYC", "25", "1")  # the first block's
    assert set(facts) == {"processor", "cpu_family", "cpu_model", "cpus", "torch_threads", "cpu_capability", "torch"}
    assert json.loads(json.dumps(facts)) == facts  # JSON-ready
    assert machine_line(facts).startswith("AMD EPYC (family 25, model 1), ")
    # An ARM machine names its implementer and part instead.
    cpuinfo.write_text(ARM_CPUINFO)
    arm = describe_machine(cpuinfo=cpuinfo)
    assert (arm["cpu_family"], arm["cpu_model"]) == ("0x41", "0xd0c")


def test_a_machine_without_a_readable_cpuinfo_still_says_what_it_knows(tmp_path):
    facts = describe_machine(cpuinfo=tmp_path / "absent")
    assert "cpu_family" not in facts and facts["processor"]
    assert "(family" not in machine_line(facts) and "torch threads" in machine_line(facts)
    (tmp_path / "binary").write_bytes(b"model name\t: \xff\xfe\n")  # undecodable: replaced, not raised
    assert describe_machine(cpuinfo=tmp_path / "binary")["processor"] == "\ufffd\ufffd"


def test_a_gpu_is_named_only_for_work_that_ran_on_it(monkeypatch):
    named = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: named.append(device) or "H200")
    assert describe_machine("cuda:1")["gpu"] == "H200" and named == [torch.device("cuda:1")]
    assert "gpu" not in describe_machine("cpu") and "gpu" not in describe_machine(None)
    assert machine_line({**describe_machine("cpu"), "gpu": "H200"}).endswith("; GPU H200")


def test_the_cpus_a_process_may_use_fall_back_to_every_cpu_where_the_platform_cannot_say(monkeypatch):
    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert machine.usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert machine.usable_cpus() == 7
