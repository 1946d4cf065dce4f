"""The observation cache against the on-the-fly path: same blocks, same features (to float16
rounding), fresh Gaussian noise of the right per-bin variance, and refusal of stale or partial caches."""

import json
import shutil

import pytest
import torch

from datamodules.federated import DPSGD, GaussianNoise, Hashing, NoDefense, Sign, TopKPruning
from datamodules.observation_cache import CacheOptions
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule


def _datamodule(corpus_files, cache=None, defense=None, dropout=0.0, causal=False, rebuild=False, **kwargs):
    torch.manual_seed(0)
    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8, dropout=dropout,
                          causal=causal)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    dm = TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, defense=defense or NoDefense(),
                                 cache=CacheOptions(str(cache) if cache else None, rebuild), **kwargs)
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


def test_cached_updates_of_several_sequences_equal_on_the_fly_ones(corpus_files, tmp_path):
    from datamodules.federated import FedSGDClient

    client = lambda: FedSGDClient(mode="train", samples_per_update=2)  # noqa: E731 (dropout 0: deterministic)
    fly = _first_batches(_datamodule(corpus_files, client=client()))
    cached = _first_batches(_datamodule(corpus_files, tmp_path / "cache", client=client()))
    for a, b in zip(fly, cached):
        assert a["input_ids"].shape[1] == 2 and torch.equal(a["input_ids"], b["input_ids"])
        rms = a["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
        assert ((a["features"] - b["features"]).abs() / rms).max() < 2e-3


def test_cached_gaussian_noise_is_fresh_and_has_the_per_coordinate_variance(corpus_files, tmp_path):
    sigma, steps = 0.05, range(10)
    clean = _datamodule(corpus_files)
    noisy_fly = _datamodule(corpus_files, defense=GaussianNoise(sigma))
    dm = _datamodule(corpus_files, tmp_path / "cache", defense=GaussianNoise(sigma))
    counts = torch.bincount(dm.pipeline.hasher.bins, minlength=dm.pipeline.spec.num_bins).float()
    used = counts > 0
    std = sigma * counts.sqrt()
    stream = dm.train_dataloader().dataset

    def features(module, step):
        return module.on_after_batch_transfer(module.train_dataloader().dataset.batch(step), 0)["features"]

    base = torch.cat([features(clean, s) for s in steps])
    cached = torch.cat([stream.batch(s)["features"] for s in steps])
    assert torch.equal(stream.batch(3)["features"], stream.batch(3)["features"])  # a step's noise is reproducible
    # On the fly: noise per raw coordinate, then hashed. Same distribution, standardized the same way.
    fly = torch.cat([features(noisy_fly, s) for s in steps])
    for noisy in (cached, fly):
        z = ((noisy - base) / std)[:, used]
        assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1.0) < 0.05
        # Per bin the variance grows with the coordinates hashed into it: check it on the bins with
        # few and with many coordinates separately (one noise scale for every bin fails here).
        noise, per_bin = (noisy - base)[:, used], counts[used]
        for group in (per_bin <= per_bin.median(), per_bin > per_bin.median()):
            expected = (sigma**2 * per_bin[group]).mean().item()
            assert abs(noise[:, group].pow(2).mean().item() / expected - 1.0) < 0.1
    # The same update in the next epoch gets new noise.
    epoch = stream.batches_per_epoch
    first = stream.batch(0)
    row0, update = 0, int(first["index"][0])
    later = next(stream.batch(s) for s in range(epoch, 2 * epoch) if update in stream.batch(s)["index"].tolist())
    row = later["index"].tolist().index(update)
    assert not torch.allclose(later["features"][row], first["features"][row0])


def test_a_matching_cache_is_reopened_not_rebuilt(corpus_files, tmp_path):
    cache = tmp_path / "cache"
    first = _first_batches(_datamodule(corpus_files, cache))
    built = (cache / "features.npy").stat().st_mtime_ns
    again = _first_batches(_datamodule(corpus_files, cache))
    assert (cache / "features.npy").stat().st_mtime_ns == built
    for a, b in zip(first, again):
        assert torch.equal(a["features"], b["features"])


def test_a_cache_for_other_observations_is_refused_naming_the_difference_and_rebuilt_on_request(corpus_files, tmp_path):
    cache = tmp_path / "cache"
    _datamodule(corpus_files, cache).train_dataloader()
    with pytest.raises(ValueError, match=r"other observations \(defense: ") as error:
        _datamodule(corpus_files, cache, defense=Sign()).train_dataloader()
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"\(hash spec: "):
        _datamodule(corpus_files, cache, hashing=Hashing(seed=1)).train_dataloader()
    with pytest.raises(ValueError, match=r"\(auxiliary samples"):
        _datamodule(corpus_files, cache, seed=1).train_dataloader()
    # Same weights, other computation (a causal mask): still another observation.
    with pytest.raises(ValueError, match=r"\(target model settings"):
        _datamodule(corpus_files, cache, causal=True).train_dataloader()
    _datamodule(corpus_files, cache, defense=Sign(), rebuild=True).train_dataloader()
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


def test_a_rank_that_does_not_build_refuses_a_missing_cache(corpus_files, tmp_path):
    from datamodules.observation_cache import ObservationCache

    dm = _datamodule(corpus_files)
    with pytest.raises(ValueError, match="was not built by rank 0"):
        ObservationCache(tmp_path / "cache", dm.pipeline, dm._splits["auxiliary"], build=False)
    assert not (tmp_path / "cache").exists()


def test_a_pseudo_pool_is_drawn_once_from_the_marginal_and_its_cached_updates_equal_on_the_fly_ones(corpus_files, tmp_path):
    fly = _datamodule(corpus_files, training_data="pseudo_pool", pseudo_pool_size=20)
    pool = fly._splits["pseudo_pool"].fields["input_ids"]
    assert pool.shape == (20, 1, 8)
    assert (fly._counts[pool.flatten()] > 0).all()  # only tokens the auxiliary text holds
    again = _datamodule(corpus_files, training_data="pseudo_pool", pseudo_pool_size=20)
    assert torch.equal(again._splits["pseudo_pool"].fields["input_ids"], pool)  # fixed by the seed
    # The prior of exact attacks and the majority baseline stay on the real auxiliary text.
    aux = fly._splits["auxiliary"].fields["input_ids"]
    assert torch.equal(fly.auxiliary_inputs(5), aux.reshape(-1, 8)[:5])
    batches = _first_batches(fly, 5)  # 5 batches of 4 = one epoch of the pool, every block once
    seen = torch.cat([b["input_ids"].reshape(-1, 8) for b in batches])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, pool.reshape(-1, 8).tolist()))
    cached = _first_batches(_datamodule(corpus_files, tmp_path / "cache", training_data="pseudo_pool", pseudo_pool_size=20), 5)
    for a, b in zip(batches, cached):
        assert torch.equal(a["input_ids"], b["input_ids"])
        rms = a["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
        assert ((a["features"] - b["features"]).abs() / rms).max() < 2e-3


def test_a_pool_cache_is_not_read_as_the_auxiliary_cache(corpus_files, tmp_path):
    _first_batches(_datamodule(corpus_files, tmp_path / "cache"), 1)
    with pytest.raises(ValueError, match="rebuild"):
        _datamodule(corpus_files, tmp_path / "cache", training_data="pseudo_pool").train_dataloader()


def test_pool_size_needs_a_pool(corpus_files):
    with pytest.raises(ValueError, match="pseudo_pool_size needs"):
        _datamodule(corpus_files, pseudo_pool_size=10)


def test_a_composed_defense_is_cached_by_its_deterministic_part_with_its_noise_added_on_reading(corpus_files, tmp_path):
    from datamodules.federated import Compose

    sigma = 0.05
    cached = _datamodule(corpus_files, tmp_path / "cache", defense=Compose([TopKPruning(0.9), GaussianNoise(sigma)]))
    stream = cached.train_dataloader().dataset
    assert json.loads((tmp_path / "cache" / "meta.json").read_text())["key"]["defense"] == {
        "name": "compose", "defenses": [{"name": "prune", "fraction_removed": 0.9}, {"name": "none"}]}
    assert cached._open_cache().noise_sigma == sigma
    # Without the noise, the cache holds what pruning alone gives on the fly.
    pruned = _first_batches(_datamodule(corpus_files, defense=TopKPruning(0.9)), 1)[0]
    rows = cached._open_cache()
    clean = torch.from_numpy(rows._features[pruned["index"].numpy()].astype("float32")) * rows._scales[pruned["index"]][:, None]
    rms = pruned["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
    assert ((pruned["features"] - clean).abs() / rms).max() < 2e-3
    assert not torch.equal(stream.batch(0)["features"], clean)  # noise is added when reading
    with pytest.raises(ValueError, match="Compose cannot be cached"):
        _datamodule(corpus_files, tmp_path / "other", defense=Compose([GaussianNoise(sigma), Sign()])).train_dataloader()
