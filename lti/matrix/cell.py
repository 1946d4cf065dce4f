"""One cell: its `lti` commands run in the current process, and its record (ok, n/a or failed).

Every launcher ends here (lti.matrix.launchers.execute_cell), in whichever process it gives the cell.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from typing import Any

from lti.matrix.grid import METRICS, Entry, Grid, cell_commands, cell_fingerprint, cell_folder, not_applicable
from lti.matrix.records import one_line


def _find(tree: Any, key: str) -> Any:
    """First value stored under `key` anywhere in a nested dict (e.g. the DP defense's epsilon)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _run_lti(args: list[str]) -> None:
    from lti.trainer_cli import run  # the LightningCLI; imported per cell so `lti matrix --status` stays light

    argv, sys.argv = sys.argv, ["lti"]  # LightningCLI warns when it sees the grid's own arguments
    try:
        run(args)  # errors propagate with their message (`main` would print and exit)
    except SystemExit as error:
        # Lightning answers Ctrl-C by ignoring SIGINT from then on and calling sys.exit(1): for the grid
        # that is an interruption (not the cell's failure), and a second Ctrl-C must work again.
        if isinstance(error.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
    finally:
        sys.argv = argv
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)


def failure_reason(error: BaseException) -> str:
    """Why a cell failed, in one line: for the user's mistakes (a bad option or value, a missing file)
    what `lti fit` itself prints, e.g. "unknown option 'data.defense.sigmaa' (did you mean ...)";
    for anything else the error's type and message."""
    trainer_cli = sys.modules.get("lti.trainer_cli")  # not imported anew: its own import may be what failed
    if trainer_cli is not None and isinstance(error, trainer_cli.USER_ERRORS):
        return one_line(trainer_cli.user_message(error))
    return one_line(f"{type(error).__name__}: {error}")


def _base_record(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> dict[str, Any]:
    return {"protocol": protocol.name, "defense": defense.name, "attack": attack.name, "kind": attack.kind,
            "noise": defense.noise, "fingerprint": cell_fingerprint(grid, protocol, defense, attack)}


def failed_record(grid: Grid, cell: tuple[Entry, Entry, Entry], reason: str, seconds: float | None = None) -> dict:
    """The record of a cell that failed (retried by the next run of the grid); `reason` is kept on one line."""
    return {**_base_record(grid, *cell), "status": "failed", "reason": one_line(reason), "seconds": seconds}


def run_cell(grid: Grid, protocol: Entry, defense: Entry, attack: Entry) -> dict:
    """Runs one cell's `lti` commands in this process and returns its record; a failing cell gives a
    "failed" record. Launchers decide which process that is (lti.matrix.launchers.execute_cell)."""
    folder = cell_folder(grid, protocol, defense, attack)
    folder.mkdir(parents=True, exist_ok=True)
    record = _base_record(grid, protocol, defense, attack)
    reason = not_applicable(protocol, defense, attack)
    if reason:
        return {**record, "status": "n/a", "reason": reason}
    commands = cell_commands(grid, protocol, defense, attack)
    record["commands"] = [["lti", *c] for c in commands]
    if attack.kind != "exact":
        # A cell runs when it has no finished record (first run, retry, changed arguments): checkpoints
        # in its folder are a stopped or stale attempt's, which `lti fit` would refuse to write over.
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
    start = time.perf_counter()
    try:
        for args in commands:
            _run_lti(args)
        result = json.loads((folder / "run" / "test_metrics.json").read_text())
    except (Exception, SystemExit) as error:  # noqa: BLE001 - one failed cell must not stop the grid
        if type(error).__name__ == "SIGTERMException":
            raise  # the grid was stopped (Lightning turns SIGTERM into this): not the cell's failure
        return failed_record(grid, (protocol, defense, attack), failure_reason(error), time.perf_counter() - start)
    metrics = result["metrics"]
    prefix = attack.metrics_prefix.rstrip("/")
    values = {m: metrics.get(f"{prefix}/{m}") for m in (*METRICS, *attack.extra_metrics)}
    values["baseline_token_acc"] = metrics.get("test/baseline/token_acc")
    return {**record, "status": "ok", "metrics": values, "epsilon": _find(result.get("setting"), "epsilon"),
            "num_updates": result.get("num_updates"), "seconds": time.perf_counter() - start}
