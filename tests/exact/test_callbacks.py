"""The DAGER callback in a one-batch `lti test` run: metrics next to LTI's, reconstructions in the samples."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lightning")

from datamodules.attack_data import AttackData
from datamodules.federated.hashing import Hashing
from lti.cli import main  # noqa: E402


def data_side(pipeline, **fields):
    """A DataModule's `AttackData` around a pipeline, without data (text sizes given by the test)."""
    from types import SimpleNamespace

    defaults = dict(pipeline=pipeline, seed=0, samples_per_update=pipeline.client.samples_per_update, seq_len=None,
                    tokenizer=None, table_columns=[], describe=dict, auxiliary_inputs=lambda limit: None,
                    destandardize=lambda rows: rows)
    data = SimpleNamespace(**{**defaults, **fields})
    assert isinstance(data, AttackData)
    return data


def test_lti_test_with_dager_callback_writes_metrics_and_samples(make_config, tmp_path):
    config = make_config(**{
        # DAGER needs two attention layers; 8 tokens per update stay below d = 16.
        "data.target.init_args.num_layers": 2,
        "data.eval_samples": 4,
        "trainer.callbacks": [{"class_path": "exact.callbacks.DagerCallback",
                               "init_args": {"attack": {"class_path": "exact.Dager"}}}],
    })
    main(["test", "--config", str(config)])  # no checkpoint, so no trained inverter: DAGER alone (lti.exact_only)
    result = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    metrics = result["metrics"]
    for key in ("token_acc", "rouge1", "rouge2", "rougeL", "exact_fraction", "certified_fraction"):
        assert 0.0 <= metrics[f"test/dager/{key}"] <= 1.0, key
    assert metrics["test/dager/seconds_per_batch"] > 0
    assert not any(key.startswith("test/lti/") for key in metrics)
    # transformer3, eval-equivalent client (dropout 0), 8 tokens < d: DAGER recovers everything.
    assert metrics["test/dager/token_acc"] == pytest.approx(1.0)
    assert metrics["test/dager/exact_fraction"] == pytest.approx(1.0)
    samples = [json.loads(line) for line in (tmp_path / "run" / "test_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for sample in samples:
        assert sample["dager"] == sample["reference"] and "lti" not in sample and sample["dager_exact"]
    assert "notes" not in result  # nothing stood in the way: nothing to say


def test_dager_says_once_when_exactness_is_impossible_and_records_it(make_config, tmp_path, capsys):
    config = make_config(**{
        # Two sequences of 8 tokens per update = 16 tokens on a 16-wide model: full rank.
        "data.target.init_args.num_layers": 2, "data.eval_samples": 8,
        "data.client": {"class_path": "datamodules.federated.FedSGDClient", "init_args": {"samples_per_update": 2}},
        "data.defense": {"class_path": "datamodules.federated.Sign"},
        "trainer.callbacks": [{"class_path": "exact.callbacks.DagerCallback", "init_args": {"attack": {"class_path": "exact.Dager"}}}],
    })
    main(["test", "--config", str(config)])
    out = capsys.readouterr().out
    width_note = "lti: note: DAGER: the first layer's gradient has full rank (16 of width 16, read from the update)"
    assert out.count(width_note) == 1
    assert out.count("lti: note: DAGER: the defense sign signs every coordinate") == 1
    notes = json.loads((tmp_path / "run" / "test_metrics.json").read_text())["notes"]
    assert len(notes) == 2 and notes[0].startswith("DAGER: the first layer's gradient has full rank")


def test_feasibility_notes_name_each_reason():
    from exact.dager.feasibility import feasibility_notes

    assert feasibility_notes(16, {"name": "none"}, rank1=15, rank2=12) == []
    (full,) = feasibility_notes(16, None, rank1=16, rank2=16)
    assert "first layer's gradient has full rank (16 of width 16" in full
    # The first layer below the width, the second (tokens in context) within min_codimension of it.
    (second,) = feasibility_notes(768, None, rank1=522, rank2=767)
    assert "second-layer gradient has rank 767 of width 768" in second and "best effort" in second
    assert feasibility_notes(768, None, rank1=522, rank2=764) == []  # 4 dimensions to spare: the test can work
    # A bidirectional model whose first layer passes far more tokens per position than the batch holds.
    (blind,) = feasibility_notes(384, None, 135, 191, candidates_per_position=[1] + [95] * 30, batch_size=8,
                                 bidirectional=True)
    assert "passes 95 tokens at a typical position for a batch of 8" in blind and "best effort" in blind
    assert feasibility_notes(384, None, 135, 191, candidates_per_position=[1] + [95] * 30, batch_size=8) == []  # causal
    assert feasibility_notes(384, None, 30, 40, candidates_per_position=[1] + [9] * 30, batch_size=8,
                             bidirectional=True) == []
    composed = {"name": "compose", "defenses": [{"name": "prune", "fraction_removed": 0.9}, {"name": "gaussian", "sigma": 0.1}]}
    notes = feasibility_notes(16, composed)
    assert len(notes) == 2 and "prune" in notes[0] and "gaussian" in notes[1]


def test_callback_rejects_bad_arguments():
    from exact.callbacks import DagerCallback

    with pytest.raises(ValueError):
        DagerCallback(every_n_batches=0)
    with pytest.raises(ValueError):
        DagerCallback(stages=("train",))


def test_fedavg_updates_are_attacked_as_pseudo_gradients_with_looser_thresholds():
    """FedAvg E=2 over 4 sequences in minibatches of 2 (4 local steps, eval mode): DAGER runs on
    delta / (steps * lr) with thresholds raised to `multi_step_threshold` and recovers every sequence."""
    from types import SimpleNamespace

    import torch

    from datamodules.federated import FedAvgClient, UpdatePipeline
    from datamodules.targets import Transformer3
    from exact.callbacks import DagerCallback
    from exact.dager import Dager

    torch.manual_seed(0)
    client = FedAvgClient(mode="eval", samples_per_update=4, local_epochs=2, minibatch_size=2, lr=0.01)
    assert client.local_steps() == 4 and client.gradient_scale() == pytest.approx(1 / (4 * 0.01))
    pipeline = UpdatePipeline(Transformer3(), client=client, hashing=Hashing(bins=64))
    ids = torch.randint(1000, 5000, (1, 4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "update": pipeline({"input_ids": ids}, keep_update=True).update}

    class Recorder:
        logged: dict = {}

        def log(self, name, value, **kwargs):
            self.logged[name] = float(value)

    callback = DagerCallback(attack=Dager(), log_samples=False)
    loosened = callback._attack_for(pipeline)
    assert (loosened.options.span.l1_threshold, loosened.options.span.l2_threshold) == (1e-2, 1e-2)
    assert callback.attack.options.span.l1_threshold == 1e-3  # the configured attack is not modified
    assert DagerCallback(multi_step_threshold=None)._attack_for(pipeline).options.span.l1_threshold == 1e-3
    assert callback._trajectory(pipeline) == pytest.approx((0.0, 0.01, 0.02, 0.03))  # t * lr, t < 4 steps
    assert DagerCallback(follow_trajectory=False)._trajectory(pipeline) == ()
    module = Recorder()
    trainer = SimpleNamespace(datamodule=data_side(pipeline, seq_len=16), sanity_checking=False)
    callback.on_test_batch_end(trainer, module, None, batch, 0)
    assert module.logged["test/dager/exact_fraction"] == 1.0
    with pytest.raises(ValueError):
        DagerCallback(multi_step_threshold=0.0)


def test_dager_is_told_the_protocol_sizes_not_sizes_read_off_the_client_batch():
    """A batch padded only to its longest sequence (10 of 16 tokens) must not tell DAGER the true length."""
    from types import SimpleNamespace

    import torch

    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.targets import Transformer3
    from exact.callbacks import DagerCallback
    from exact.dager import Dager

    pipeline = UpdatePipeline(Transformer3(), client=FedSGDClient(mode="eval", samples_per_update=2), hashing=Hashing(bins=64))
    ids = torch.randint(1000, 5000, (1, 2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "update": pipeline({"input_ids": ids}, keep_update=True).update}
    seen = {}

    class Spy(Dager):
        def attack(self, target, update, batch_size=None, max_length=None, trajectory=(), sequence_update=None):
            seen.update(batch_size=batch_size, max_length=max_length, simulation=sequence_update)
            return super().attack(target, update, batch_size, max_length, trajectory, sequence_update)

    datamodule = data_side(pipeline, seq_len=16)
    module = SimpleNamespace(log=lambda *args, **kwargs: None)
    DagerCallback(attack=Spy(), log_samples=False).on_test_batch_end(
        SimpleNamespace(datamodule=datamodule, sanity_checking=False), module, None, batch, 0)
    # and, for peeling, the server's simulation of the client (an eval-mode FedSGD client can be simulated)
    assert seen == {"batch_size": 2, "max_length": 16, "simulation": pipeline.sequence_update}
