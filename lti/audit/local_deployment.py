"""Run a Flower app on Flower's Deployment Engine on this machine: a SuperLink and SuperNodes started on loopback
(insecure), the app submitted with `flwr run`, its status polled until it finishes, everything stopped.

For trying an audited app end to end before deploying it, and for the tests. Every file Flower writes (its
FLWR_HOME, the logs, the installed copy of the app) stays in `workdir`; nothing is written to ~/.flwr.

    result = run_local_deployment("examples/flower_app", {"report-dir": "/abs/report"},
                                  nodes=[{"partition-id": i, "num-partitions": 2} for i in range(2)],
                                  timeout=600, workdir="runs/deployment")
    assert result.ok, result.logs

Across machines, the same three commands run where they belong (`flower-superlink` on the server,
`flower-supernode --superlink HOST:PORT` on each client machine, `flwr run APP CONNECTION` from anywhere that
reaches the SuperLink), with TLS instead of `--insecure`: see examples/flower_app/README.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

#: The SuperLink connection's name in the `flwr` CLI's config.toml.
CONNECTION = "local-audit"
#: An environment variable every started process inherits, so the last clean-up finds exactly them.
_MARK = "LTI_LOCAL_DEPLOYMENT"


@dataclass
class DeploymentResult:
    run_id: int | None
    #: "finished:completed", "finished:failed", "finished:stopped" or "timeout"
    status: str
    #: The run as `flwr ls` reports it.
    run_info: dict[str, Any]
    #: The ServerApp's log (`flwr log RUN --show`).
    logs: str
    #: Seconds per step: superlink, supernodes, submit, run, shutdown, total.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def _command(name: str) -> str:
    """A console script of this interpreter's environment (else from PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait(ready, timeout: float, what: str, processes: list[tuple[subprocess.Popen, Path]]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            return
        for process, log in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{what}: {Path(process.args[0]).name} exited with {process.returncode}\n{_tail(log)}")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")


def _marked_processes(mark: str) -> list[int]:
    """Live processes carrying this run's mark (Flower starts its ServerApp in a session of its own)."""
    needle, found = f"{_MARK}={mark}".encode(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _stop(processes: list[subprocess.Popen], mark: str, grace: float = 10.0) -> None:
    for process in reversed(processes):  # SuperNodes first, then the SuperLink
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    end = time.monotonic() + 3.0
    while (left := _marked_processes(mark)) and time.monotonic() < end:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _flwr(args: list[str], env: dict, timeout: float = 120.0) -> dict:
    done = subprocess.run([_command("flwr"), *args, "--format", "json"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = done.stdout
    try:
        return json.loads(out[out.index("{"):])
    except ValueError:
        raise RuntimeError(f"flwr {args[0]} answered (exit {done.returncode}): {out.strip() or done.stderr.strip()}") from None


def run_local_deployment(app_dir: str | os.PathLike, run_config: dict[str, Any], nodes: list[dict[str, Any]],
                         timeout: float, workdir: str | os.PathLike, env: dict[str, str] | None = None,
                         startup_timeout: float = 120.0) -> DeploymentResult:
    """Run the Flower app in `app_dir` on a SuperLink and `len(nodes)` SuperNodes started here.

    Args:
        app_dir: The app's folder (its pyproject.toml has `[tool.flwr.app]`).
        run_config: Values for keys of the app's `[tool.flwr.app.config]`.
        nodes: Each SuperNode's node config, e.g. {"partition-id": 0, "num-partitions": 2}.
        timeout: Seconds the run may take once submitted; then it is stopped and the status is "timeout".
        workdir: Where Flower's files and the logs go.
        env: Variables added to every process's environment.
    """
    began = time.monotonic()
    app_dir, workdir = Path(app_dir).resolve(), Path(workdir).resolve()
    if not (app_dir / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{app_dir} has no pyproject.toml: not a Flower app")
    if not nodes:
        raise ValueError("a deployment needs at least one SuperNode")
    workdir.mkdir(parents=True, exist_ok=True)
    mark, seconds = uuid.uuid4().hex, {}
    # No telemetry, no update check (offline machines), the runtime does not install the app's dependencies.
    base = {**os.environ, **(env or {}), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1", _MARK: mark}

    def env_of(name: str) -> dict:
        home = workdir / "flwr_home" / name  # one FLWR_HOME each: no process reads another's half-copied app
        home.mkdir(parents=True, exist_ok=True)
        return {**base, "FLWR_HOME": str(home)}

    link_port, *node_ports = _free_ports(1 + len(nodes))
    cli = env_of("cli")
    (Path(cli["FLWR_HOME"]) / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": CONNECTION, CONNECTION: {"address": f"127.0.0.1:{link_port}", "insecure": True}}}))
    config_file = workdir / "run_config.toml"
    config_file.write_text(tomli_w.dumps(run_config))

    processes: list[subprocess.Popen] = []
    with ExitStack() as stack:
        stack.callback(_stop, processes, mark)

        def start(command: list[str], name: str) -> tuple[subprocess.Popen, Path]:
            log = workdir / f"{name}.log"
            out = stack.enter_context(open(log, "wb"))
            process = subprocess.Popen(command, env=env_of(name), cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
            processes.append(process)
            return process, log

        clock = time.monotonic()
        link = start([_command("flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
                      "--disable-runtime-dependency-installation"], "superlink")
        _wait(lambda: _listening(link_port), startup_timeout, "the SuperLink", [link])
        seconds["superlink"] = time.monotonic() - clock

        clock = time.monotonic()
        started = []
        for index, (node_config, port) in enumerate(zip(nodes, node_ports)):
            node_file = workdir / f"node{index}.toml"
            node_file.write_text(tomli_w.dumps(node_config))
            started.append(start([_command("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                                  "--host", "127.0.0.1", "--port", str(port), "--node-config", str(node_file)],
                                 f"node{index}"))
        _wait(lambda: link[1].read_text(errors="replace").count("Activated node_id=") >= len(nodes), startup_timeout,
              "the SuperNodes", [link, *started])
        seconds["supernodes"] = time.monotonic() - clock

        clock = time.monotonic()
        submitted = _flwr(["run", str(app_dir), CONNECTION, "--run-config", str(config_file)], cli)
        if not submitted.get("success"):
            raise RuntimeError(f"flwr run refused the app: {submitted}")
        run_id = int(submitted["run-id"])
        seconds["submit"] = time.monotonic() - clock

        clock, status, info = time.monotonic(), "pending", {}
        while True:
            runs = _flwr(["ls", CONNECTION, "--run-id", str(run_id)], cli).get("runs") or []
            if runs:
                info, status = runs[0], runs[0]["status"]
            if status.startswith("finished"):
                break
            if time.monotonic() - clock > timeout:
                _flwr(["stop", str(run_id), CONNECTION], cli)
                status = "timeout"
                break
            if link[0].poll() is not None:
                raise RuntimeError(f"the SuperLink stopped during the run\n{_tail(link[1])}")
            time.sleep(1.0)
        seconds["run"] = time.monotonic() - clock
        logs = subprocess.run([_command("flwr"), "log", str(run_id), CONNECTION, "--show"], env=cli,
                              capture_output=True, text=True, timeout=120).stdout
        (workdir / "run.log").write_text(logs)
        clock = time.monotonic()
    seconds["shutdown"] = time.monotonic() - clock
    seconds["total"] = time.monotonic() - began
    return DeploymentResult(run_id, status, info, logs, seconds)


def main(app: str, nodes: int = 2, run_config: dict[str, Any] | None = None, timeout: float = 1800.0,
         workdir: str = "runs/local_deployment") -> None:
    """Run a Flower app on a local Deployment Engine (a SuperLink and SuperNodes on loopback, `flwr run`).

    Args:
        app: The app's folder (its pyproject.toml has `[tool.flwr.app]`), e.g. examples/flower_app.
        nodes: SuperNodes to start; node i gets the node config partition-id = i, num-partitions = nodes.
        run_config: Values for the app's `[tool.flwr.app.config]` keys, e.g. `{report-dir: /abs/path}`.
        timeout: Seconds the run may take once submitted.
        workdir: Where Flower's files and the logs go.
    """
    if nodes < 1:
        raise SystemExit(f"error: nodes={nodes} must be >= 1")
    result = run_local_deployment(app, dict(run_config or {}),
                                  [{"partition-id": i, "num-partitions": nodes} for i in range(nodes)], timeout, workdir)
    print(result.logs)
    print(f"run {result.run_id}: {result.status} in {result.seconds['total']:.0f} s (logs in {workdir})")
    if not result.ok:
        raise SystemExit(f"error: the run ended {result.status}: {result.run_info.get('status-details', '')}")


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
