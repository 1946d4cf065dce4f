"""The attack x defense x protocol matrix on a tiny grid (cells run in-process)."""

import csv
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from lti.cli import main as lti_main
from lti.matrix import cell_commands, load_grid, main, run_grid


def test_grid_runs_writes_tables_and_plots_and_resumes(grid_file, tmp_path):
    grid = load_grid(grid_file)
    lines: list[str] = []
    records = run_grid(grid, "inline", echo=lines.append)
    assert [(r["defense"], r["attack"], r["status"]) for r in records] == [
        ("none", "lti", "ok"), ("none", "dager", "ok"), ("gauss", "lti", "ok"), ("gauss", "dager", "n/a")]
    by = {(r["defense"], r["attack"]): r for r in records}
    # The exact attack on a tiny undefended update recovers the sequences; the cell reads its own metrics.
    assert by["none", "dager"]["metrics"]["rouge1"] == pytest.approx(1.0)
    assert by["none", "dager"]["metrics"]["exact_fraction"] == pytest.approx(1.0)
    assert 0.0 <= by["none", "lti"]["metrics"]["token_acc"] <= 1.0
    assert by["gauss", "dager"]["reason"] == "noise breaks exactness"
    # A learned cell really trained (fit wrote a checkpoint) and tested it.
    assert (grid.out_dir / "cells" / "fedsgd__none__lti" / "ckpt" / "last.ckpt").is_file()

    out = grid.out_dir
    rows = list(csv.DictReader((out / "matrix.csv").open()))
    assert len(rows) == 4 and rows[1]["attack"] == "dager" and float(rows[1]["rouge1"]) == pytest.approx(1.0)
    table = (out / "matrix.md").read_text()
    assert "| fedsgd | none |" in table and "n/a: noise breaks exactness" in table
    for plot in ("rouge1_by_defense.png", "token_acc_by_defense.png", "privacy_utility.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG", plot
    assert list(out.glob("wandb/offline-run-*"))

    # Resume: nothing is recomputed ...
    lines.clear()
    again = run_grid(grid, "inline", echo=lines.append)
    assert all(line.endswith("done before, skipped") for line in lines) and len(lines) == 4
    assert [r["metrics"] for r in again if r["status"] == "ok"] == [r["metrics"] for r in records if r["status"] == "ok"]
    # ... unless a cell's arguments change: only the changed defense's cell runs again.
    grid.defenses[0].overrides = {"data.hashing.bins": 9}
    lines.clear()
    run_grid(grid, "inline", echo=lines.append, only={"attack": ["dager"]})
    assert lines == ["[2/2] fedsgd x gauss x dager: done before, skipped", "[1/2] fedsgd x none x dager: running ...", lines[2]]
    assert lines[2].startswith("[1/2] fedsgd x none x dager: token_acc 100.0%")


def test_failed_cell_is_recorded_and_the_grid_goes_on(grid_file):
    grid = load_grid(grid_file)
    grid.attacks[0].overrides = {"data.seq_len": 99}  # longer than the target's positions
    records = run_grid(grid, "inline", only={"attack": ["lti"]}, echo=lambda _: None)
    assert [r["status"] for r in records] == ["failed", "failed"]  # the dager cells were not selected
    assert "exceeds the target model" in records[0]["reason"]
    assert "failed" in (grid.out_dir / "matrix.md").read_text()


def test_cells_stack_configs_in_order_and_isolate_outputs(grid_file):
    grid = load_grid(grid_file)
    protocol, defense, attack = grid.protocols[0], grid.defenses[1], grid.attacks[0]
    fit, test = cell_commands(grid, protocol, defense, attack)
    assert fit[0] == "fit" and test[0] == "test" and test[-2] == "--ckpt_path"
    configs = [fit[i + 1] for i, a in enumerate(fit) if a == "--config"]
    assert configs[-1].endswith("gaussian.yaml")
    assert fit[fit.index("--trainer.default_root_dir") + 1].endswith("fedsgd__gauss__lti/run")
    assert fit[fit.index("--curve.path") + 1].endswith("fedsgd__gauss__lti/curve.csv")  # each learned cell its curve
    assert "--curve.path" not in test
    (exact,) = cell_commands(grid, protocol, defense, grid.attacks[1])
    assert exact[0] == "test" and "--ckpt_path" not in exact


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attacks": {"x": {"kind": "magic"}}}, "kind='magic'"),
        ({"attacks": {"x": {"colour": 1}}}, "unknown keys ['colour']"),
        ({"attacks": {"x": {"headline": "cosine"}}}, "headline='cosine' is not one of its metrics"),
        ({"defenses": {"a__b": None}}, "may not contain '__'"),
        ({"protocols": {"p": "/no/such.yaml"}}, "'/no/such.yaml' (p) does not exist"),
        ({"protocols": {}}, "'protocols' must be a non-empty mapping"),
    ],
)
def test_bad_grid_gives_one_line(grid_file, capsys, change, message):
    grid = yaml.safe_load(grid_file.read_text())
    grid.update(change)
    grid_file.write_text(yaml.safe_dump(grid, sort_keys=False))
    with pytest.raises(SystemExit) as exit_info:
        main(["--grid", str(grid_file), "--dry_run"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_shipped_grid_loads_and_names_existing_configs(monkeypatch):
    monkeypatch.chdir(REPO)  # grid files name configs relative to the repository root
    grids = sorted((REPO / "configs" / "matrix").glob("*.yaml"))
    assert grids
    for path in grids:
        grid = load_grid(path)
        for protocol, defense, attack in grid.cells():
            assert cell_commands(grid, protocol, defense, attack)
        assert json.dumps([c.name for c in grid.attacks])


def test_selecting_an_unknown_cell_name_gives_one_line(grid_file, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--grid", str(grid_file), "--protocols", "fedavg"])
    assert exit_info.value.code == 2
    assert "unknown protocol ['fedavg']; the grid has ['fedsgd']" in capsys.readouterr().err


def test_lti_matrix_subcommand_dry_run_prints_every_cell(grid_file, capsys):
    lti_main(["matrix", "--grid", str(grid_file), "--dry_run"])
    commands = capsys.readouterr().out.splitlines()
    # 2 defenses x (lti: fit + test, dager: test), in grid order; DAGER under noise is n/a
    assert [c.split()[1] for c in commands] == ["fit", "test", "test", "fit", "test", "fedsgd__gauss__dager:", "3"]
    assert commands[-2:] == ["# fedsgd__gauss__dager: n/a (noise breaks exactness)", "# 3 cells to run"]
    # The axis filters apply to the plan as to the run.
    lti_main(["matrix", "--grid", str(grid_file), "--dry_run", "--attacks", "dager", "--defenses", "none"])
    commands = capsys.readouterr().out.splitlines()
    assert [c.split()[:2] for c in commands] == [["lti", "test"], ["#", "1"]]


def test_resume_from_an_earlier_table_under_another_out_dir(grid_file, tmp_path, capsys):
    grid = load_grid(grid_file)
    records = run_grid(grid, "inline", only={"attack": ["dager"]}, echo=lambda _: None)
    table = grid.out_dir / "matrix.json"
    # A copy of the grid elsewhere (another machine, a fresh checkout) seeds its cells from the table:
    # the finished DAGER cells (one ok, one n/a) are not run again, the LTI cells still are missing.
    moved = load_grid(grid_file, out_dir=tmp_path / "elsewhere")
    lines: list[str] = []
    from lti.matrix import import_records

    assert import_records(moved, table) == 2
    again = run_grid(moved, "inline", only={"attack": ["dager"]}, echo=lines.append)
    assert all(line.endswith("done before, skipped") for line in lines) and len(lines) == 2
    assert [r.get("metrics") for r in again] == [r.get("metrics") for r in records]
    assert import_records(moved, table) == 0  # cells holding a record keep it

    # A record made with other arguments is not imported.
    changed = load_grid(grid_file, out_dir=tmp_path / "changed")
    changed.overrides = {**changed.overrides, "data.hashing.bins": 9}
    assert import_records(changed, table) == 0
    assert not (changed.out_dir / "cells").exists()

    # The CLI flag; a missing table is a one-line error.
    main(["--grid", str(grid_file), "--out_dir", str(tmp_path / "cli"), "--resume_from", str(table),
          "--attacks", "dager", "--inline"])
    out = capsys.readouterr().out
    assert "imported 2 finished cells" in out and "2 cells (0 failed)" in out
    # A dry run with the table lists its cells as done, the others as commands, and writes nothing.
    main(["--grid", str(grid_file), "--out_dir", str(tmp_path / "plan"), "--resume_from", str(table), "--dry_run"])
    plan = capsys.readouterr().out.splitlines()
    assert "# fedsgd__none__dager: done" in plan and "# fedsgd__gauss__dager: n/a (noise breaks exactness)" in plan
    assert sum(line.startswith("lti fit") for line in plan) == 2 and plan[-1] == "# 2 cells to run"
    assert not (tmp_path / "plan").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["--grid", str(grid_file), "--resume_from", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_a_stopped_grid_records_no_failed_cell(grid_file, monkeypatch):
    """Lightning turns SIGTERM into SIGTERMException (a SystemExit): the grid stops, and the cell it was
    running is not written as failed (a rerun runs it again)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def stopped(args):
        raise SIGTERMException()

    monkeypatch.setattr("lti.matrix.cell._run_lti", stopped)
    grid = load_grid(grid_file)
    with pytest.raises(SIGTERMException):
        run_grid(grid, "inline", only={"attack": ["dager"]}, echo=lambda _: None)
    # Only the n/a cell (never run) holds a record.
    assert [p.parent.name for p in grid.out_dir.glob("cells/*/cell.json")] == ["fedsgd__gauss__dager"]


def test_remaining_time_is_estimated_from_finished_cells_of_the_same_protocol_and_kind():
    from lti.matrix import Entry, estimate_remaining
    from lti.matrix.runner import _eta_text

    fedsgd, fedavg, lora = Entry("fedsgd"), Entry("fedavg"), Entry("lora")
    none = Entry("none")
    lti, dager = Entry("lti"), Entry("dager", kind="exact", not_applicable={"lora": "no attention gradient"})
    finished = [
        {"protocol": "fedsgd", "kind": "learned", "status": "ok", "seconds": 100.0},
        {"protocol": "fedsgd", "kind": "learned", "status": "ok", "seconds": 60.0},
        {"protocol": "fedavg", "kind": "learned", "status": "ok", "seconds": 500.0},
        {"protocol": "fedavg", "kind": "learned", "status": "failed", "seconds": 1.0},  # not a timing
        {"protocol": "fedavg", "kind": "exact", "status": "n/a"},
    ]
    # FedAvg learned: its protocol's mean (500); LoRA learned: no LoRA timing, so every learned cell's
    # mean ((100 + 60 + 500) / 3 = 220); FedSGD DAGER: no exact timing at all; LoRA DAGER: n/a, free.
    pending = [(fedavg, none, lti), (lora, none, lti), (fedsgd, none, dager), (lora, none, dager)]
    seconds, unknown = estimate_remaining(finished, pending)
    assert seconds == pytest.approx(500.0 + 220.0) and unknown == 1
    assert _eta_text((seconds, unknown)) == " (grid: about 12 min left plus 1 cell never timed, from the finished cells' times)"
    assert _eta_text((4000.0, 0)) == " (grid: about 1 h 07 min left, from the finished cells' times)"
    assert _eta_text((0.0, 3)) == ""


def test_markdown_has_one_protocol_by_defense_table_per_attack_with_its_headline_metric():
    from lti.matrix import Entry, Grid, markdown_table

    spear = Entry("spear", kind="exact", extra_metrics=["rows_recovered"], headline="rows_recovered",
                  not_applicable={"lora": "no ReLU layer observed"})
    grid = Grid(out_dir=Path("unused"), base=[], overrides={}, attacks=[Entry("lti"), spear],
                defenses=[Entry("none"), Entry("sign")], protocols=[Entry("fedsgd"), Entry("lora")], wandb={})
    def ok(protocol, defense, attack, **metrics):
        return {
            "protocol": protocol, "defense": defense, "attack": attack, "status": "ok", "metrics": metrics}
    records = [
        ok("fedsgd", "none", "lti", token_acc=0.25, rouge1=0.3),
        {"protocol": "fedsgd", "defense": "sign", "attack": "lti", "status": "failed", "reason": "boom"},
        ok("fedsgd", "none", "spear", token_acc=None, rouge1=None, rows_recovered=1.0),
        ok("fedsgd", "sign", "spear", token_acc=None, rouge1=None, rows_recovered=0.0),
        {"protocol": "lora", "defense": "none", "attack": "spear", "status": "n/a", "reason": "no ReLU layer observed"},
        # lora x sign x spear and every lora lti cell: not run yet (blank; the lti table has no lora row).
    ]
    text = markdown_table(grid, records)
    lti_table = text[text.index("**lti: token_acc (%)**"):text.index("**spear")].strip().splitlines()
    assert lti_table[2:] == ["| protocol | none | sign |", "|---|---|---|", "| fedsgd | 25.0 | failed |"]
    spear_table = text[text.index("**spear: rows_recovered (%)**"):].strip().splitlines()
    assert spear_table[2:] == ["| protocol | none | sign |", "|---|---|---|", "| fedsgd | 100.0 | 0.0 |", "| lora | n/a |  |"]


def test_dry_run_estimates_the_cells_to_run_from_the_finished_ones(grid_file):
    from lti.matrix import plan_grid

    grid = load_grid(grid_file)
    run_grid(grid, "inline", only={"attack": ["dager"], "defense": ["none"]}, echo=lambda _: None)
    (record_path,) = grid.out_dir.glob("cells/fedsgd__none__dager/cell.json")
    record = json.loads(record_path.read_text())
    record["seconds"] = 180.0  # as if the finished DAGER cell had taken 3 min
    record_path.write_text(json.dumps(record))
    grid.attacks[1].not_applicable = {}  # DAGER under noise now runs: one more exact cell to do

    lines: list[str] = []
    assert plan_grid(grid, {"attack": ["dager"]}, echo=lines.append) == 1
    assert lines[0] == "# fedsgd__none__dager: done" and lines[1].startswith("lti test ")
    assert lines[-1] == "# 1 cell to run (grid: about 3 min left, from the finished cells' times)"
    lines.clear()
    plan_grid(grid, {"attack": ["dager"]}, echo=lines.append, max_parallel=2)  # two cells at once: half the time
    assert lines[-1] == "# 1 cell to run (grid: about 2 min left, from the finished cells' times)"
    lines.clear()
    # Learned cells were never timed: counted, not guessed.
    assert plan_grid(grid, None, echo=lines.append) == 3
    assert lines[-1] == "# 3 cells to run (grid: about 3 min left plus 2 cells never timed, from the finished cells' times)"
    # Once its arguments change, the finished cell is stale: it runs again and its time no longer counts.
    grid.defenses[0].overrides = {"data.hashing.bins": 9}
    lines.clear()
    assert plan_grid(grid, {"attack": ["dager"]}, echo=lines.append) == 2 and lines[-1] == "# 2 cells to run"



def test_cell_records_are_replaced_whole(grid_file, monkeypatch):
    """Two `lti matrix` runs may fill slices of one grid: a record is written aside and renamed, so a
    reader sees the old record or the new one, never a partial file."""
    from lti.matrix.records import _finished, _save_record

    grid = load_grid(grid_file)
    run_grid(grid, "inline", only={"attack": ["dager"], "defense": ["none"]}, echo=lambda _: None)
    (path,) = grid.out_dir.glob("cells/fedsgd__none__dager/cell.json")
    record = json.loads(path.read_text())
    cell = next(c for c in grid.cells() if (c[0].name, c[1].name, c[2].name) == ("fedsgd", "none", "dager"))
    _save_record(grid, cell, {**record, "seconds": 12.5})
    assert _finished(grid, *cell)["seconds"] == 12.5
    assert [p.name for p in path.parent.iterdir() if p.name.startswith("cell.json")] == ["cell.json"]
    # Until the rename, the finished record stays in place (a direct write would have truncated it).
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr("lti.matrix.records.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save_record(grid, cell, {**record, "seconds": 99.0})
    assert _finished(grid, *cell)["seconds"] == 12.5


def test_a_learned_cell_starts_from_an_empty_checkpoint_folder(grid_file, monkeypatch):
    """A retried or redone cell's old checkpoints would make its `lti fit` refuse the folder."""
    from lti.matrix.cell import run_cell
    from lti.matrix.grid import cell_folder

    grid = load_grid(grid_file)
    protocol, defense = grid.protocols[0], grid.defenses[0]
    attack = next(a for a in grid.attacks if a.kind != "exact")
    stale = cell_folder(grid, protocol, defense, attack) / "ckpt" / "step4.ckpt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier attempt")
    seen = []
    monkeypatch.setattr("lti.matrix.cell._run_lti", lambda args: seen.append(stale.parent.exists()))
    run_cell(grid, protocol, defense, attack)  # fails later (no metrics file): only the folder matters here
    assert seen and seen[0] is False


# --------------------------------------------------------------------------------------------------------
# The command line: jsonargparse over `lti.matrix.options.MatrixOptions`, the argparse spellings rewritten


def test_old_and_new_spellings_give_the_same_options_and_the_old_one_line(tmp_path, capsys):
    from lti.matrix.cli import parse

    old = parse(["--grid", "g.yaml", "--attacks", "dager", "spear", "--defenses", "none", "--inline",
                 "--resource", "cpus=1", "--resource", "sbatch={qos: high}", "--max_parallel", "2"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("lti matrix: warning: deprecated spelling: --attacks dager spear -> --attacks '[dager, spear]'; "
                    "--defenses none -> --defenses '[none]'; --resource cpus=1 -> --resource+ cpus=1; "
                    "--resource 'sbatch={qos: high}' -> --resource+ 'sbatch={qos: high}'")
    new = parse(["--grid", "g.yaml", "--attacks", "[dager, spear]", "--defenses+", "none", "--inline", "true",
                 "--resource", '[cpus=1, "sbatch={qos: high}"]', "--max_parallel", "2"])
    assert old == new and capsys.readouterr().err == ""
    assert new.attacks == ["dager", "spear"] and new.protocols is None and new.inline and new.launcher is None
    assert new.resource == ["cpus=1", "sbatch={qos: high}"]
    # bare flags are jsonargparse's own spelling too (no line); a config file gives the options
    config = tmp_path / "matrix.yaml"
    config.write_text("grid: g.yaml\nattacks: [dager]\nlauncher: slurm\nresource: [partition=gpu]\n")
    from_file = parse(["--config", str(config), "--resource+", "learned.gpus=1", "--dry_run"])
    assert (from_file.attacks, from_file.launcher, from_file.dry_run) == (["dager"], "slurm", True)
    assert from_file.resource == ["partition=gpu", "learned.gpus=1"] and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["--collect", "--status"], "--collect and --status exclude each other: give one"),
    (["--max_parallel", "0"], "--max_parallel 0 must be at least 1"),
    (["--lancher", "local"], "unknown option 'lancher' (did you mean 'launcher'?); `lti matrix --help` lists every option"),
    (["--launcher", "cloud"], "bad value for 'launcher'"),
], ids=["exclusive", "max_parallel", "unknown-option", "launcher"])
def test_bad_options_are_one_line_before_the_grid_is_read(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--grid", str(tmp_path / "missing.yaml"), *argv])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and line.startswith("lti matrix: error: ") and message in line, line


def test_help_lists_the_options_dataclass_and_the_resources(capsys):
    from typing import get_args

    from lti.matrix import LAUNCHERS
    from lti.matrix.options import Launcher

    assert get_args(Launcher) == tuple(LAUNCHERS)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "Print the lti commands of the selected cells still to run" in " ".join(out.split())
    assert "  timeout_min  time limit per cell in minutes" in out and "exit status: 0 done" in out
