"""Grids that say why (docs/reliability.md): a bad cell argument, a failed cell, a missing grid folder and
Ctrl-C each end `lti matrix` with one clear line and the right exit status, and lose no finished cell."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import yaml
from conftest import REPO

from lti.cli import main as lti_main
from lti.matrix import cell_commands, load_grid, main, markdown_table, run_grid

TYPO = {"data.defense.init_args.sigmaa": 0.1}  # GaussianNoise takes `sigma`


def _edit_grid(grid_file, **changes) -> None:
    raw = yaml.safe_load(grid_file.read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("/")
        for key in parents:
            node = node[key]
        node[leaf] = value
    grid_file.write_text(yaml.safe_dump(raw, sort_keys=False))


def _table_columns(markdown: str) -> list[int]:
    """The number of cells of every table line of `markdown` (escaped pipes are not separators)."""
    return [len(re.split(r"(?<!\\)\|", line)) for line in markdown.splitlines() if line.startswith("|")]


def _no_check(monkeypatch) -> None:
    """Cells run without the up-front argument check (the grid is fine; the check costs the CLI's import)."""
    monkeypatch.setattr("lti.matrix.runner.check_arguments", lambda grid, cells: None)


# --------------------------------------------------------------------------------------------------------
# A misspelled override


def test_a_misspelled_override_is_refused_by_dry_run_and_run_with_the_cli_did_you_mean(grid_file, capsys):
    _edit_grid(grid_file, **{"defenses/gauss/overrides": TYPO})
    grid = load_grid(grid_file)
    # What `lti fit` itself says about the cell's arguments:
    with pytest.raises(SystemExit):
        lti_main(cell_commands(grid, grid.protocols[0], grid.defenses[1], grid.attacks[0])[0])
    said = capsys.readouterr().err.strip().removeprefix("lti: error: ")
    assert "did you mean 'data.defense.sigma'?" in said

    state = torch.get_rng_state(), random.getstate()
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--dry_run"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out.splitlines()[-1] == "# 3 cells to run"  # the plan is still printed
    assert err.splitlines() == ["lti matrix: error: 1 of 3 cells to run have bad arguments (fix the grid; no cell was started):",
                                f"  fedsgd__gauss__lti: {said}"]
    # Checking parses only: nothing is instantiated, seeded or written.
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]
    assert not grid.out_dir.exists()

    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--inline"])
    assert stop.value.code == 2 and f"fedsgd__gauss__lti: {said}" in capsys.readouterr().err
    assert not grid.out_dir.exists()  # not one cell ran (not even the good ones, nor the n/a one's record)


def test_cells_with_one_problem_are_named_together(grid_file, capsys):
    _edit_grid(grid_file, overrides={"trainer.max_steps": 2, "trainer.max_stepz": 3})
    with pytest.raises(SystemExit):
        main(["--grid", str(grid_file), "--dry_run"])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("lti matrix: error: 3 of 3 cells to run have bad arguments")
    assert err[1:] == ["  fedsgd__none__lti, fedsgd__none__dager, fedsgd__gauss__lti: unknown option 'trainer.max_stepz' "
                       "(did you mean 'trainer.max_steps'?); `lti fit --help` lists every option"]


# --------------------------------------------------------------------------------------------------------
# A failed cell


def test_a_cell_failing_on_its_arguments_records_the_cli_line(grid_file, monkeypatch):
    """A cell whose `lti` run refuses its arguments (not caught up front here) holds what `lti fit` says."""
    _no_check(monkeypatch)
    _edit_grid(grid_file, **{"defenses/gauss/overrides": TYPO})
    grid = load_grid(grid_file)
    (record,) = run_grid(grid, "inline", only={"defense": ["gauss"], "attack": ["lti"]}, echo=lambda _: None)
    assert record["status"] == "failed"
    assert record["reason"] == ("unknown option 'data.defense.sigmaa' (did you mean 'data.defense.sigma'?); "
                                "`lti fit --help` lists every option")


def test_a_failed_cell_is_one_escaped_line_and_the_grid_exits_1_saying_how_many(grid_file, monkeypatch, capsys):
    _no_check(monkeypatch)
    _edit_grid(grid_file, wandb={"mode": "disabled"})

    def fake_lti(args):  # the gauss LTI cell fails with a multi-line message; the others finish
        if "fedsgd__gauss__lti" in args[args.index("--trainer.default_root_dir") + 1]:
            raise RuntimeError("shapes differ | see below\n  <class 'torch.Tensor'> [4, 8]\n  vs [4, 9]")
        _finish(args)

    monkeypatch.setattr("lti.matrix.cell._run_lti", fake_lti)
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--inline"])
    out, err = capsys.readouterr()
    assert stop.value.code == 1
    assert err.splitlines() == ["lti matrix: 1 of 4 selected cells failed (fedsgd__gauss__lti); "
                                "their reasons are in matrix.md and `--status`"]
    assert "4 cells (1 failed)" in out  # the tables are written and shown first
    grid = load_grid(grid_file)
    record = json.loads((grid.out_dir / "cells" / "fedsgd__gauss__lti" / "cell.json").read_text())
    assert record["reason"] == "RuntimeError: shapes differ | see below <class 'torch.Tensor'> [4, 8] vs [4, 9]"
    table = (grid.out_dir / "matrix.md").read_text()
    assert r"failed: RuntimeError: shapes differ \| see below &lt;class 'torch.Tensor'&gt; [4, 8] vs [4, 9]" in table
    first = table.split("\n\n")[1]  # the protocol x defense x attack table: every row as wide as its header
    assert len(set(_table_columns(first))) == 1

    # A rerun retries the failed cell only; once it passes, the grid exits 0.
    monkeypatch.setattr("lti.matrix.cell._run_lti", _finish)
    main(["--grid", str(grid_file), "--inline"])
    out = capsys.readouterr().out
    assert "4 cells (0 failed)" in out and out.count("done before, skipped") == 3


def _finish(args) -> None:
    """A stand-in `lti` run that ends with the metrics file a cell reads."""
    folder = args[args.index("--trainer.default_root_dir") + 1]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "test_metrics.json"), "w") as handle:
        json.dump({"metrics": {"test/lti/token_acc": 0.5, "test/dager/token_acc": 1.0}}, handle)


def test_markdown_tables_stay_well_formed():
    from lti.matrix import Entry, Grid

    grid = Grid(out_dir=None, base=[], overrides={}, attacks=[Entry("lti")], defenses=[Entry("none")],
                protocols=[Entry("fedsgd")], wandb={})
    assert len(set(_table_columns(markdown_table(grid, [])))) == 1  # no record yet: header and rule agree
    failed = {"protocol": "fedsgd", "defense": "none", "attack": "lti", "status": "failed",
              "reason": "a | b\nc \\ d <e>"}
    text = markdown_table(grid, [failed])
    assert len(set(_table_columns(text.split("\n\n")[1]))) == 1
    assert r"failed: a \| b c \\ d &lt;e&gt;" in text


# --------------------------------------------------------------------------------------------------------
# --collect and --status where the grid never ran


@pytest.mark.parametrize("action", ["--collect", "--status"])
def test_collect_and_status_on_a_missing_folder_are_one_line_and_write_nothing(grid_file, tmp_path, capsys, action):
    missing = tmp_path / "no_such_grid"
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--out_dir", str(missing), action])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err.splitlines() == [f"lti matrix: error: no cells under '{missing}': the grid has not run there "
                                "(check --out_dir, or the grid's out_dir)"]
    assert not missing.exists()


def test_collect_with_no_finished_cell_is_one_line_and_writes_nothing(grid_file, tmp_path, capsys):
    out_dir = tmp_path / "started"
    (out_dir / "cells" / "fedsgd__none__lti").mkdir(parents=True)  # a cell started, none finished
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--out_dir", str(out_dir), "--collect"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"lti matrix: error: no cell under '{out_dir}' has finished yet: nothing to collect (`--status` lists the cells)"]
    assert [p.name for p in out_dir.iterdir()] == ["cells"]


# --------------------------------------------------------------------------------------------------------
# Ctrl-C

_FAKE_CELLS = textwrap.dedent('''
    """`lti matrix` whose cells' `lti` runs are stand-ins: the undefended cells finish at once, the next
    one waits for Ctrl-C and answers it as Lightning does (SIGINT ignored from then on, sys.exit(1))."""
    import json, os, signal, sys, time, types

    def run(args):
        folder = args[args.index("--trainer.default_root_dir") + 1]
        if "__none__" in folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "test_metrics.json"), "w") as handle:
                json.dump({"metrics": {"test/lti/token_acc": 0.5, "test/dager/token_acc": 1.0}}, handle)
            return
        print("a cell waits for Ctrl-C", flush=True)
        try:
            time.sleep(300)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.exit(1)

    sys.modules["lti.trainer_cli"] = types.SimpleNamespace(run=run)
    import lti.matrix.runner
    lti.matrix.runner.check_arguments = lambda grid, cells: None  # it needs the real CLI
    from lti.matrix import main
    main(sys.argv[1:])
''')


def _interrupt_when(process: subprocess.Popen, ready: str, timeout: float) -> tuple[str, str]:
    """Sends SIGINT once `ready` shows on stdout; returns (stdout, stderr) once the process ended."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(process.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not any(ready in line for line in out):
        assert process.poll() is None, "".join(out) + process.stderr.read()
        assert time.monotonic() < deadline, f"{ready!r} never came"
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    err = process.stderr.read()
    process.wait(timeout=120)
    reader.join(timeout=10)
    return "".join(out), err


def test_ctrl_c_stops_an_inline_grid_with_one_line_and_finished_cells_collect(grid_file, tmp_path, capsys):
    _edit_grid(grid_file, wandb={"mode": "disabled"})
    script = tmp_path / "fake_cells.py"
    script.write_text(_FAKE_CELLS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, str(script), "--grid", str(grid_file), "--inline"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _interrupt_when(process, "a cell waits for Ctrl-C", timeout=120)
    assert process.returncode == 130, (out, err)
    assert err.splitlines() == ["lti matrix: interrupted; the finished cells keep their records (`--collect` builds "
                                "the tables from them, a rerun resumes the rest)"]
    grid = load_grid(grid_file)
    records = {p.parent.name: json.loads(p.read_text()) for p in grid.out_dir.glob("cells/*/cell.json")}
    assert {k: r["status"] for k, r in records.items()} == {
        "fedsgd__none__lti": "ok", "fedsgd__none__dager": "ok", "fedsgd__gauss__dager": "n/a"}  # not the stopped cell

    main(["--grid", str(grid_file), "--collect"])
    assert "3 cell records" in capsys.readouterr().out
    assert len(json.loads((grid.out_dir / "matrix.json").read_text())) == 3


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_a_local_grid_with_one_line(grid_file):
    """A terminal's Ctrl-C reaches the whole process group (submitit's job controller and the cell
    too): still one line from `lti matrix`, and the job's processes end."""
    _edit_grid(grid_file, overrides={"trainer.max_steps": 5000})  # the first cell trains until interrupted
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    process = subprocess.Popen([sys.executable, "-m", "lti.matrix", "--grid", str(grid_file), "--launcher", "local"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    grid = load_grid(grid_file)
    logs = grid.out_dir / "cells" / "fedsgd__none__lti" / "job"

    def training() -> bool:
        return any("Seed set" in p.read_text() for p in logs.glob("*_log.err")) if logs.is_dir() else False

    out: list[str] = []
    threading.Thread(target=lambda: out.extend(process.stdout), daemon=True).start()
    deadline = time.monotonic() + 300
    while not training():
        assert process.poll() is None and time.monotonic() < deadline, "".join(out)
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    err = process.stderr.read()
    process.wait(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("lti matrix: interrupted;") and len(err.splitlines()) == 1, err
    assert "KeyboardInterrupt" in (logs / "controller.err").read_text()  # the controller's own report, kept aside
    # Only the n/a cell (written at once, never run) holds a record: the stopped cell runs again next time.
    assert [p.parent.name for p in grid.out_dir.glob("cells/*/cell.json")] == ["fedsgd__gauss__dager"]
