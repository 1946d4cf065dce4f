"""`lti matrix --launcher inline | local | slurm`, `--status` and `--collect` on a tiny grid.

The local launcher is tested for real (cells as separate processes through submitit); SLURM cannot be
reached here, so its path is tested up to the cluster: the sbatch script submitit writes for each
cell, handed to stub `sbatch`/`srun`/`sacct`/`scancel` commands on PATH.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from lti.matrix import collect, grid_status, load_grid, main, run_grid
from lti.matrix.launchers import LocalLauncher, SlurmLauncher, read_job_file
from lti.matrix.resources import cell_resources, parse_resource_flags, parse_resources


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, Z, ...), None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _by_cell(records):
    return {(r["protocol"], r["defense"], r["attack"]): r for r in records}


# --------------------------------------------------------------------------------------------------------
# Resources


def test_resources_merge_grid_then_kind_then_flags():
    grid = parse_resources({"cpus": 2, "timeout_min": 60, "learned": {"gpus": 1}, "exact": {"cpus": 8}}, "grid g")
    flags = parse_resource_flags(["mem_gb=16", "exact.cpus=4", "sbatch={qos: high}", "setup=['module load cuda']"])
    assert cell_resources(grid, "learned", flags) == {"cpus": 2, "timeout_min": 60, "gpus": 1, "mem_gb": 16.0,
                                                      "sbatch": {"qos": "high"}, "setup": ["module load cuda"]}
    assert cell_resources(grid, "exact", flags)["cpus"] == 4  # the flag for the kind wins over the grid's
    assert cell_resources({}, "exact") == {}


@pytest.mark.parametrize("flag, message", [
    ("gpus", "expected [KIND.]KEY=VALUE"),
    ("colour=red", "unknown resource 'colour'"),
    ("cpus=two", "cpus='two' must be of type int"),
    ("cpus=0", "cpus=0 is out of range"),
    ("vision.cpus=2", "'vision' is not an attack kind"),
])
def test_bad_resource_flags_give_one_line(grid_file, capsys, flag, message):
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--resource+", flag])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not list(load_grid(grid_file).out_dir.glob("cells/*"))


def test_bad_resources_in_the_grid_file_and_contradicting_flags(grid_file, capsys):
    import yaml

    raw = yaml.safe_load(grid_file.read_text())
    grid_file.write_text(yaml.safe_dump({**raw, "resources": {"learned": {"gpu": 1}}}))
    with pytest.raises(ValueError, match=r"resources.learned: unknown resource 'gpu'"):
        load_grid(grid_file)
    grid_file.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit):
        main(["--grid", str(grid_file), "--inline", "--launcher", "slurm"])
    assert "--inline contradicts --launcher slurm" in capsys.readouterr().err
    with pytest.raises(ValueError, match="use --launcher local"):
        run_grid(load_grid(grid_file), "inline", max_parallel=2)


# --------------------------------------------------------------------------------------------------------
# Local: separate processes through submitit


@pytest.mark.slow
def test_local_launcher_runs_cells_as_processes_side_by_side_and_matches_inline(grid_file, tmp_path, capsys):
    """Two cells at a time, each in a process of its own, with the same results as in this process
    (both with one CPU thread per cell, so that the float sums are the same)."""
    main(["--grid", str(grid_file), "--launcher", "local", "--max_parallel", "2", "--resource", "cpus=1"])
    assert "4 cells (0 failed)" in capsys.readouterr().out
    grid = load_grid(grid_file)
    local = _by_cell(json.loads((grid.out_dir / "matrix.json").read_text()))
    inline = _by_cell(run_grid(load_grid(grid_file, tmp_path / "inline"), "inline", echo=lambda _: None,
                               resources={"all": {"cpus": 1}}))
    assert local.keys() == inline.keys() and len(local) == 4
    for key in local:
        assert local[key]["status"] == inline[key]["status"], key
        assert local[key].get("metrics") == inline[key].get("metrics"), key
    assert local["fedsgd", "none", "dager"]["metrics"]["exact_fraction"] == 1.0
    # Separate processes, two of them at once (the n/a cell is written at once, never run).
    assert "job" not in local["fedsgd", "gauss", "dager"]
    jobs = [record["job"] for record in local.values() if record["status"] == "ok"]
    assert {job["launcher"] for job in jobs} == {"local"}
    assert len({job["pid"] for job in jobs}) == 3 and os.getpid() not in {job["pid"] for job in jobs}
    overlaps = [(a, b) for a in jobs for b in jobs if a is not b and a["started"] < b["started"] < a["ended"]]
    assert overlaps, jobs
    assert "job" not in inline["fedsgd", "none", "lti"]
    # Each cell's own output and job files stay in its folder.
    folder = grid.out_dir / "cells" / "fedsgd__none__lti"
    assert read_job_file(grid, next(c for c in grid.cells() if c[1].name == "none" and c[2].name == "lti"))["launcher"] == "local"
    logs = list((folder / "job").glob("*_log.out"))
    assert logs and any("Epoch" in log.read_text() or "lti" in log.read_text() for log in logs)
    # A rerun finds every cell done.
    lines: list[str] = []
    run_grid(grid, "local", echo=lines.append)
    assert len(lines) == 4 and all(line.endswith("done before, skipped") for line in lines)


@pytest.mark.slow
def test_local_launcher_ctrl_c_stops_the_running_cells(grid_file, monkeypatch):
    """Ctrl-C while a cell trains in its own process: that process (and its controller) ends, no record
    is written, and the cells not started stay pending."""
    import lti.matrix.launchers as launchers

    grid = load_grid(grid_file)
    grid.overrides["trainer.max_steps"] = 2000  # long enough to be interrupted while it trains
    launcher = LocalLauncher(grid, max_parallel=1)
    submitted, cell_pids = [], []
    real_submit, real_sleep = launcher.submit, time.sleep
    monkeypatch.setattr(launcher, "submit", lambda cell: submitted.append(real_submit(cell)) or submitted[-1])

    def sleep_until_training_then_interrupt(seconds):
        real_sleep(seconds)
        if submitted and not cell_pids:
            logs = "".join(p.read_text() for p in submitted[0].paths.folder.glob("*_log.*"))
            if "Seed set" in logs:  # the cell's `lti fit` is under way
                cell_pids.extend(launchers._children(int(submitted[0].job_id)))
                raise KeyboardInterrupt

    monkeypatch.setattr(launchers.time, "sleep", sleep_until_training_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_grid(grid, launcher, only={"defense": ["none"]}, echo=lambda _: None)
    monkeypatch.setattr(launchers.time, "sleep", real_sleep)
    (job,) = submitted
    assert cell_pids and job.done()
    states = {pid: _process_state(pid) for pid in cell_pids}
    assert all(state in (None, "Z") for state in states.values()), states  # gone (or a zombie awaiting its reaper)
    assert not list(grid.out_dir.glob("cells/*/cell.json"))
    statuses = {row["cell"]: row["status"] for row in grid_status(grid)}
    assert statuses == dict.fromkeys(statuses, "pending")


def test_ctrl_c_inside_a_cell_stops_an_inline_grid(grid_file, monkeypatch):
    """Lightning answers Ctrl-C with SIGINT ignored and sys.exit(1): the grid stops (KeyboardInterrupt),
    the cell is not written as failed, and SIGINT works again afterwards."""
    def interrupted_fit(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.exit(1)

    monkeypatch.setattr("lti.trainer_cli.run", interrupted_fit)
    monkeypatch.setattr("lti.matrix.runner.check_arguments", lambda grid, cells: None)  # it builds its parser by run
    grid = load_grid(grid_file)
    with pytest.raises(KeyboardInterrupt):
        run_grid(grid, "inline", only={"defense": ["none"]}, echo=lambda _: None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not list(grid.out_dir.glob("cells/*/cell.json"))


def test_a_cell_whose_job_still_runs_is_not_started_again(grid_file, monkeypatch):
    """A rerun (e.g. to add an attack) skips cells whose earlier job is still queued or running."""
    import lti.matrix.launchers as launchers
    from lti.matrix.launchers import write_job_file

    grid = load_grid(grid_file)
    cell = next(c for c in grid.cells() if c[1].name == "none" and c[2].name == "dager")
    write_job_file(grid, cell, "slurm", "77")
    monkeypatch.setattr("lti.matrix.runner.job_states", lambda jobs: ["PENDING" for _ in jobs])
    lines: list[str] = []
    run_grid(grid, "inline", only={"attack": ["dager"]}, echo=lines.append)
    assert "[1/2] fedsgd x none x dager: already queued as slurm job 77, skipped" in lines
    assert not (launchers.cell_folder(grid, *cell) / "cell.json").exists()
    rows = {row["cell"]: row for row in grid_status(grid)}
    assert rows["fedsgd__none__dager"]["status"] == "queued" and rows["fedsgd__none__dager"]["job_id"] == "77"


def test_status_reads_cancelled_slurm_states_and_reused_local_pids(grid_file, fake_slurm, monkeypatch):
    from lti.matrix.launchers import job_states, write_job_file

    grid = load_grid(grid_file)
    cell = next(c for c in grid.cells() if c[1].name == "none" and c[2].name == "lti")
    write_job_file(grid, cell, "local", str(os.getpid()))  # a live process, but not a submitit controller
    assert job_states([read_job_file(grid, cell)]) == ["ENDED"]
    assert {row["cell"]: row["status"] for row in grid_status(grid)}["fedsgd__none__lti"] == "pending"
    write_job_file(grid, cell, "slurm", "12")
    monkeypatch.setenv("FAKE_SACCT_STATE", "CANCELLED by 1234")  # how sacct words a cancelled job
    assert job_states([read_job_file(grid, cell)]) == ["CANCELLED"]
    assert {row["cell"]: row["status"] for row in grid_status(grid)}["fedsgd__none__lti"] == "pending"
    write_job_file(grid, cell, "slurm", "13")  # another job (submitit keeps the states of ended jobs it read)
    monkeypatch.setenv("FAKE_SACCT_STATE", "OUT_OF_MEMORY")
    assert {row["cell"]: row["status"] for row in grid_status(grid)}["fedsgd__none__lti"] == "failed"


@pytest.mark.slow
def test_a_killed_local_run_resumes_and_collects_without_recomputing(grid_file, tmp_path, capsys):
    """`lti matrix --launcher local` killed (SIGKILL, with its cells) after its first cell: the finished
    cell's record is whole and kept, --status and --collect see exactly it, and the rerun runs only the
    other cells."""
    env = {**os.environ, "WANDB_SILENT": "true"}
    command = [sys.executable, "-m", "lti.matrix", "--grid", str(grid_file), "--launcher", "local"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    grid = load_grid(grid_file)
    deadline = time.monotonic() + 300
    try:
        while not list(grid.out_dir.glob("cells/*/cell.json")):
            assert process.poll() is None, "the grid ended before it was killed"
            assert time.monotonic() < deadline, "no cell finished within 5 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    records = {path.parent.name: json.loads(path.read_text()) for path in grid.out_dir.glob("cells/*/cell.json")}
    assert records and all(r["status"] in ("ok", "n/a") for r in records.values())
    rows = {row["cell"]: row for row in grid_status(grid)}
    assert {cell for cell, row in rows.items() if row["status"] == "done" or row["status"] == "n/a"} == set(records)
    assert all(row["status"] == "pending" for cell, row in rows.items() if cell not in records)

    collected = collect(grid)
    assert {f"{r['protocol']}__{r['defense']}__{r['attack']}" for r in collected} == set(records)
    assert len(json.loads((grid.out_dir / "matrix.json").read_text())) == len(records)
    main(["--grid", str(grid_file), "--status"])
    assert f"{len(records)} done" in capsys.readouterr().out.replace("n/a", "done")

    lines: list[str] = []
    again = run_grid(grid, "inline", echo=lines.append)
    assert sum(line.endswith("done before, skipped") for line in lines) == len(records)
    assert len(again) == 4 and all(r["status"] in ("ok", "n/a") for r in again)
    for record in again:  # the finished cell was not run again: its record (with its job's pid) is the same
        key = f"{record['protocol']}__{record['defense']}__{record['attack']}"
        if key in records:
            assert record == records[key]


# --------------------------------------------------------------------------------------------------------
# SLURM, up to the cluster


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """`sbatch` (keeps each script, answers with a job id), `srun`, `sacct` (every job PENDING) and
    `scancel` (logs its arguments) on PATH."""
    bin_dir, scripts = tmp_path / "bin", tmp_path / "sbatch_scripts"
    bin_dir.mkdir()
    scripts.mkdir()
    stubs = {
        "sbatch": f'n=$(ls {scripts} | wc -l); n=$((n + 1)); cp "$1" {scripts}/$n.sh; echo "Submitted batch job $n"',
        "srun": "exit 0",
        "sacct": 'ids=""; while [ $# -gt 0 ]; do [ "$1" = -j ] && ids="$ids $2"; shift; done\n'
                 'echo "JobID|State|NodeList"; for id in $(echo $ids | tr , " "); do echo "$id|${FAKE_SACCT_STATE:-PENDING}|None"; done',
        "scancel": f'echo "$@" >> {tmp_path}/scancel.log',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return scripts


def test_slurm_launcher_submits_one_sbatch_script_per_cell_with_its_resources(grid_file, fake_slurm, capsys):
    main(["--grid", str(grid_file), "--launcher", "slurm", "--resource", "partition=gpu", "--resource", "account=lab",
          "--resource", "timeout_min=30", "--resource", "mem_gb=16", "--resource", "learned.gpus=1",
          "--resource", "exact.cpus=8", "--resource", "sbatch={qos: high}"])
    out = capsys.readouterr().out
    assert "3 cells submitted (slurm)" in out  # the n/a cell is never submitted ... it is written at once below
    grid = load_grid(grid_file)
    scripts = {path.name: path.read_text() for path in fake_slurm.iterdir()}
    assert len(scripts) == 3
    by_cell = {}
    for text in scripts.values():
        name = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH --job-name="))
        by_cell[name] = text
    assert set(by_cell) == {"fedsgd__none__lti", "fedsgd__none__dager", "fedsgd__gauss__lti"}
    for name, text in by_cell.items():
        for line in ("#SBATCH --partition=gpu", "#SBATCH --account=lab", "#SBATCH --time=30", "#SBATCH --mem=16GB",
                     "#SBATCH --qos=high", f"#SBATCH --chdir={os.getcwd()}", "#SBATCH --nodes=1"):
            assert line in text.splitlines(), (name, line)
        job_folder = grid.out_dir / "cells" / name / "job"
        assert "-m submitit.core._submit" in text and str(job_folder) in text and "srun --unbuffered" in text
    assert "#SBATCH --gpus-per-node=1" in by_cell["fedsgd__none__lti"]
    assert "#SBATCH --gpus-per-node=1" not in by_cell["fedsgd__none__dager"]
    assert "#SBATCH --cpus-per-task=8" in by_cell["fedsgd__none__dager"]
    # What the job will run: this cell, from the directory the grid was launched from.
    import cloudpickle

    job_file = grid.out_dir / "cells" / "fedsgd__none__dager" / "job.json"
    job = json.loads(job_file.read_text())
    with open(next(Path(job["folder"]).glob(f"{job['job_id']}_submitted.pkl")), "rb") as handle:
        delayed = cloudpickle.load(handle)  # a file this test's own run just wrote
    assert delayed.function.__name__ == "execute_cell"
    assert [e.name for e in delayed.args[1]] == ["fedsgd", "none", "dager"] and delayed.args[2] == os.getcwd()
    assert delayed.args[3] == 8

    # --status: the submitted jobs are queued (sacct says PENDING), with their ids; the n/a cell is done.
    main(["--grid", str(grid_file), "--status"])
    status = capsys.readouterr().out
    assert "fedsgd__none__dager" in status and "queued" in status and "slurm job" in status
    rows = {row["cell"]: row for row in grid_status(grid)}
    assert rows["fedsgd__none__dager"]["status"] == "queued" and rows["fedsgd__none__dager"]["job_id"] == job["job_id"]
    assert rows["fedsgd__gauss__dager"]["status"] == "n/a"
    # --collect before any job finished: a table of the n/a cell only, and nothing was run here.
    main(["--grid", str(grid_file), "--collect"])
    assert "1 cell records" in capsys.readouterr().out


def test_slurm_ctrl_c_while_submitting_cancels_what_was_submitted(grid_file, fake_slurm, tmp_path, monkeypatch):
    grid = load_grid(grid_file)
    launcher = SlurmLauncher(grid)
    real_submit, count = launcher.submit, []

    def submit_then_interrupt(cell):
        count.append(cell)
        if len(count) == 3:
            raise KeyboardInterrupt
        return real_submit(cell)

    monkeypatch.setattr(launcher, "submit", submit_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_grid(grid, launcher, echo=lambda _: None)
    assert (tmp_path / "scancel.log").read_text().split() == ["1", "2"]


def test_slurm_launcher_off_a_cluster_is_a_one_line_error(grid_file, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    with pytest.raises(SystemExit) as stop:
        main(["--grid", str(grid_file), "--launcher", "slurm"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "srun" in err and len(err.strip().splitlines()) == 1
