"""A run stopped at step n and resumed from its checkpoint to 2n ends where an uninterrupted 2n-step
run ends: same data stream, same pseudo-data, noise and negative draws (datamodules.training_stream)."""

import csv

import pytest
import torch
from conftest import tiny_config

from lti.cli import main

N = 3  # steps before the interruption; 16 auxiliary blocks = 4 batches per epoch, so 2N crosses an epoch


def _fit(tmp_path, corpus_files, name, steps, ckpt=None, **overrides):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    config = tiny_config(folder, corpus_files, **{
        "trainer.max_steps": steps, "trainer.val_check_interval": N, "trainer.check_val_every_n_epoch": None,
        "checkpoint.every_n_train_steps": N, "curve.path": str(folder / "curve.csv"), "data.train_samples": 16,
        "data.pseudo_batches_per_epoch": 4, **overrides,
    })
    main(["fit", "--config", str(config)] + (["--ckpt_path", str(ckpt)] if ckpt else []))
    return folder


def _weights(folder):
    return torch.load(folder / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]


SETTINGS = {
    "auxiliary data": {},
    "pseudo-data": {"data.training_data": "pseudo"},
    "gaussian noise + sampled softmax": {
        "data.defense": {"class_path": "datamodules.federated.GaussianNoise", "init_args": {"sigma": 0.01}},
        "model.negatives": 50,
    },
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path, corpus_files, setting):
    overrides = SETTINGS[setting]
    whole = _fit(tmp_path, corpus_files, "whole", 2 * N, **overrides)
    half = _fit(tmp_path, corpus_files, "half", N, **overrides)
    saved = torch.load(half / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    (carried,) = [state["elapsed"] for key, state in saved.items() if key.startswith("LearningCurve")]
    resumed = _fit(tmp_path, corpus_files, "half", 2 * N, ckpt=half / "ckpt" / "last.ckpt", **overrides)
    a, b = _weights(whole), _weights(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise
    # The learning curve goes on in the same file: one row per validation, steps N and 2N.
    rows = list(csv.DictReader((resumed / "curve.csv").open()))
    assert [int(r["step"]) for r in rows] == [N, 2 * N]
    whole_rows = list(csv.DictReader((whole / "curve.csv").open()))
    assert float(rows[-1]["val/lti/token_acc"]) == pytest.approx(float(whole_rows[-1]["val/lti/token_acc"]))
    # The clock goes on from the checkpoint's elapsed time (not from zero).
    assert carried > 0 and float(rows[-1]["wall_minutes"]) * 60 > carried - 0.06


def test_a_resume_that_restarts_the_data_stream_is_caught(tmp_path, corpus_files, monkeypatch):
    # The check above can fail: resuming with the stream restarted at step 0 (what a loader without
    # step-indexed batches does) ends elsewhere.
    from datamodules.inversion_data import InversionDataModule

    whole = _fit(tmp_path, corpus_files, "whole", 2 * N)
    half = _fit(tmp_path, corpus_files, "half", N)
    monkeypatch.setattr(InversionDataModule, "training_position", lambda self: 0)
    resumed = _fit(tmp_path, corpus_files, "half", 2 * N, ckpt=half / "ckpt" / "last.ckpt")
    a, b = _weights(whole), _weights(resumed)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_is_refused_in_one_line(tmp_path, corpus_files, capsys):
    with pytest.raises(SystemExit):
        _fit(tmp_path, corpus_files, "acc", 2, **{"trainer.accumulate_grad_batches": 2})
    assert "accumulate_grad_batches must be 1" in capsys.readouterr().err


def test_curve_rows_after_the_resumed_step_are_dropped(tmp_path, corpus_files):
    folder = _fit(tmp_path, corpus_files, "run", 2 * N, **{"checkpoint.save_top_k": -1})
    assert [int(r["step"]) for r in csv.DictReader((folder / "curve.csv").open())] == [N, 2 * N]
    # Resume from the step-N checkpoint and stop before the next interval's validation: the interrupted
    # run's row for 2N (written after that checkpoint) is gone, the row for N stays, and the run's last
    # step adds its own (lti.final_validation).
    _fit(tmp_path, corpus_files, "run", N + 1, ckpt=folder / "ckpt" / f"step{N}.ckpt", **{"checkpoint.save_top_k": -1})
    rows = list(csv.DictReader((folder / "curve.csv").open()))
    assert [int(r["step"]) for r in rows] == [N, N + 1]
