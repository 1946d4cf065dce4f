"""Cached observations: the hashed updates of the auxiliary split, computed once and read from disk.

When a client's update is a deterministic function of its data (dropout 0 or eval mode, as the LTI
paper's transformer3), the hashed update of an auxiliary sample never changes under a deterministic
defense (none, sign, pruning). A defense that is a deterministic part followed by Gaussian noise
(`Defense.split_noise`: sigma per coordinate) has its deterministic part cached and the noise added
after hashing, per bin with variance sigma^2 * (observed coordinates in the bin), which has exactly
the distribution of per-coordinate noise hashed (a sum of independent normals), and is fresh for
every batch. So one pass over the auxiliary data feeds every epoch of LTI.

On disk (one folder): `features.npy`, float16 (N, k) rows scaled to unit RMS (raw gradients can be
smaller than float16's normal range), `scales.npy` (N,) float32 row scales, and `meta.json` (the key
below and the row count). The key names everything the features depend on: hash spec (with the
target's weight fingerprint), client protocol, defense, and a digest of the auxiliary samples. A
cache whose key differs is refused with the first difference, or rebuilt on request; a cache is
built in a temporary folder that is renamed into place only once complete, so an interrupted build
is never read. meta.json also holds per-chunk checksums of both files, checked on every open
(`CacheOptions.verify`), and one process at a time checks or builds a folder (a lock next to it), so
two runs sharing a cache never delete each other's build (datamodules/cache_folder.py). A damaged
cache is refused in one line naming the file, or rebuilt with `rebuild`. Plain PyTorch + NumPy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from datamodules.cache_folder import build_lock, checksums, first_mismatch, partial_folder, remove_dead_partials
from datamodules.client_updates import ClientUpdates
from datamodules.federated import Defense, NoDefense
from datamodules.federated.pipeline import UpdatePipeline
from datamodules.float_noise import same_up_to_float_noise
from datamodules.training_stream import seeded

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # checksums were added without a new version: older caches are read, unverified, with a warning
FILES = ("features.npy", "scales.npy")
#: A client update computed twice may differ by this much, relative to the largest entry of its row,
#: and still count as deterministic: CUDA's per-sequence gradients and `index_add_` accumulate in an
#: order that varies from run to run (differences of ~1e-6 relative), where dropout changes the
#: update by the order of the update itself.
ACCUMULATION_ORDER_TOLERANCE = 1e-4


@dataclass(frozen=True)
class CacheOptions:
    """Whether and where a DataModule caches its training observations (`data.cache`)."""

    path: str | None = None  # the cache folder; None: observations are computed on the fly
    rebuild: bool = False  # rebuild a cache built for other observations or damaged (else it is refused, naming why)
    # On every open, check the files against their checksums: `sampled` (sizes, the first, last and a
    # few random 16 MiB chunks; a fraction of a second for any size), `full` (every byte) or `none`.
    verify: Literal["sampled", "full", "none"] = "sampled"

    def __post_init__(self) -> None:
        # On the command line, `--data.cache.path null` over a config that sets a path reaches this
        # nested group as the string 'None' (jsonargparse), which would name a cache folder "None".
        if self.path in ("None", "null"):
            object.__setattr__(self, "path", None)


def _digest(*tensors: Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def computation_fingerprint(module: torch.nn.Module) -> str:
    """A digest of what a model computes beyond its weights: every submodule's class and plain
    settings (heads, dropout p, norm eps, causal flags, ...) and a Hugging Face config if any. Two
    models with equal weights but, say, another head count or mask get different fingerprints."""
    digest = hashlib.sha256()
    for name, sub in module.named_modules():
        plain = sorted((k, v) for k, v in vars(sub).items()
                       if isinstance(v, (bool, int, float, str)) and k != "training" and not k.startswith("_"))
        digest.update(f"{name}:{type(sub).__qualname__}:{plain}".encode())
        config = getattr(sub, "config", None)
        if hasattr(config, "to_json_string"):
            digest.update(config.to_json_string().encode())
    return digest.hexdigest()[:16]


def cached_defense(pipeline: UpdatePipeline) -> tuple[Defense, float]:
    """(the defense whose output the cache holds, sigma of the per-coordinate noise added when reading)."""
    split = pipeline.defense.split_noise()
    if split is None:
        raise ValueError(
            f"observations under {type(pipeline.defense).__name__} cannot be cached (only a deterministic defense, "
            "optionally followed by Gaussian noise); drop data.cache.path to compute them on the fly"
        )
    return split


def cache_key(pipeline: UpdatePipeline, updates: ClientUpdates) -> dict:
    stored, _ = cached_defense(pipeline)
    return {
        "format": FORMAT_VERSION,
        "hash_spec": pipeline.spec.fingerprint(),
        "target": pipeline.spec.target_fingerprint,
        "target_computation": computation_fingerprint(pipeline.target),
        "client": pipeline.client.describe(),
        "defense": stored.describe(),
        "samples": _digest(*updates.fields.values()),
        "rows": len(updates),
        "bins": pipeline.spec.num_bins,
    }


def key_difference(saved: dict, wanted: dict) -> str | None:
    names = {"hash_spec": "hash spec", "target": "target model weights",
             "target_computation": "target model settings (heads, dropout, masks, config)", "client": "client protocol",
             "defense": "defense", "samples": "auxiliary samples (corpus, tokenizer, packing or grouping)",
             "rows": "number of auxiliary updates", "bins": "hash bins", "format": "cache format"}
    for field, label in names.items():
        if saved.get(field) != wanted.get(field):
            return f"{label}: cache {saved.get(field)!r}, now {wanted.get(field)!r}"
    return None


def differ_only_by_accumulation_order(first: Tensor, second: Tensor, terms: int = 1) -> bool:
    """Whether two computations of the same updates (U, k) agree up to floating-point accumulation order,
    as a deterministic client's do on any device: every row within `ACCUMULATION_ORDER_TOLERANCE` of its
    largest entry, or within float32's noise of a sum of `terms` (coordinates per hash bin) if that is
    larger (`datamodules.float_noise`); a random client's (dropout in train mode) differ by the order of
    the values."""
    return same_up_to_float_noise(first, second, terms, dim=1, floor=ACCUMULATION_ORDER_TOLERANCE)


REBUILD = "set data.cache.rebuild true to rebuild it"


class ObservationCache:
    """The cached features of one DataModule's auxiliary updates (`features(index)` -> (n, k) float32)."""

    def __init__(self, path: str | Path, pipeline: UpdatePipeline, updates: ClientUpdates, batch_size: int = 64,
                 rebuild: bool = False, progress: bool = True, client_batch=None, build: bool = True,
                 verify: str = "sampled") -> None:
        """`client_batch(batch)`: the fields of a batch the client's loss reads (the DataModule's, so the
        cache computes exactly what the on-the-fly path computes); the build runs on the pipeline's device.
        `build=False` (DDP ranks other than 0): open a cache another process built, never build one; such
        a rank checks `sampled` at most (rank 0 checked as asked just before). `verify`: how an existing
        cache is checked against its checksums (`CacheOptions.verify`)."""
        if verify not in ("sampled", "full", "none"):
            raise ValueError(f"data.cache.verify={verify!r} must be sampled, full or none")
        self.path, self.pipeline, self.updates = Path(path), pipeline, updates
        self.client_batch = client_batch or (lambda batch: {k: v for k, v in batch.items() if k in pipeline.loss.fields})
        self.key = json.loads(json.dumps(cache_key(pipeline, updates)))  # as it reads back from meta.json
        self.stored_defense, self.noise_sigma = cached_defense(pipeline)
        if not build and verify == "full":
            verify = "sampled"
        with build_lock(self.path, "observation cache"):  # no other run removes or builds it meanwhile
            problem = self._problem(verify, rebuild, warn=build)
            if problem is not None and not rebuild:
                raise ValueError(problem)
            if problem is not None:
                shutil.rmtree(self.path)
            if not self.path.exists() and not build:
                raise ValueError(f"observation cache {str(self.path)!r} was not built by rank 0 (see its error)")
            if not self.path.exists():
                self._build(batch_size, progress)
            self._features, self._scales = self._load()
        bins = pipeline.hasher.bins.cpu()
        # Per-bin standard deviation of hashed per-coordinate noise: sigma * sqrt(coordinates in the bin).
        self.noise_std = self.noise_sigma * torch.bincount(bins, minlength=pipeline.spec.num_bins).double().sqrt().float()

    def _problem(self, verify: str, rebuild: bool, warn: bool) -> str | None:
        """Why the folder cannot be read as this cache (one line, naming the file and the way out), or
        None: absent (to be built) or sound."""
        if not self.path.exists():
            return None
        meta = self.path / "meta.json"
        if not meta.is_file():
            return (f"observation cache {str(self.path)!r} exists but is not a complete cache (no meta.json); "
                    f"{REBUILD}, remove it or choose another path")
        try:
            saved = json.loads(meta.read_text())
            saved_key = saved["key"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            return f"observation cache file {str(meta)!r} is unreadable ({type(error).__name__}: {error}); {REBUILD}"
        difference = key_difference(saved_key, self.key)
        if difference is not None:
            return (f"observation cache {str(self.path)!r} was built for other observations ({difference}); "
                    "set data.cache.rebuild true or choose another path")
        if "checksums" not in saved:
            if rebuild:
                return f"observation cache {str(self.path)!r} has no checksums"
            if warn and verify != "none":
                log.warning(f"observation cache {str(self.path)!r} has no checksums (built by an older version): read "
                            f"unverified; {REBUILD} with checksums")
        else:
            mismatch = first_mismatch(self.path, saved["checksums"], verify)
            if mismatch is not None:
                return f"observation cache {mismatch}; {REBUILD}"
        try:
            self._load()
        except ValueError as error:
            return str(error)
        return None

    def _load(self) -> tuple[np.ndarray, Tensor]:
        """The features (memory-mapped) and the row scales; a file that does not read as the key says
        is refused in one line (caches without checksums, or `verify: none`)."""
        rows, bins = self.key["rows"], self.key["bins"]
        arrays = []
        for name, shape, mmap_mode in (("features.npy", (rows, bins), "r"), ("scales.npy", (rows,), None)):
            try:
                array = np.load(self.path / name, mmap_mode=mmap_mode)
            except (OSError, ValueError, EOFError) as error:
                raise ValueError(f"observation cache file {str(self.path / name)!r} cannot be read ({error}); {REBUILD}") from None
            if array.shape != shape:
                raise ValueError(f"observation cache file {str(self.path / name)!r} holds shape {array.shape}, "
                                 f"expected {shape}; {REBUILD}")
            arrays.append(array)
        return arrays[0], torch.from_numpy(arrays[1])

    @staticmethod
    def bytes_needed(rows: int, bins: int) -> int:
        return rows * bins * 2 + rows * 4

    def _build(self, batch_size: int, progress: bool) -> None:
        """Computes the cache into a partial folder, records its checksums and renames it into place
        (under the build lock)."""
        rows, bins = len(self.updates), self.pipeline.spec.num_bins
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needed = self.bytes_needed(rows, bins)
        free = shutil.disk_usage(self.path.parent).free
        if needed > free:
            raise ValueError(f"observation cache needs {needed / 1e9:.1f} GB at {str(self.path.parent)!r}, only {free / 1e9:.1f} GB free")
        remove_dead_partials(self.path)  # left by killed builds; a live build holds the lock, so there is none
        tmp = partial_folder(self.path)
        tmp.mkdir()
        try:
            features = np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.float16, shape=(rows, bins))
            scales = np.zeros(rows, dtype=np.float32)
            iterator = range(0, rows, batch_size)
            if progress:
                from tqdm.auto import tqdm

                iterator = tqdm(iterator, desc=f"caching observations ({rows} updates, {needed / 1e9:.1f} GB)", unit="batch")
            for start in iterator:
                index = torch.arange(start, min(start + batch_size, rows))
                batch = {name: value[index] for name, value in self.updates.fields.items()}
                if start == 0:
                    self._check_deterministic(batch)
                clean = self._observe(batch, seed=0)
                scale = clean.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)
                features[start : start + len(index)] = (clean / scale[:, None]).numpy().astype(np.float16)
                scales[start : start + len(index)] = scale.numpy()
            features.flush()
            del features
            np.save(tmp / "scales.npy", scales)
            meta = {"key": self.key, "rows": rows, "checksums": checksums(tmp, FILES)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            tmp.replace(self.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _check_deterministic(self, batch: dict) -> None:
        """Refuses a client whose updates are random: a cache would freeze one draw. Compared before any
        defense (a sign or pruning turns accumulation-order noise into whole flipped coordinates)."""
        first, second = (self._observe(batch, seed, defense=NoDefense()) for seed in (0, 1))
        per_bin = -(-self.pipeline.observed_dim // max(self.pipeline.spec.num_bins, 1))  # coordinates summed per bin
        if not differ_only_by_accumulation_order(first, second, per_bin):
            raise ValueError("client updates are random (dropout in train mode?): caching would freeze one draw; "
                             "use a deterministic client or drop data.cache.path")

    def _observe(self, batch: dict, seed: int, defense: Defense | None = None) -> Tensor:
        """The hashed updates of a batch under `defense`, by default the defense's deterministic part (its
        noise comes when reading)."""
        device = self.pipeline.hasher.bins.device
        fields = {name: value.to(device) for name, value in self.client_batch(batch).items()}
        with seeded(device, seed):
            return self.pipeline(fields, defense=self.stored_defense if defense is None else defense).features.float().cpu()

    def __len__(self) -> int:
        return self._features.shape[0]

    def features(self, index: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Rows `index` (n,) as float32 (n, k), with fresh per-bin noise under a Gaussian-noise defense.

        With `index` (n, m) of one-sample rows: the features of n updates of m samples each, the mean of
        their m rows (hashing is linear and the update is the samples' mean), then the noise the client
        adds to that mean."""
        index = index.cpu()
        flat = index.reshape(-1)
        rows = torch.from_numpy(np.ascontiguousarray(self._features[flat.numpy()])).float()
        rows *= self._scales[flat][:, None]
        if index.dim() == 2:
            rows = rows.view(*index.shape, -1).mean(dim=1)
        if self.noise_sigma > 0:
            rows += self.noise_std * torch.randn(rows.shape, generator=generator)
        return rows

