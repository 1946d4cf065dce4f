import math

import mmh3
import numpy as np
import pytest
import torch

from datamodules.federated.hashing import (
    FeatureHasher,
    HashSpec,
    cache_dir,
    compute_buckets,
    hash_reference,
    load_or_compute_buckets,
    murmur3_32,
)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, 2**32 - 1])
def test_vectorised_murmur3_is_bit_exact_with_mmh3(seed):
    rng = np.random.default_rng(seed % 1000)
    keys = np.concatenate([np.arange(2000), rng.integers(0, 2**32, 3000, dtype=np.uint64), [2**32 - 1]]).astype(np.uint32)
    fast = murmur3_32(keys, seed)
    slow = np.array([mmh3.hash(int(k).to_bytes(4, "little"), seed, signed=False) for k in keys], dtype=np.uint32)
    np.testing.assert_array_equal(fast, slow)


def _spec(signed=False, bins=37, seed=3):
    return HashSpec(num_bins=bins, seed=seed, signed=signed, parameters=(("a.weight", (5, 7)), ("b.bias", (11,))))


@pytest.mark.parametrize("signed", [False, True])
def test_feature_hasher_matches_scalar_float64_reference(signed):
    spec = _spec(signed)
    update = torch.randn(4, spec.input_dim, dtype=torch.float64)
    fast = FeatureHasher(spec)(update)
    torch.testing.assert_close(fast, hash_reference(update, spec), rtol=1e-12, atol=1e-12)


def test_unsigned_hashing_preserves_the_sum_and_uses_the_requested_bins():
    spec = _spec(bins=10)
    update = torch.rand(3, spec.input_dim, dtype=torch.float64)
    features = FeatureHasher(spec)(update)
    assert features.shape == (3, 10)
    torch.testing.assert_close(features.sum(1), update.sum(1))
    bins, _ = compute_buckets(spec)
    assert bins.min() >= 0 and bins.max() < 10


def test_bins_are_keyed_by_parameter_name_not_position():
    """A coordinate keeps its bin when other parameters are added to the observed set."""
    alone = HashSpec(num_bins=50, seed=0, signed=False, parameters=(("b.bias", (11,)),))
    both = _spec(bins=50, seed=0)
    assert np.array_equal(compute_buckets(alone)[0], compute_buckets(both)[0][35:])


def test_buckets_are_cached_on_disk_and_reused():
    spec = _spec(bins=13, seed=99)
    path = cache_dir() / "hash" / f"{spec.fingerprint()}.npz"
    path.unlink(missing_ok=True)
    first = load_or_compute_buckets(spec)[0]
    assert path.exists()
    np.testing.assert_array_equal(load_or_compute_buckets(spec)[0], first)
    path.write_bytes(b"damaged")  # a damaged entry is recomputed, not trusted
    np.testing.assert_array_equal(load_or_compute_buckets(spec)[0], first)


def _flip_middle_bytes(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _other_spec_bins(path):
    np.savez(path, bins=np.full(46, 10_000, dtype=np.int32), signs=np.zeros(46, dtype=np.int8))


@pytest.mark.parametrize("damage", [_flip_middle_bytes, _truncate, _other_spec_bins], ids=["flipped", "truncated", "foreign"])
@pytest.mark.parametrize("signed", [False, True])
def test_a_damaged_bin_cache_is_recomputed_and_replaced_saying_so_in_one_line(damage, signed, caplog):
    """Before: flipped bytes in the .npz ended the run with an 8-line "Bad CRC-32" dump naming no file."""
    spec = _spec(signed=signed, bins=17, seed=5)
    path = cache_dir() / "hash" / f"{spec.fingerprint()}.npz"
    path.unlink(missing_ok=True)
    expected = compute_buckets(spec)
    load_or_compute_buckets(spec)
    damage(path)
    with caplog.at_level("WARNING", logger="datamodules.federated.hashing"):
        bins, signs = load_or_compute_buckets(spec)
    np.testing.assert_array_equal(bins, expected[0])
    if signed:
        np.testing.assert_array_equal(signs, expected[1])
    (record,) = caplog.records
    assert record.getMessage().startswith(f"hash-bin cache {str(path)!r} is damaged (")
    assert record.getMessage().endswith("recomputing it") and "\n" not in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="datamodules.federated.hashing"):  # the entry was replaced
        np.testing.assert_array_equal(load_or_compute_buckets(spec)[0], expected[0])
    assert not caplog.records


def test_spec_round_trip_and_difference_messages():
    spec = _spec()
    assert HashSpec.from_dict(spec.to_dict()) == spec
    assert spec.difference(spec) is None
    other = HashSpec.from_dict({**spec.to_dict(), "num_bins": 99})
    assert "num_bins" in spec.difference(other)
    fewer = HashSpec.from_dict({**spec.to_dict(), "parameters": [["a.weight", [5, 7]]]})
    assert "observed parameters differ" in spec.difference(fewer)
    weights = HashSpec.from_dict({**spec.to_dict(), "target_fingerprint": "abc"})
    assert "target model weights differ" in spec.difference(weights)
    assert spec.input_dim == 35 + 11 == sum(math.prod(s) for _, s in spec.parameters)


def test_hasher_rejects_wrong_width():
    with pytest.raises(ValueError, match="coordinates"):
        FeatureHasher(_spec())(torch.zeros(1, 5))
