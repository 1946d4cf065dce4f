"""Feature hashing of observed updates with MurmurHash3 (mmh3).

Every observed coordinate (parameter `name`, flat index `i`) goes to bin
`murmur3_32(i as 4 little-endian bytes, seed=murmur3(name, seed)) % num_bins`, optionally with a sign
from a second, independent hash; bins are summed. Keying on (name, index) rather than on the position
in the concatenated vector means a coordinate keeps its bin whatever else is observed.

`murmur3_32` is a NumPy transcription of MurmurHash3_x86_32 for 4-byte keys, bit-exact with
`mmh3.hash(key_bytes, seed, signed=False)` (tested); it hashes a million indices in milliseconds where
a Python loop over `mmh3.hash` takes a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mmh3
import numpy as np
import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def murmur3_32(keys: np.ndarray, seed: int) -> np.ndarray:
    """MurmurHash3_x86_32 of each uint32 key's 4 little-endian bytes; returns uint32."""
    k = np.asarray(keys, dtype=np.uint32).copy()
    with np.errstate(over="ignore"):
        k *= _C1
        k = _rotl(k, 15)
        k *= _C2
        h = np.full_like(k, np.uint32(seed & 0xFFFFFFFF)) ^ k
        h = _rotl(h, 13)
        h = h * np.uint32(5) + np.uint32(0xE6546B64)
        h ^= np.uint32(4)  # key length in bytes
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def murmur3_32_scalar(index: int, seed: int) -> int:
    """The slow, obvious reference: the `mmh3` package on one key."""
    return mmh3.hash(int(index).to_bytes(4, "little"), seed, signed=False)


def parameter_seed(name: str, seed: int, salt: str = "") -> int:
    return mmh3.hash(name + salt, seed, signed=False)


@dataclass(frozen=True)
class HashSpec:
    """Everything that determines the hashed features; saved with checkpoints."""

    num_bins: int
    seed: int
    signed: bool
    parameters: tuple[tuple[str, tuple[int, ...]], ...]
    target_fingerprint: str = ""
    version: int = field(default=1)

    @property
    def input_dim(self) -> int:
        return sum(math.prod(shape) for _, shape in self.parameters)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parameters"] = [[name, list(shape)] for name, shape in self.parameters]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HashSpec":
        d = dict(d)
        d["parameters"] = tuple((name, tuple(shape)) for name, shape in d["parameters"])
        return cls(**d)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def difference(self, other: "HashSpec") -> str | None:
        """A one-line description of how `other` (e.g. a checkpoint's spec) differs from this one."""
        if self == other:
            return None
        for key in ("num_bins", "seed", "signed", "version"):
            if getattr(self, key) != getattr(other, key):
                return f"{key}: checkpoint {getattr(other, key)!r}, now {getattr(self, key)!r}"
        if self.parameters != other.parameters:
            mine, theirs = dict(self.parameters), dict(other.parameters)
            missing = sorted(set(theirs) - set(mine))[:3]
            extra = sorted(set(mine) - set(theirs))[:3]
            changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])[:3]
            return f"observed parameters differ (only in checkpoint: {missing}, only now: {extra}, shape changed: {changed})"
        return f"target model weights differ (fingerprint: checkpoint {other.target_fingerprint}, now {self.target_fingerprint})"


@dataclass(frozen=True)
class Hashing:
    """How observed updates are hashed, before the observed parameters are known: `fraction` of the
    update's dimension D as bins (or exactly `bins`), the mmh3 `seed`, and `signed` (a second hash
    gives every coordinate a sign). `spec(...)` fixes it to a `HashSpec` for given parameters."""

    fraction: float | None = 0.1
    bins: int | None = None
    seed: int = 0
    signed: bool = False

    def spec(self, parameters: tuple[tuple[str, tuple[int, ...]], ...], target_fingerprint: str = "") -> HashSpec:
        dim = sum(math.prod(shape) for _, shape in parameters)
        bins = self.bins
        if bins is None:
            if self.fraction is None or not 0.0 < self.fraction <= 1.0:
                raise ValueError(f"hashing.fraction={self.fraction} must be in (0, 1] (or give hashing.bins)")
            bins = max(1, round(self.fraction * dim))
        if bins < 1:
            raise ValueError(f"hashing.bins={bins} must be >= 1")
        return HashSpec(num_bins=int(bins), seed=int(self.seed), signed=bool(self.signed), parameters=parameters,
                        target_fingerprint=target_fingerprint)


def cache_dir() -> Path:
    return Path(os.environ.get("LTI_CACHE_DIR", Path.home() / ".cache" / "lti"))


def compute_buckets(spec: HashSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """Bin (int64) and sign (+-1 int8, or None) of every observed coordinate, in concatenation order."""
    bins, signs = [], []
    for name, shape in spec.parameters:
        index = np.arange(math.prod(shape), dtype=np.uint32)
        bins.append(murmur3_32(index, parameter_seed(name, spec.seed)) % np.uint32(spec.num_bins))
        if spec.signed:
            top = murmur3_32(index, parameter_seed(name, spec.seed, salt="#sign")) >> np.uint32(31)
            signs.append((1 - 2 * top.astype(np.int8)).astype(np.int8))
    return np.concatenate(bins).astype(np.int64), (np.concatenate(signs) if spec.signed else None)


def _load_buckets(path: Path, spec: HashSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """The bins and signs saved at `path`; ValueError (one line) when they are unreadable or not `spec`'s."""
    try:
        with np.load(path, allow_pickle=False) as data:
            bins = data["bins"]
            signs = data["signs"] if spec.signed else None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        raise ValueError(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if bins.shape != (spec.input_dim,) or (spec.input_dim and not 0 <= bins.min() <= bins.max() < spec.num_bins):
        raise ValueError(f"bins of shape {bins.shape} outside [0, {spec.num_bins})")
    if signs is not None and (signs.shape != bins.shape or not (np.abs(signs) == 1).all()):
        raise ValueError("signs are not +-1 per coordinate")
    return bins, signs


def load_or_compute_buckets(spec: HashSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """`compute_buckets`, cached on disk under $LTI_CACHE_DIR/hash/<fingerprint>.npz; an entry that
    fails to load (damaged, truncated, of another spec) is recomputed and replaced, saying so in one line."""
    path = cache_dir() / "hash" / f"{spec.fingerprint()}.npz"
    if path.exists():
        try:
            return _load_buckets(path, spec)
        except ValueError as error:
            log.warning(f"hash-bin cache {str(path)!r} is damaged ({error}); recomputing it")
    bins, signs = compute_buckets(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, bins=bins.astype(np.int32), **({"signs": signs} if signs is not None else {}))
    os.replace(tmp, path)
    return bins, signs


class FeatureHasher(nn.Module):
    """(U, D) observed updates -> (U, num_bins) hashed features."""

    def __init__(self, spec: HashSpec) -> None:
        super().__init__()
        if spec.num_bins < 1:
            raise ValueError(f"hash num_bins={spec.num_bins} must be >= 1")
        self.spec = spec
        bins, signs = load_or_compute_buckets(spec)
        self.register_buffer("bins", torch.from_numpy(bins.astype(np.int64)), persistent=False)
        self.register_buffer(
            "signs", None if signs is None else torch.from_numpy(signs.astype(np.float32)), persistent=False
        )

    @property
    def num_bins(self) -> int:
        return self.spec.num_bins

    def forward(self, update: Tensor) -> Tensor:
        if update.shape[-1] != self.bins.shape[0]:
            raise ValueError(f"update has {update.shape[-1]} coordinates, hash spec expects {self.bins.shape[0]}")
        values = update if self.signs is None else update * self.signs.to(update.dtype)
        out = update.new_zeros(update.shape[0], self.num_bins)
        return out.index_add_(1, self.bins, values)


def hash_reference(update: Tensor, spec: HashSpec) -> Tensor:
    """Slow, obvious float64 reference: scalar mmh3 per coordinate, Python accumulation."""
    out = torch.zeros(update.shape[0], spec.num_bins, dtype=torch.float64)
    flat = update.double()
    position = 0
    for name, shape in spec.parameters:
        seed = parameter_seed(name, spec.seed)
        sign_seed = parameter_seed(name, spec.seed, salt="#sign")
        for i in range(math.prod(shape)):
            b = murmur3_32_scalar(i, seed) % spec.num_bins
            s = (-1.0 if murmur3_32_scalar(i, sign_seed) >> 31 else 1.0) if spec.signed else 1.0
            out[:, b] += s * flat[:, position]
            position += 1
    return out
