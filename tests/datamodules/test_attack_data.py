"""The declared interface between data and attacks (datamodules/attack_data.py), and the observation
settings both DataModules share: grouped knobs, declared once, with the old flat keys working one release."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from datamodules.attack_data import AttackData, ImageAttackData, TextAttackData, missing_members, require
from datamodules.federated import FedAvgClient, FedSGDClient, Hashing
from datamodules.observation_cache import CacheOptions
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")


def _text(corpus_files, **kwargs) -> TextInversionDataModule:
    from datamodules.targets import Transformer3

    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    return TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, **kwargs)


def test_the_text_datamodule_implements_what_the_attacks_read(corpus_files):
    dm = _text(corpus_files, client=FedSGDClient(samples_per_update=2))
    assert missing_members(dm, TextAttackData) == []  # before setup too: nothing is computed to check
    dm.setup()
    assert isinstance(dm, AttackData) and isinstance(dm, TextAttackData)
    assert dm.samples_per_update == 2 and dm.seq_len == 8 and dm.tokenizer is not None and dm.table_columns == []
    assert dm.describe()["samples_per_update"] == 2
    with pytest.raises(ValueError, match="holds no table"):
        dm.destandardize(torch.zeros(1, 3))


@needs_sklearn
def test_the_vision_datamodule_implements_what_the_attacks_read():
    from datamodules.vision_inversion import ImageInversionDataModule

    dm = ImageInversionDataModule(dataset="digits", client=FedSGDClient(samples_per_update=3), train_samples=30,
                                  eval_samples=6)
    assert missing_members(dm, ImageAttackData) == []
    dm.setup()
    assert isinstance(dm, AttackData) and isinstance(dm, ImageAttackData) and not isinstance(dm, TextAttackData)
    assert dm.samples_per_update == 3 and dm.output_shape == (3, 1, 8, 8)
    assert dm.seq_len is None and dm.tokenizer is None and dm.table_columns == []  # what an image has not
    assert dm.describe()["samples_per_update"] == 3


def test_a_datamodule_missing_the_interface_is_one_line_naming_what_is_missing(corpus_files):
    partial = SimpleNamespace(pipeline=None, seed=0, samples_per_update=1, describe=dict)
    with pytest.raises(ValueError) as error:
        require(partial, AttackData, "DagerCallback")
    assert str(error.value) == ("DagerCallback reads AttackData from the DataModule, but SimpleNamespace lacks seq_len, "
                                "tokenizer, table_columns, auxiliary_inputs, destandardize (datamodules/attack_data.py)")
    # A text DataModule is not an image one: the vision module names what it misses.
    with pytest.raises(ValueError, match="ImageInversionModule reads ImageAttackData .* lacks kind, num_features, "
                                         "output_shape, mean_input"):
        require(_text(corpus_files), ImageAttackData, "ImageInversionModule")
    with pytest.raises(ValueError, match="none was given"):
        require(None, AttackData, "SpearCallback")


def test_the_learned_modules_check_the_datamodule_in_setup(corpus_files):
    from lti.module import InversionModule
    from lti.vision_module import ImageInversionModule

    text = _text(corpus_files)
    for module, ok in ((InversionModule(), True), (ImageInversionModule(), False)):
        module.trainer = SimpleNamespace(datamodule=text)  # what Lightning sets before calling setup
        if ok:
            module.setup("fit")
        else:
            with pytest.raises(ValueError, match="lacks kind"):
                module.setup("fit")


def test_the_observation_settings_are_one_group_built_into_the_pipeline(corpus_files):
    dm = _text(corpus_files, hashing=Hashing(bins=12, seed=3, signed=True), cache=CacheOptions("somewhere", rebuild=True))
    settings = dm.observation
    assert settings.hashing == Hashing(fraction=0.1, bins=12, seed=3, signed=True)
    assert settings.cache == CacheOptions("somewhere", True)
    assert dm.pipeline.spec.num_bins == 12 and dm.pipeline.spec.seed == 3 and dm.pipeline.spec.signed
    assert dm.pipeline.client is settings.client is dm.client and dm.pipeline.defense is settings.defense


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_old_flat_keys_still_work_for_one_release_with_a_one_line_warning(corpus_files):
    with pytest.warns(FutureWarning, match=r"^data.hash_bins is deprecated and will be removed in the next release; "
                                           r"use data.hashing.bins$"):
        dm = _text(corpus_files, hash_bins=12, hash_seed=3)
    assert dm.observation.hashing == Hashing(bins=12, seed=3)
    with pytest.warns(FutureWarning, match="data.observation_cache is deprecated .* use data.cache.path"):
        dm = _text(corpus_files, observation_cache="somewhere", rebuild_observation_cache=True)
    assert dm.observation.cache == CacheOptions("somewhere", True)


@needs_sklearn
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_old_vision_client_shortcuts_still_work_for_one_release():
    from datamodules.vision_inversion import ImageInversionDataModule

    with pytest.warns(FutureWarning, match="data.samples_per_update is deprecated"):
        dm = ImageInversionDataModule(dataset="digits", samples_per_update=4, client_mode="eval")
    assert dm.client.describe() == FedSGDClient("eval", 4).describe()
    fedavg = FedAvgClient(samples_per_update=4)
    with pytest.warns(FutureWarning):  # the old defaults next to another client: ignored, as before
        assert ImageInversionDataModule(dataset="digits", samples_per_update=1, client=fedavg).client is fedavg
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"^data.samples_per_update=3 disagree with the client"):
        ImageInversionDataModule(dataset="digits", samples_per_update=3, client=FedAvgClient(samples_per_update=4))
