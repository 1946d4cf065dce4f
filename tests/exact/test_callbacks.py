"""The DAGER callback in a one-batch `lti test` run: metrics next to LTI's, reconstructions in the samples."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lightning")

from lti.cli import main  # noqa: E402


def test_lti_test_with_dager_callback_writes_metrics_and_samples(make_config, tmp_path):
    config = make_config(**{
        # DAGER needs two attention layers; 8 tokens per update stay below d = 16.
        "data.target.init_args.num_layers": 2,
        "data.eval_samples": 4,
        "trainer.callbacks": [{"class_path": "exact.callbacks.DagerCallback",
                               "init_args": {"attack": {"class_path": "exact.Dager"}}}],
    })
    main(["test", "--config", str(config)])  # no checkpoint: an untrained inverter, DAGER alongside
    result = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    metrics = result["metrics"]
    for key in ("token_acc", "rouge1", "rouge2", "rougeL", "exact_fraction", "certified_fraction"):
        assert 0.0 <= metrics[f"test/dager/{key}"] <= 1.0, key
    assert metrics["test/dager/seconds_per_batch"] > 0
    assert "test/lti/token_acc" in metrics
    # transformer3, eval-equivalent client (dropout 0), 8 tokens < d: DAGER recovers everything.
    assert metrics["test/dager/token_acc"] == pytest.approx(1.0)
    assert metrics["test/dager/exact_fraction"] == pytest.approx(1.0)
    samples = [json.loads(line) for line in (tmp_path / "run" / "test_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for sample in samples:
        assert sample["dager"] == sample["reference"] and "lti" in sample and sample["dager_exact"]


def test_callback_rejects_bad_arguments():
    from exact.callbacks import DagerCallback

    with pytest.raises(ValueError):
        DagerCallback(every_n_batches=0)
    with pytest.raises(ValueError):
        DagerCallback(stages=("train",))
