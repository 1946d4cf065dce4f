"""Where a grid's cells run: `--launcher inline` (this process), `local` (one process per cell through
submitit's local executor) or `slurm` (one SLURM job per cell through submitit).

A cell runs the same way under every launcher: `execute_cell` runs its `lti` commands in one Python
process and writes the cell's record itself, so a SLURM job that finishes overnight leaves its
result in the grid folder with nobody waiting for it (`lti matrix --collect` then builds the tables).
A job launched by `local` or `slurm` keeps its stdout/stderr, submission script and state under the
cell's folder (`job/`), and the job's id in `job.json`, from which `--status` tells a running cell
from a pending or failed one.

Resources per cell come from the grid file's `resources:` block (keys below; a `learned:` or `exact:`
sub-block overrides them for that kind of attack) and then from `--resource [KIND.]KEY=VALUE` on the
command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# At import, not per call: submitit binds its log handlers to the sys.stdout/stderr of the moment it is
# first imported, which must not be a stream that is later closed (a test's captured output).
import submitit

from lti.matrix.cell import failed_record, run_cell
from lti.matrix.grid import Entry, Grid, cell_folder, cell_id
from lti.matrix.records import _finished, _save_record
from lti.matrix.resources import cell_resources

Cell = tuple[Entry, Entry, Entry]

_SLURM_DEFAULT_TIMEOUT_MIN = 24 * 60
_LOCAL_TIMEOUT_MIN = 365 * 24 * 60  # submitit's local executor kills a job after 2 min unless told otherwise

# --------------------------------------------------------------------------------------------------------
# One cell, in whatever process runs it


def execute_cell(grid: Grid, cell: Cell, workdir: str | None = None, threads: int | None = None,
                 job: dict | None = None) -> dict:
    """Runs one cell's `lti` commands in this process and saves its record; returns the record.

    This is the function a launcher's job runs. `workdir` is the directory the grid was launched
    from (configs are paths relative to it); `threads` caps torch's CPU threads for the cell.
    """
    if workdir is not None:
        os.chdir(workdir)
    started, previous = time.time(), None
    if threads is not None:
        if "torch" not in sys.modules:  # a job's fresh process: BLAS/OpenMP pools start at this size too
            os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
    try:
        record = run_cell(grid, *cell)
    finally:
        if previous is not None:
            import torch

            torch.set_num_threads(previous)
    if job is not None:
        try:  # the engine's id of this job (a local job: its controller's process id)
            job_id = str(submitit.JobEnvironment().job_id)
        except RuntimeError:  # not inside a submitit job (a direct call)
            job_id = None
        record["job"] = {**job, "id": job_id, "host": socket.gethostname(), "pid": os.getpid(),
                         "started": started, "ended": time.time()}
    _save_record(grid, cell, record)
    return record


# --------------------------------------------------------------------------------------------------------
# Job files: which job runs a cell


def _job_file(grid: Grid, cell: Cell) -> Path:
    return cell_folder(grid, *cell) / "job.json"


def write_job_file(grid: Grid, cell: Cell, launcher: str, job_id: str) -> None:
    path = _job_file(grid, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"job.json.{os.getpid()}.partial")
    partial.write_text(json.dumps({"launcher": launcher, "job_id": job_id, "folder": str(path.parent / "job"),
                                   "submitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n")
    os.replace(partial, path)


def read_job_file(grid: Grid, cell: Cell) -> dict | None:
    path = _job_file(grid, cell)
    return json.loads(path.read_text()) if path.is_file() else None


def _controller_alive(pid: int) -> bool:
    """Whether `pid` is still a submitit local controller (a reused process id is not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # no such process (or no /proc: fall back to asking the kernel)
        if not Path("/proc").is_dir():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    return b"submitit.local._local" in cmdline


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc), deepest last."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_children(kid)]
    return found


def job_states(jobs: list[dict]) -> list[str]:
    """The engine's word for each cell's job (job.json): RUNNING, PENDING, FAILED, ... or UNKNOWN
    (SLURM's states, read with one `sacct` call); a local job is RUNNING or ENDED."""
    states = []
    slurm = {}
    for job in jobs:
        if job["launcher"] == "local":
            # A local job's id is its controller's process id; the process is this machine's to ask.
            states.append("RUNNING" if _controller_alive(int(job["job_id"])) else "ENDED")
        else:
            states.append(None)
            slurm[job["job_id"]] = job
    if slurm:
        try:
            handles = [submitit.SlurmJob(job["folder"], job_id) for job_id, job in slurm.items()]  # registers them
            handles[0].watcher.update()  # one sacct call for all of them
            # sacct may say "CANCELLED by 1234": the first word is the state
            found = {h.job_id: (h.watcher.get_state(h.job_id, mode="cache").split() or ["UNKNOWN"])[0] for h in handles}
        except Exception:  # noqa: BLE001 - a status query must never fail the listing
            found = {}
        states = [found.get(job["job_id"], "UNKNOWN") if state is None else state for job, state in zip(jobs, states)]
    return states


# --------------------------------------------------------------------------------------------------------
# Launchers


class Launcher(ABC):
    """Runs cells; each finished cell's record is saved (by the cell's own process) before `launch`
    reports it through `on_record`."""

    name: str
    waits = True  # False: `launch` returns once the cells are submitted (the engine runs them later)

    def __init__(self, grid: Grid, max_parallel: int = 1, resources: dict[str, dict[str, Any]] | None = None):
        if max_parallel < 1:
            raise ValueError(f"max_parallel={max_parallel} must be at least 1")
        self.grid, self.max_parallel, self.flags = grid, max_parallel, resources or {}

    def resources(self, cell: Cell) -> dict[str, Any]:
        return cell_resources(self.grid.resources, cell[2].kind, self.flags)

    @abstractmethod
    def launch(self, cells: list[Cell], on_start: Callable[[Cell], None], on_record: Callable[[Cell, dict], None]) -> None:
        ...


class InlineLauncher(Launcher):
    """Cells one after another in this process: no interpreter or import start-up per cell (the
    quickstart-sized grids), but one cell's crash or leak is the grid's."""

    name = "inline"

    def __init__(self, grid: Grid, max_parallel: int = 1, resources: dict[str, dict[str, Any]] | None = None):
        if max_parallel != 1:
            raise ValueError("cells in this process run one at a time; use --launcher local for max_parallel > 1")
        super().__init__(grid, max_parallel, resources)

    def launch(self, cells, on_start, on_record):
        for cell in cells:
            on_start(cell)
            on_record(cell, execute_cell(self.grid, cell, threads=self.resources(cell).get("cpus")))


class SubmititLauncher(Launcher):
    """Cells as submitit jobs: one executor (and job folder) per cell, so logs stay with the cell."""

    def executor(self, cell: Cell):
        folder = cell_folder(self.grid, *cell) / "job"
        try:
            executor = self.make_executor(folder)
        except RuntimeError as error:  # e.g. no `srun` on PATH: not on a SLURM cluster
            raise ValueError(f"--launcher {self.name}: {error}") from None
        executor.update_parameters(**self.parameters(cell))
        return executor

    @staticmethod
    @abstractmethod
    def make_executor(folder: Path):
        ...

    @abstractmethod
    def parameters(self, cell: Cell) -> dict[str, Any]:
        ...

    def threads(self, cell: Cell) -> int | None:
        return self.resources(cell).get("cpus")

    def submit(self, cell: Cell):
        job = self.executor(cell).submit(execute_cell, self.grid, cell, os.getcwd(), self.threads(cell),
                                         {"launcher": self.name})
        write_job_file(self.grid, cell, self.name, str(job.job_id))
        return job


class LocalLauncher(SubmititLauncher):
    """Each cell in its own process on this machine (submitit's local executor), `max_parallel` at a
    time, each with its share of the CPU cores unless `cpus` says otherwise. Waits for them all;
    Ctrl-C cancels the running cells (cells not started stay pending for the next run)."""

    name = "local"

    @staticmethod
    def make_executor(folder: Path):
        return submitit.LocalExecutor(folder=folder)  # its own parameter names (visible_gpus), not AutoExecutor's

    def threads(self, cell: Cell) -> int:
        return self.resources(cell).get("cpus") or max(1, (os.cpu_count() or 1) // self.max_parallel)

    def parameters(self, cell: Cell) -> dict[str, Any]:
        resources = self.resources(cell)
        visible = _visible_gpus()
        gpus = resources.get("gpus", len(visible))  # by default a cell sees every GPU this process sees
        # No `setup` lines: they would put a shell between submitit's signals (Ctrl-C) and the cell.
        return {"timeout_min": resources.get("timeout_min", _LOCAL_TIMEOUT_MIN), "gpus_per_node": gpus,
                "visible_gpus": visible}

    def submit(self, cell: Cell):
        # Ctrl-C in a terminal reaches every process of its foreground group, submitit's job controller
        # too, which then prints a traceback of its own: its stderr goes to the cell's job folder.
        folder = cell_folder(self.grid, *cell) / "job"
        folder.mkdir(parents=True, exist_ok=True)
        with _stderr_of_started_processes(folder / "controller.err"):
            return super().submit(cell)

    def launch(self, cells, on_start, on_record):
        waiting, running = list(cells), []
        try:
            while waiting or running:
                while waiting and len(running) < self.max_parallel:
                    cell = waiting.pop(0)
                    on_start(cell)
                    running.append((cell, self.submit(cell)))
                time.sleep(0.2)
                for cell, job in [r for r in running if r[1].done()]:
                    running.remove((cell, job))
                    on_record(cell, self._outcome(cell, job))
        except BaseException:
            for _, job in running:  # Ctrl-C (or any error here): stop what this run started
                job.cancel()
            for _, job in running:
                _wait_ended(job)
            raise

    def _outcome(self, cell: Cell, job) -> dict:
        """The cell's record once its job ended: the one its process saved, or a "failed" one when the
        process died before saving any (killed, out of memory) or raised."""
        saved = _finished(self.grid, *cell, failed_too=True)
        if saved is not None and (saved.get("job") or {}).get("id") == str(job.job_id):
            return saved  # this job's own record (even if its process died before writing its result file)
        try:
            return job.result()
        except Exception as error:  # noqa: BLE001 - the job died without a record, or raised
            lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.strip().startswith("- ")]
            tail = next((line for line in reversed(lines) if "Error" in line or "Exception" in line),
                        lines[-1] if lines else type(error).__name__)
            record = failed_record(self.grid, cell, f"job {job.job_id}: {tail}")
            _save_record(self.grid, cell, record)
            return record


@contextlib.contextmanager
def _stderr_of_started_processes(path: Path) -> Iterator[None]:
    """Processes started inside this block write their stderr to `path` (this process's own stderr is
    redirected meanwhile, and restored after)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as target:
            os.dup2(target.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _visible_gpus() -> tuple[int, ...]:
    """The GPU indices this process may use (CUDA_VISIBLE_DEVICES), so that a local cell asking for N
    GPUs gets N of these and not physical devices 0..N-1."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        try:
            return tuple(int(i) for i in mask.split(",") if i.strip())
        except ValueError:  # GPU UUIDs: submitit takes indices only; let every cell see them all
            return ()
    import torch

    return tuple(range(torch.cuda.device_count()))


def _wait_ended(job, seconds: float = 30.0) -> None:
    """Waits for a cancelled local job; one that does not end in time is killed with its cell's processes
    (the controller's children, which a killed controller would leave running)."""
    deadline = time.monotonic() + seconds
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not job.done():
        for pid in reversed(_children(int(job.job_id))):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if getattr(job, "_process", None) is not None:
            job._process.send_signal(signal.SIGKILL)
            job._process.wait()


class SlurmLauncher(SubmititLauncher):
    """Each cell a SLURM job (sbatch through submitit); returns once all are submitted. The jobs write
    their records when they finish: `lti matrix --status` follows them, `--collect` builds the tables.
    Ctrl-C while submitting cancels (scancel) the jobs this run submitted."""

    name, waits = "slurm", False

    @staticmethod
    def make_executor(folder: Path):
        return submitit.AutoExecutor(folder=folder, cluster="slurm")  # generic names + slurm_* ones

    def __init__(self, grid: Grid, max_parallel: int = 1, resources: dict[str, dict[str, Any]] | None = None):
        if max_parallel != 1:
            raise ValueError("--max_parallel is for --launcher local; SLURM runs the submitted cells as the queue allows")
        if shutil.which("srun") is None:  # what submitit looks for, checked before any cell is touched
            raise ValueError("--launcher slurm: no `srun` on PATH; run it on a SLURM login node")
        super().__init__(grid, max_parallel, resources)

    def parameters(self, cell: Cell) -> dict[str, Any]:
        resources = self.resources(cell)
        parameters: dict[str, Any] = {
            "name": cell_id(*cell), "timeout_min": resources.get("timeout_min", _SLURM_DEFAULT_TIMEOUT_MIN),
            "nodes": 1, "tasks_per_node": 1,
            # The job starts where the grid was launched: configs are relative paths.
            "slurm_additional_parameters": {"chdir": os.getcwd(), **resources.get("sbatch", {})},
        }
        optional = {"cpus_per_task": "cpus", "gpus_per_node": "gpus", "mem_gb": "mem_gb",
                    "slurm_partition": "partition", "slurm_account": "account", "slurm_setup": "setup"}
        parameters.update({name: resources[key] for name, key in optional.items() if key in resources})
        if "cpus" in resources:  # BLAS/OpenMP pools keep to the job's cores
            threads = resources["cpus"]
            parameters["slurm_setup"] = [f"export OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads}",
                                         *resources.get("setup", [])]
        return parameters

    def launch(self, cells, on_start, on_record):
        submitted = []
        try:
            for cell in cells:
                on_start(cell)
                submitted.append(self.submit(cell))
        except BaseException:
            for job in submitted:
                job.cancel(check=False)
            raise


#: `--launcher NAME` -> its class.
LAUNCHERS: dict[str, type[Launcher]] = {launcher.name: launcher for launcher in (InlineLauncher, LocalLauncher, SlurmLauncher)}


def make_launcher(name: str, grid: Grid, max_parallel: int = 1,
                  resources: dict[str, dict[str, Any]] | None = None) -> Launcher:
    if name not in LAUNCHERS:
        raise ValueError(f"unknown launcher {name!r}; use one of {list(LAUNCHERS)}")
    return LAUNCHERS[name](grid, max_parallel, resources)
