"""Fresh groupings of training samples into updates of m > 1 (`data.grouping: fresh`).

The fast path (the cache's one-sample rows averaged into an update of m, then the client's noise) is
checked against the slow, obvious one (the client computing the m-sample update of the same grouping
on the fly); the stream against what it promises (new groupings every epoch, each sample once per
epoch, the same batch for the same step after a restart)."""

import pytest
import torch

from datamodules.client_updates import ClientUpdates
from datamodules.federated import FedAvgClient, FedSGDClient, GaussianNoise, LoRAClient, NoDefense, Sign
from datamodules.float_noise import same_up_to_float_noise
from datamodules.observation_cache import CacheOptions
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule
from datamodules.training_stream import AuxiliaryStream

M = 2


def _datamodule(corpus_files, cache=None, defense=None, client=None, grouping="fresh", **kwargs):
    torch.manual_seed(0)
    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8, dropout=0.0)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    dm = TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, defense=defense or NoDefense(),
                                 client=client or FedSGDClient(mode="train", samples_per_update=M),
                                 cache=CacheOptions(str(cache) if cache else None), grouping=grouping, **kwargs)
    dm.setup("fit")
    return dm


def _batches(dm, count=2):
    loader = iter(dm.train_dataloader())
    return [dm.on_after_batch_transfer(next(loader), 0) for _ in range(count)]


def _samples(count=24, length=3):
    ids = torch.arange(count * length).view(count, 1, length)
    return ClientUpdates(input_ids=ids)


def test_fresh_batches_group_m_samples_and_regroup_every_epoch():
    stream = AuxiliaryStream(_samples(), batch_size=3, seed=0, group=M)
    assert len(stream) == 24 // (3 * M)
    per_epoch = len(stream)
    epochs = []
    for epoch in range(2):
        batches = [stream.batch(epoch * per_epoch + i) for i in range(per_epoch)]
        assert all(b["input_ids"].shape == (3, M, 3) for b in batches)
        used = torch.cat([b["index"].reshape(-1) for b in batches])
        assert len(set(used.tolist())) == len(used)  # each sample at most once per epoch
        # each update's rows are the samples its index names
        for b in batches:
            assert torch.equal(b["input_ids"][:, :, 0], b["index"] * 3)
        epochs.append({frozenset(row.tolist()) for b in batches for row in b["index"]})
    assert epochs[0] != epochs[1]  # new groupings in the next epoch


def test_a_restarted_stream_gives_the_same_batch_for_the_same_step():
    a = AuxiliaryStream(_samples(), batch_size=3, seed=5, group=M)
    b = AuxiliaryStream(_samples(), batch_size=3, seed=5, group=M, position=lambda: 7)
    first = next(iter(b))
    assert first["step"] == 7 and torch.equal(first["input_ids"], a.batch(7)["input_ids"])


def test_too_few_samples_for_one_batch_is_one_line():
    with pytest.raises(ValueError, match="only 24 auxiliary samples: too few for one batch of 16 updates of 2 samples"):
        AuxiliaryStream(_samples(), batch_size=16, seed=0, group=M)


def test_fresh_groupings_need_one_sample_items():
    with pytest.raises(ValueError, match="single samples"):
        AuxiliaryStream(ClientUpdates(input_ids=torch.zeros(8, 2, 3)), batch_size=2, seed=0, group=M)


def test_mixed_cache_batches_equal_on_the_fly_batches_of_the_same_grouping(corpus_files, tmp_path):
    fly = _batches(_datamodule(corpus_files))
    cached = _batches(_datamodule(corpus_files, tmp_path / "cache"))
    for a, b in zip(fly, cached):
        assert a["input_ids"].shape[1] == M and torch.equal(a["input_ids"], b["input_ids"])  # same grouping
        rms = a["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
        assert ((a["features"] - b["features"]).abs() / rms).max() < 2e-3  # float16 rounding of each row


def test_one_cache_of_one_sample_updates_serves_every_m(corpus_files, tmp_path):
    """Fresh groupings train on all the samples, whatever m (grouping once would drop N mod m of them),
    so a cache built at m = 2 opens at an m that does not divide N, and its batches still equal the
    on-the-fly updates of the same groupings."""
    two = _datamodule(corpus_files, tmp_path / "cache")
    _batches(two, 1)  # builds the cache
    samples = two._training_updates()
    m = next(m for m in (3, 5, 7, 9) if len(samples) % m)
    client = FedSGDClient(mode="train", samples_per_update=m)
    cached, fly = _datamodule(corpus_files, tmp_path / "cache", client=client), _datamodule(corpus_files, client=client)
    assert torch.equal(cached._training_updates().fields["input_ids"], samples.fields["input_ids"])
    assert len(cached._splits["auxiliary"]) * m < len(samples)  # the fixed grouping drops some
    for a, b in zip(_batches(cached), _batches(fly)):
        assert a["input_ids"].shape[1] == m and torch.equal(a["input_ids"], b["input_ids"])
        rms = b["features"].pow(2).mean(dim=1, keepdim=True).sqrt()
        assert ((a["features"] - b["features"]).abs() / rms).max() < 2e-3


def test_the_on_the_fly_fresh_batch_is_the_clients_update_of_that_grouping(corpus_files):
    """The slow reference: the m-sample update computed directly by the pipeline from the batch's samples."""
    dm = _datamodule(corpus_files)
    batch = _batches(dm, 1)[0]
    direct = dm.pipeline({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}).features
    # per update: the positions (8) times the width (16), times the coordinates summed into a hash bin
    terms = 8 * 16 * -(-dm.pipeline.observed_dim // dm.pipeline.spec.num_bins)
    assert same_up_to_float_noise(batch["features"], direct, terms, dim=1)
    # and the mean of the one-sample updates (what the cache averages), in float32 before any rounding
    single = dm.pipeline.with_client(dm.client.single_sample())
    rows = single({"input_ids": batch["input_ids"].reshape(-1, 1, 8),
                   "attention_mask": batch["attention_mask"].reshape(-1, 1, 8)}).features
    assert same_up_to_float_noise(rows.view(4, M, -1).mean(dim=1), direct, M * terms, dim=1)


def test_mixed_cache_noise_is_added_after_the_mean_with_the_per_bin_variance(corpus_files, tmp_path):
    sigma = 0.05
    clean = _datamodule(corpus_files, tmp_path / "clean")
    noisy = _datamodule(corpus_files, tmp_path / "noisy", defense=GaussianNoise(sigma))
    bins = noisy.pipeline.hasher.bins.cpu()
    counts = torch.bincount(bins, minlength=noisy.pipeline.spec.num_bins).float()
    residuals = []
    for a, b in zip(_batches(clean, 6), _batches(noisy, 6)):
        assert torch.equal(a["input_ids"], b["input_ids"])
        residuals.append((b["features"] - a["features"]) / (sigma * counts.sqrt()))
    standardised = torch.cat(residuals)[:, counts > 0]
    # the noise of one mean update (not the mean of m noises, which would have 1/sqrt(m) of the std)
    assert abs(standardised.std().item() - 1.0) < 0.05
    assert abs(standardised.mean().item()) < 0.05


@pytest.mark.parametrize("defense, client, words", [
    (Sign(), None, "Sign is not linear"),
    (NoDefense(), FedAvgClient(samples_per_update=M, local_epochs=1, minibatch_size=1), "FedAvgClient's update is not the mean"),
])
def test_cached_fresh_groupings_refuse_what_is_not_a_mean_in_one_line(corpus_files, tmp_path, defense, client, words):
    dm = _datamodule(corpus_files, tmp_path / "cache", defense=defense, client=client)
    with pytest.raises(ValueError, match=words) as error:
        dm.train_dataloader()
    assert "\n" not in str(error.value) and "drop data.cache.path" in str(error.value)
    assert not (tmp_path / "cache").exists()  # nothing written


def test_non_linear_defenses_and_fedavg_group_afresh_on_the_fly(corpus_files):
    for dm in (_datamodule(corpus_files, defense=Sign()),
               _datamodule(corpus_files, client=FedAvgClient(samples_per_update=M, local_epochs=1, minibatch_size=1))):
        batch = _batches(dm, 1)[0]
        assert batch["input_ids"].shape[:2] == (4, M) and batch["features"].shape[0] == 4


def test_lora_over_fedsgd_is_a_sample_mean():
    client = LoRAClient(rank=2, local=FedSGDClient(samples_per_update=4))
    single = client.single_sample()
    assert client.update_is_sample_mean and single.samples_per_update == 1 and client.samples_per_update == 4


def test_fixed_grouping_is_unchanged_and_fresh_is_recorded(corpus_files):
    fixed, fresh = _datamodule(corpus_files, grouping="fixed"), _datamodule(corpus_files)
    assert "grouping" not in fixed.describe() and fresh.describe()["grouping"] == "fresh"
    assert fixed._training_updates() is fixed._splits["auxiliary"]
    with pytest.raises(ValueError, match="grouping 'random' is not allowed"):
        _datamodule(corpus_files, grouping="random")


def test_a_null_cache_path_on_the_command_line_turns_the_cache_off(capsys):
    """A config that sets data.cache.path, overridden with null: computed on the fly, no folder "None"."""
    from pathlib import Path

    import yaml

    from lti.trainer_cli import run

    config = Path(__file__).resolve().parents[2] / "configs" / "reproduction" / "lti.yaml"
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(config), "--data.cache.path", "null", "--print_config"])
    cache = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["cache"]
    assert CacheOptions(**cache).path is None
