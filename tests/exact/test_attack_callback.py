"""`AttackCallback` runs any list of `Attack`s in an `lti validate` run: DAGER behind the interface scores as the
DAGER callback does on the same updates, the batched attack whitens with the DataModule's auxiliary text."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("lightning")

from conftest import REPO  # noqa: E402

from exact.callbacks import AttackCallback  # noqa: E402
from exact.interface import DagerAttack  # noqa: E402
from lti.cli import main  # noqa: E402

TINY = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")


def test_the_attacks_run_in_an_evaluation_and_dager_scores_as_its_own_callback(tmp_path):
    overlay = {
        "trainer": {"default_root_dir": str(tmp_path / "run"), "callbacks": [
            {"class_path": "exact.callbacks.DagerCallback"},
            {"class_path": "exact.callbacks.AttackCallback", "init_args": {"attacks": [
                {"class_path": "exact.interface.DagerAttack",
                 "init_args": {"name": "dager_interface", "dager": {"class_path": "exact.Dager"}}},
                {"class_path": "exact.interface.BatchedAttack",
                 "init_args": {"options": {"beam": 2, "refine": 1, "label_candidates": 4}, "whitening_blocks": 64}},
            ], "max_updates_per_batch": 2}}]},
        "data": {"eval_samples": 4, "batch_size": 2,
                 "client": {"init_args": {"local": {"init_args": {"samples_per_update": 2}}}}},
    }
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    main(["validate", "--config", TINY, "--config", str(path)])
    metrics = json.loads((tmp_path / "run" / "val_metrics.json").read_text())["metrics"]
    for key in ("token_acc", "rouge1", "rouge2", "exact_fraction", "certified_fraction"):
        assert metrics[f"val/dager_interface/{key}"] == metrics[f"val/dager/{key}"], key
        assert 0.0 <= metrics[f"val/batched/{key}"] <= 1.0, key
    assert metrics["val/dager/token_acc"] > 0.5  # 2 x 8 tokens in a 64-wide model: DAGER reads most of them
    assert metrics["val/batched/seconds_per_batch"] > 0


def test_the_callback_refuses_no_attacks_and_twin_names():
    with pytest.raises(ValueError, match="at least one attack"):
        AttackCallback([])
    with pytest.raises(ValueError, match="names must differ"):
        AttackCallback([DagerAttack(), DagerAttack()])
