"""DDP on CPU (gloo), run as a real `lti` subprocess: `strategy=ddp` inside pytest would re-run pytest
in the child rank (docs/design.md §8)."""

import json
import os
import subprocess
import sys

import pytest


def _lti(*args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "lti.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_ddp_fit_then_validate_equals_single_process(make_config, tmp_path):
    eval_client = {"class_path": "datamodules.federated.FedSGDClient", "init_args": {"mode": "eval"}}
    config = make_config(**{"data.client": eval_client, "trainer.max_steps": 2, "trainer.limit_val_batches": 0})
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2"]
    _lti("fit", "--config", str(config), *ddp, cwd=tmp_path)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.exists()

    results = {}
    for name, extra in (("single", []), ("ddp", ddp)):
        root = tmp_path / name
        _lti("validate", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(root), "--trainer.limit_val_batches", "1.0", *extra, cwd=tmp_path)
        results[name] = json.loads((root / "val_metrics.json").read_text())
    # Deterministic updates (eval mode, no noise) and 8 = 2 ranks x 4: the reduced metrics must agree exactly.
    assert results["ddp"]["num_updates"] == results["single"]["num_updates"] == 8
    for key, value in results["single"]["metrics"].items():
        assert results["ddp"]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
