"""`SpearCallback` on real defended updates: text (transformer3 FFN), images and tables (FCNN first layer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning")

from datamodules.attack_data import AttackData
from datamodules.federated.hashing import Hashing
from exact.callbacks import SpearCallback  # noqa: E402


class RecordingModule:
    """Stands in for the LightningModule: records what the callback logs."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = float(value)


def data_side(pipeline, **fields) -> SimpleNamespace:
    """A DataModule's `AttackData` around a pipeline, without data (no prior, no table, no tokenizer)."""
    def no_prior(limit):
        raise AssertionError("the test did not expect a prior")

    defaults = dict(pipeline=pipeline, seed=0, samples_per_update=pipeline.client.samples_per_update, seq_len=None,
                    tokenizer=None, table_columns=[], describe=dict, auxiliary_inputs=no_prior,
                    destandardize=lambda rows: rows)
    data = SimpleNamespace(**{**defaults, **fields})
    assert isinstance(data, AttackData)
    return data


def trainer_with(pipeline, **datamodule_fields) -> SimpleNamespace:
    return SimpleNamespace(datamodule=data_side(pipeline, **datamodule_fields), sanity_checking=False)


def test_text_batch_recovers_transformer3_ffn_inputs():
    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.targets import Transformer3

    model = Transformer3(vocab_size=200, hidden_size=32, num_heads=2, ffn_size=128, num_layers=2, max_positions=8)
    pipeline = UpdatePipeline(model, client=FedSGDClient(mode="eval"), hashing=Hashing(bins=16))
    ids = torch.randint(0, 200, (2, 1, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, 0], "update": pipeline({"input_ids": ids}, keep_update=True).update}
    module = RecordingModule()
    callback = SpearCallback(layer="encoder.layers.0.linear1")
    callback.on_test_batch_end(trainer_with(pipeline), module, None, batch, 0)
    logged = module.logged
    assert logged["test/spear/exact_fraction"] == 1.0 and logged["test/spear/certified_fraction"] == 1.0
    assert logged["test/spear/rows_recovered"] == 1.0
    assert logged["test/spear/cosine"] > 0.999999
    assert logged["test/spear/seconds_per_batch"] > 0
    assert "test/spear/psnr" not in logged and "test/spear/discrete_acc" not in logged
    # Only the configured stages run.
    module2 = RecordingModule()
    SpearCallback(layer="encoder.layers.0.linear1", stages=("val",)).on_test_batch_end(
        trainer_with(pipeline), module2, None, batch, 0)
    assert module2.logged == {}


def _vision_pipeline(input_shape, samples, hidden=64):
    from datamodules.federated import ClassificationLoss, FedSGDClient, UpdatePipeline
    from datamodules.targets.vision import FCNN

    model = FCNN(input_shape=input_shape, num_classes=4, hidden=hidden, num_layers=3)
    return UpdatePipeline(model, FedSGDClient(samples_per_update=samples, mode="eval"), hashing=Hashing(bins=16),
                          loss=ClassificationLoss())


def test_image_batch_gets_psnr_and_exact_recovery():
    pipeline = _vision_pipeline((1, 6, 6), samples=6)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.rand(2, 6, 1, 6, 6, generator=gen)
    labels = torch.randint(0, 4, (2, 6), generator=gen)
    batch = {"inputs": inputs, "labels": labels, "update": pipeline({"inputs": inputs, "labels": labels}, keep_update=True).update}
    module = RecordingModule()
    SpearCallback(layer="layers.0").on_validation_batch_end(trainer_with(pipeline), module, None, batch, 0)
    logged = module.logged
    assert logged["val/spear/exact_fraction"] == 1.0 and logged["val/spear/rows_recovered"] == 1.0
    assert logged["val/spear/psnr"] > 100  # float32 client gradients, float64 attack


def test_table_batch_gets_discrete_accuracy_and_mae():
    pipeline = _vision_pipeline((9,), samples=5)
    gen = torch.Generator().manual_seed(1)
    # Columns: one continuous (standardised), a 3-way one-hot, one continuous, a 4-way one-hot.
    columns = [("a", "continuous", slice(0, 1)), ("b", "discrete", slice(1, 4)),
               ("c", "continuous", slice(4, 5)), ("d", "discrete", slice(5, 9))]
    rows = torch.zeros(1, 5, 9)
    rows[..., 0] = torch.randn(1, 5, generator=gen)
    rows[..., 4] = torch.randn(1, 5, generator=gen)
    rows[0, torch.arange(5), 1 + torch.randint(0, 3, (5,), generator=gen)] = 1.0
    rows[0, torch.arange(5), 5 + torch.randint(0, 4, (5,), generator=gen)] = 1.0
    labels = torch.randint(0, 4, (1, 5), generator=gen)
    batch = {"inputs": rows, "labels": labels, "update": pipeline({"inputs": rows, "labels": labels}, keep_update=True).update}
    module = RecordingModule()
    SpearCallback(layer="layers.0").on_test_batch_end(
        trainer_with(pipeline, table_columns=columns, destandardize=lambda x: x * 10.0 + 40.0), module, None, batch, 0)
    logged = module.logged
    assert logged["test/spear/exact_fraction"] == 1.0 and logged["test/spear/certified_fraction"] == 1.0
    assert logged["test/spear/discrete_acc"] == 1.0
    assert logged["test/spear/continuous_mae"] < 1e-4
    assert "test/spear/psnr" not in logged


def test_missing_update_or_layer_warns_and_skips():
    from datamodules.federated import UpdatePipeline
    from datamodules.targets import Transformer3

    model = Transformer3(vocab_size=50, hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8)
    pipeline = UpdatePipeline(model, hashing=Hashing(bins=8))
    module = RecordingModule()
    with pytest.warns(UserWarning, match="no 'update'"):
        SpearCallback(layer="encoder.layers.0.linear1").on_test_batch_end(
            trainer_with(pipeline), module, None, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 0)
    with pytest.warns(UserWarning, match="no module named"):
        SpearCallback(layer="encoder.layers.5.linear1").on_test_batch_end(
            trainer_with(pipeline), module, None,
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "update": torch.zeros(1, pipeline.observed_dim)}, 0)
    assert module.logged == {}
    with pytest.raises(ValueError):
        SpearCallback(layer="layers.0", every_n_batches=0)
    with pytest.raises(ValueError):
        SpearCallback(layer="layers.0", stages=("train",))


def test_prior_samples_guide_spear_with_the_servers_auxiliary_inputs():
    from exact.spear import SearchBudget, Spear

    pipeline = _vision_pipeline((1, 6, 6), samples=12, hidden=128)
    gen = torch.Generator().manual_seed(2)
    prototypes = torch.rand(8, 1, 6, 6, generator=gen)  # "classes": the batch and the auxiliary data share them

    def draw(count):
        return (prototypes[torch.randint(0, 8, (count,), generator=gen)] + 0.1 * torch.randn(count, 1, 6, 6, generator=gen)).clamp(0, 1)

    inputs, auxiliary = draw(12)[None], draw(400)
    labels = torch.randint(0, 4, (1, 12), generator=gen)
    batch = {"inputs": inputs, "labels": labels, "update": pipeline({"inputs": inputs, "labels": labels}, keep_update=True).update}
    asked = []

    def auxiliary_inputs(limit):
        asked.append(limit)
        return auxiliary[:limit]

    trainer = trainer_with(pipeline, auxiliary_inputs=auxiliary_inputs)
    one_draw = Spear(SearchBudget(max_samples=1))  # random sampling alone cannot find 12 directions in one draw
    blind, guided = RecordingModule(), RecordingModule()
    SpearCallback(layer="layers.0", attack=one_draw).on_test_batch_end(trainer, blind, None, batch, 0)
    callback = SpearCallback(layer="layers.0", attack=one_draw, prior_samples=300)
    callback.on_test_batch_end(trainer, guided, None, batch, 0)
    callback.on_test_batch_end(trainer, guided, None, batch, 0)
    assert blind.logged["test/spear/exact_fraction"] == 0.0 and blind.logged["test/spear/certified_fraction"] == 0.0
    assert guided.logged["test/spear/exact_fraction"] == 1.0 and guided.logged["test/spear/psnr"] > 100
    assert asked == [300]  # the prior's layer inputs are computed once
    with pytest.raises(ValueError):
        SpearCallback(layer="layers.0", prior_samples=-1)


def test_a_datamodule_without_the_attack_interface_is_one_line_naming_what_is_missing():
    pipeline = _vision_pipeline((1, 6, 6), samples=2)
    partial = SimpleNamespace(pipeline=pipeline, seed=0, samples_per_update=2, seq_len=None, tokenizer=None,
                              describe=dict, destandardize=lambda rows: rows)
    assert not isinstance(partial, AttackData)
    trainer = SimpleNamespace(datamodule=partial, sanity_checking=False)
    with pytest.raises(ValueError, match=r"^SpearCallback reads AttackData from the DataModule, but SimpleNamespace lacks "
                                         r"table_columns, auxiliary_inputs \(datamodules/attack_data.py\)$") as error:
        SpearCallback(layer="layers.0").setup(trainer, RecordingModule(), "test")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="none was given"):
        SpearCallback(layer="layers.0").setup(SimpleNamespace(datamodule=None), RecordingModule(), "test")


def test_exact_is_judged_against_the_truth_and_certified_is_spears_own_claim():
    """A SPEAR that certifies wrong rows: certified_fraction 1, exact_fraction 0 (they never mix)."""
    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.targets import Transformer3

    model = Transformer3(vocab_size=200, hidden_size=32, num_heads=2, ffn_size=128, num_layers=2, max_positions=8)
    pipeline = UpdatePipeline(model, client=FedSGDClient(mode="eval"), hashing=Hashing(bins=16))
    ids = torch.randint(0, 200, (2, 1, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, 0], "update": pipeline({"input_ids": ids}, keep_update=True).update}
    callback = SpearCallback(layer="encoder.layers.0.linear1")
    callback.attack.attack = lambda *args, **kwargs: SimpleNamespace(exact=True, inputs=torch.randn(8, 32))
    module = RecordingModule()
    callback.on_test_batch_end(trainer_with(pipeline), module, None, batch, 0)
    assert module.logged["test/spear/certified_fraction"] == 1.0
    assert module.logged["test/spear/exact_fraction"] == 0.0
