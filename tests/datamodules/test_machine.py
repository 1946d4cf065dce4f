"""The machine a timing was measured on (`datamodules.machine`)."""

from __future__ import annotations

import json

import torch

from datamodules.machine import describe_machine, machine_line, same_machine

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


def test_the_first_processors_family_and_model_tell_two_of_one_name_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    facts = describe_machine(cpuinfo=cpuinfo)
    assert (facts["processor"], facts["cpu_family"], facts["cpu_model"]) == ("AMD EPYC", "25", "1")  # the first block's
    assert facts["cores"] >= 1 and facts["torch_threads"] == torch.get_num_threads()
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and facts["torch"] == torch.__version__
    assert "gpu" not in facts
    assert json.loads(json.dumps(facts)) == facts  # JSON-ready
    assert machine_line(facts).startswith("AMD EPYC (family 25, model 1), ")
    newer = {**facts, "cpu_model": "17"}
    assert same_machine(facts, dict(facts)) and not same_machine(facts, newer)
    assert not same_machine(facts, {**facts, "cpu_capability": "AVX512"})
    # The threads a process runs with are its choice, not the machine's; a GPU counts where both name one.
    assert same_machine(facts, {**facts, "torch_threads": 1, "gpu": "H200"})
    assert not same_machine({**facts, "gpu": "H100"}, {**facts, "gpu": "H200"})


def test_a_machine_without_a_readable_cpuinfo_still_says_what_it_knows(tmp_path):
    facts = describe_machine(cpuinfo=tmp_path / "absent")
    assert "cpu_family" not in facts and facts["processor"]
    assert "(family" not in machine_line(facts) and "torch threads" in machine_line(facts)
