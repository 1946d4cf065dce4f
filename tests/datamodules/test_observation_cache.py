"""The observation cache against the on-the-fly path: same blocks, same features (to float16
rounding), fresh Gaussian noise of the right per-bin variance, and refusal of stale or partial caches."""

import json
import shutil

import pytest
import torch

from datamodules.federated import DPSGD, GaussianNoise, NoDefense, Sign, TopKPruning
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule


def _datamodule(corpus_files, cache=None, defense=None, dropout=0.0, **kwargs):
    torch.manual_seed(0)
    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8, dropout=dropout)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    dm = TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, defense=defense or NoDefense(),
                                 observation_cache=str(cache) if cache else None, **kwargs)
    dm.setup("fit")
    return dm


def _first_batches(dm, count=2):
    loader = iter(dm.train_dataloader())
    return [dm.on_after_batch_transfer(next(loader), 0) for _ in range(count)]


@pytest.mark.parametrize("defense", [NoDefense(), Sign(), TopKPruning(0.9)], ids=["none", "sign", "prune"])
def test_cached_batches_equal_on_the_fly_batches_to_float16_rounding(corpus_files, tmp_path, defense):
    fly = _first_batches(_datamodule(corpus_files, defense=defense))
    cached = _first_batches(_datamodule(corpus_files, tmp_path / "cache", defense=defense))
    for a, b in zip(fly, cached):
        assert torch.equal(a["input_ids"], b["input_ids"])  # same blocks at the same step
        rms = a["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
        assert ((a["features"] - b["features"]).abs() / rms).max() < 2e-3  # float16: 11-bit mantissa
        assert (a["features"] != 0).sum() > 0


def test_cached_gaussian_noise_is_fresh_and_has_the_per_coordinate_variance(corpus_files, tmp_path):
    sigma = 0.05
    clean = _datamodule(corpus_files)
    noisy_fly = _datamodule(corpus_files, defense=GaussianNoise(sigma))
    dm = _datamodule(corpus_files, tmp_path / "cache", defense=GaussianNoise(sigma))
    counts = torch.bincount(dm.pipeline.hasher.bins, minlength=dm.pipeline.spec.num_bins).float()
    std = sigma * counts.sqrt()
    used = counts > 0
    stream = dm.train_dataloader().dataset
    epoch = stream.batches_per_epoch
    base = clean.on_after_batch_transfer(clean.train_dataloader().dataset.batch(0), 0)["features"]
    first, again = stream.batch(0)["features"], stream.batch(0)["features"]
    assert torch.equal(first, again)  # a step's noise is reproducible (exact resume)
    z_cached = ((first - base) / std)[:, used]
    # On the fly: noise per raw coordinate, then hashed. Same distribution, standardized the same way.
    fly = noisy_fly.on_after_batch_transfer(noisy_fly.train_dataloader().dataset.batch(0), 0)["features"]
    z_fly = ((fly - base) / std)[:, used]
    for z in (z_cached, z_fly):
        assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1.0) < 0.05
    # The same update in the next epoch gets new noise.
    index = stream.batch(0)["index"]
    later = next(stream.batch(s) for s in range(epoch, 2 * epoch) if set(stream.batch(s)["index"].tolist()) & set(index.tolist()))
    row = later["index"].tolist().index(next(i for i in later["index"].tolist() if i in index.tolist()))
    row0 = index.tolist().index(later["index"][row].item())
    assert not torch.allclose(later["features"][row], first[row0])


def test_a_cache_for_other_observations_is_refused_naming_the_difference_and_rebuilt_on_request(corpus_files, tmp_path):
    cache = tmp_path / "cache"
    _datamodule(corpus_files, cache).train_dataloader()
    with pytest.raises(ValueError, match=r"other observations \(defense: ") as error:
        _datamodule(corpus_files, cache, defense=Sign()).train_dataloader()
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"\(hash spec: "):
        _datamodule(corpus_files, cache, hash_seed=1).train_dataloader()
    with pytest.raises(ValueError, match=r"\(auxiliary samples"):
        _datamodule(corpus_files, cache, seed=1).train_dataloader()
    _datamodule(corpus_files, cache, defense=Sign(), rebuild_observation_cache=True).train_dataloader()
    assert json.loads((cache / "meta.json").read_text())["key"]["defense"]["name"] == "sign"


def test_an_incomplete_cache_is_never_read(corpus_files, tmp_path, monkeypatch):
    from datamodules import observation_cache

    cache = tmp_path / "cache"
    calls = {"n": 0}
    original = observation_cache.ObservationCache._observe

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(observation_cache.ObservationCache, "_observe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _datamodule(corpus_files, cache).train_dataloader()
    assert not cache.exists() and not list(tmp_path.glob("cache.partial-*"))
    monkeypatch.undo()
    cache.mkdir()  # a folder without meta.json (e.g. copied half-way)
    with pytest.raises(ValueError, match="not a complete cache"):
        _datamodule(corpus_files, cache).train_dataloader()
    shutil.rmtree(cache)
    assert _datamodule(corpus_files, cache).train_dataloader() is not None


def test_a_cache_that_does_not_fit_the_disk_fails_before_it_starts(corpus_files, tmp_path, monkeypatch):
    from datamodules import observation_cache

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(observation_cache.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(ValueError, match=r"needs [0-9.]+ GB .* only 0.0 GB free"):
        _datamodule(corpus_files, tmp_path / "cache").train_dataloader()
    assert not (tmp_path / "cache").exists()


def test_random_clients_and_unsupported_defenses_are_refused(corpus_files, tmp_path):
    with pytest.raises(ValueError, match="client updates are random"):
        _datamodule(corpus_files, tmp_path / "a", dropout=0.5).train_dataloader()
    with pytest.raises(ValueError, match="DPSGD cannot be cached"):
        _datamodule(corpus_files, tmp_path / "b", defense=DPSGD(clip_norm=1.0, noise_multiplier=1.0)).train_dataloader()
    with pytest.raises(ValueError, match="nothing to cache"):
        _datamodule(corpus_files, tmp_path / "c", training_data="pseudo")
