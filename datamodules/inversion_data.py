"""What the text and the image/table inversion DataModules share: what the server observes and how
(the observation settings, declared once here), grouping samples into client updates, the loaders,
and computing the observed updates per batch.

A subclass supplies the client's loss (which batch fields a client holds), the data (`setup` fills
`self._splits` with `ClientUpdates`) and what it adds to the threat-model summary; it forwards the
shared arguments (`**kwargs`) here, so `lti fit --help` lists them under the subclass. The observed
updates are computed on the batch's device in `on_after_batch_transfer`: training batches carry the
hashed features; evaluation batches also the defended update itself (`batch["update"]`) for the
exact attacks. The client's own data travels in the batch only for the losses and the metrics.
What the attacks may read from a DataModule is declared in `datamodules.attack_data`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jsonargparse import lazy_instance
from lightning.pytorch import LightningDataModule
from torch import Tensor, nn
from torch.utils.data import DataLoader

from datamodules.client_updates import ClientUpdates
from datamodules.federated import (
    ClientProtocol,
    Defense,
    FedSGDClient,
    Hashing,
    NoDefense,
    ParameterSelection,
    UpdatePipeline,
)
from datamodules.federated.losses import ClientLoss
from datamodules.observation_cache import CacheOptions, ObservationCache
from datamodules.registry import materialize
from datamodules.training_stream import EVALUATION, OBSERVATION, AuxiliaryStream, TrainingStream, seeded, step_seed


def check_sizes(batch_size: int, train_samples: int | None, eval_samples: int | None) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    for name, value in (("eval_samples", eval_samples), ("train_samples", train_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1 or null")


def deprecated(old: str, new: str) -> None:
    """One line when a config uses a key that was renamed (it still works for one release)."""
    warnings.warn(f"data.{old} is deprecated and will be removed in the next release; use data.{new}", FutureWarning,
                  stacklevel=4)


@dataclass(frozen=True)
class ObservationSettings:
    """What the server observes and how, the same for every modality: the client protocol, the
    defense, the observed parameters, the hashing of the observed update and the observation cache."""

    client: ClientProtocol
    defense: Defense
    observed: ParameterSelection
    hashing: Hashing
    cache: CacheOptions


class InversionDataModule(LightningDataModule):
    """Base of the inversion DataModules (not used on its own)."""

    #: The split the attacks train on, the server's real data (exact attacks' priors), and the
    #: split(s) they are evaluated on, per loader.
    train_split = "auxiliary"
    prior_split = "auxiliary"
    eval_splits = {"val": "evaluation", "test": "evaluation"}
    #: What differs by modality, with the value of a modality that has none (datamodules.attack_data).
    seq_len: int | None = None  # tokens per sequence (text)
    tokenizer: Any | None = None  # text

    def __init__(
        self,
        client: ClientProtocol = lazy_instance(FedSGDClient),
        defense: Defense = lazy_instance(NoDefense),
        observed: ParameterSelection = lazy_instance(ParameterSelection),
        hashing: Hashing = Hashing(),
        cache: CacheOptions = CacheOptions(),
        batch_size: int = 64,
        train_samples: int | None = None,
        eval_samples: int | None = 1000,
        keep_eval_updates: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        grouping: Literal["fixed", "fresh"] = "fixed",
        hash_fraction: float | None = None,
        hash_bins: int | None = None,
        hash_seed: int | None = None,
        hash_signed: bool | None = None,
        observation_cache: str | None = None,
        rebuild_observation_cache: bool | None = None,
    ) -> None:
        """
        Args:
            client: The client protocol, how a client computes its update: `FedSGDClient` (default:
                train mode, one sample per update), `FedAvgClient` (local epochs of SGD, sends the
                weight delta) or `LoRAClient` (peft adapters only). Its `samples_per_update` is m,
                the samples (text: sequences) of one update. Training and evaluation updates both
                come from it, so the learned attacks train against the protocol they attack.
            defense: Client-side defense (default: none); under FedAvg DP-SGD acts on every local
                step and the other defenses on the delta sent.
            observed: Which parameters the server observes (default: all but a text model's
                embedding/decoder; `preset: layer0_ffn_in` etc. for partial observation; LoRA keeps
                only adapters).
            hashing: How the observed update is hashed: `fraction` of its dimension as bins (paper:
                0.1) or exactly `bins` (overrides `fraction`), the mmh3 `seed`, and `signed` (a hashed
                +-1 sign per coordinate before summing; paper: unsigned).
            cache: The observation cache of the training updates: `path`, a folder where the hashed
                updates are computed once, stored as float16 and read from disk every epoch (a
                deterministic client on a fixed training split; a deterministic defense, optionally
                followed by Gaussian noise; datamodules/observation_cache.py), None: computed on the
                fly; `rebuild: true` rebuilds a cache built for other observations or damaged (else
                refused); `verify`: how its checksums are checked on every open (`sampled`: file
                sizes and a few chunks, `full`: every byte, `none`).
            batch_size: Client updates per batch.
            train_samples: Use at most this many auxiliary samples (None: all).
            eval_samples: Evaluate on the first this many held-out samples, grouped into updates of m
                (None: all; paper: 1000 sequences).
            keep_eval_updates: Put the defended update into evaluation batches (needed by exact attacks).
            num_workers: DataLoader workers of the evaluation loaders (training batches are an index or a
                draw made in the main process, so that a resumed run continues exactly; the update
                computation runs in the main process too).
            seed: Seed of the grouping of samples into updates (and of text's pseudo-data draws).
            grouping: How the training samples form updates of m > 1 samples: `fixed` (grouped once by
                the seed, every epoch the same updates) or `fresh` (m samples drawn afresh for every
                update, new groupings every epoch: the inverter cannot memorise them). With `fresh` the
                observation cache holds one-sample updates and averages m of them per update, which is
                exact for a FedSGD client (its update is the mean of its samples') under no defense or
                Gaussian noise (added after the averaging); sign, pruning and DP-SGD are not linear, so
                their updates are computed on the fly. Evaluation updates are always fixed.
            hash_fraction: Deprecated: use hashing.fraction.
            hash_bins: Deprecated: use hashing.bins.
            hash_seed: Deprecated: use hashing.seed.
            hash_signed: Deprecated: use hashing.signed.
            observation_cache: Deprecated: use cache.path.
            rebuild_observation_cache: Deprecated: use cache.rebuild.
        """
        super().__init__()
        check_sizes(batch_size, train_samples, eval_samples)
        renamed = {"fraction": hash_fraction, "bins": hash_bins, "seed": hash_seed, "signed": hash_signed}
        for field, value in renamed.items():
            if value is not None:
                deprecated(f"hash_{field}", f"hashing.{field}")
                hashing = dataclasses.replace(hashing, **{field: value})
        for old, field, value in (("observation_cache", "path", observation_cache),
                                  ("rebuild_observation_cache", "rebuild", rebuild_observation_cache)):
            if value is not None:
                deprecated(old, f"cache.{field}")
                cache = dataclasses.replace(cache, **{field: value})
        self.observation = ObservationSettings(materialize(client), materialize(defense), materialize(observed),
                                               hashing, cache)
        self.batch_size, self.train_samples, self.eval_samples = batch_size, train_samples, eval_samples
        self.keep_eval_updates, self.num_workers, self.seed = keep_eval_updates, num_workers, seed
        if grouping not in ("fixed", "fresh"):
            raise ValueError(f"grouping {grouping!r} is not allowed; use 'fixed' or 'fresh'")
        self.grouping = grouping
        # Whether training batches carry the defended update too: set by an attack that reads it (the
        # hybrid's span evidence); it needs updates computed on the fly.
        self.keep_train_updates = False
        self._splits: dict[str, ClientUpdates] | None = None
        self._cache = None
        self._ungrouped: dict[str, ClientUpdates] = {}  # training splits' samples before grouping (fresh groupings)

    def _build_pipeline(self, target: nn.Module, loss: ClientLoss) -> None:
        """The server's observation of `target` under the observation settings, with the client's loss."""
        settings = self.observation
        self.pipeline = UpdatePipeline(target, settings.client, settings.defense, settings.observed, settings.hashing, loss)
        self.target = self.pipeline.target  # the protocol's view of the global model (LoRA: with adapters)

    @property
    def client(self) -> ClientProtocol:
        return self.observation.client

    @property
    def samples_per_update(self) -> int:
        """m: the samples (text: sequences) of one client update."""
        return self.client.samples_per_update

    @property
    def table_columns(self) -> list[tuple[str, str, slice]]:
        """Tables: [(column name, 'continuous' | 'discrete', slice of the row)]; empty for text and images."""
        return []

    def destandardize(self, rows: Tensor) -> Tensor:
        """Tables: standardised rows (..., F) -> original units."""
        raise ValueError(f"{type(self).__name__} holds no table: only table rows can be de-standardised")

    def _as_updates(self, limit: int | None, shuffle: bool, split: str | None = None, **fields: Tensor) -> ClientUpdates:
        """Samples (fields (N, ...)) -> client updates of m samples (fields (N // m, m, ...)); with
        `shuffle` random samples are grouped, fixed once by the seed; at most `limit` samples.

        With fresh groupings the samples of a training `split` are also kept ungrouped, all of them
        (`_training_updates`): grouping drops the last N mod m, which would make the samples, and so an
        observation cache of their one-sample updates, differ from one m to another."""
        count = next(iter(fields.values())).shape[0]
        if shuffle:
            order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed))
            fields = {k: v[order] for k, v in fields.items()}
        if limit is not None:
            fields = {k: v[:limit] for k, v in fields.items()}
            count = min(count, limit)
        m = self.samples_per_update
        if split is not None and self.fresh_groups > 1:
            self._ungrouped[split] = ClientUpdates(**{k: v.unsqueeze(1) for k, v in fields.items()})
        usable = count // m * m
        if usable == 0:
            raise ValueError(f"only {count} samples{self._sample_unit()}: too few for one update of {m}")
        return ClientUpdates(**{k: v[:usable].view(-1, m, *v.shape[1:]) for k, v in fields.items()})

    def _sample_unit(self) -> str:
        return ""

    def auxiliary_inputs(self, limit: int) -> Tensor:
        """Up to `limit` of the server's auxiliary model inputs (N, ...): what an exact attack may use as
        a prior (never evaluation data)."""
        if self._splits is None:
            raise RuntimeError("call setup() before asking for auxiliary inputs")
        inputs = self._splits[self.prior_split].fields[self.pipeline.loss.fields[0]]
        return inputs.reshape(-1, *inputs.shape[2:])[:limit]

    # ---------------------------------------------------------------- loaders
    def _rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def _world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def training_position(self) -> int:
        """Training batches consumed so far (0 without a trainer; a resumed run's restored step)."""
        return 0 if self.trainer is None else self.trainer.global_step

    @property
    def fresh_groups(self) -> int:
        """m when training updates are grouped afresh at every step, else 1 (fixed groupings)."""
        return self.samples_per_update if self.grouping == "fresh" else 1

    def _training_updates(self) -> ClientUpdates:
        """The training split as the stream reads it: its updates, or with fresh groupings all its samples,
        each a one-sample update (the same for every m, so one observation cache serves them all)."""
        if self.fresh_groups == 1:
            return self._splits[self.train_split]
        return self._ungrouped[self.train_split]

    def train_dataloader(self) -> DataLoader:
        cache = self._open_cache() if self.observation.cache.path else None
        return self._stream_loader(AuxiliaryStream(
            self._training_updates(), self.batch_size, self.seed, self._rank(), self._world_size(),
            self.training_position, features=cache.features if cache is not None else None, group=self.fresh_groups,
        ))

    def _cache_pipeline(self) -> UpdatePipeline:
        """The pipeline whose updates the cache holds: with fresh groupings, one-sample updates, which
        the cache averages into updates of m (exact only where the update is the samples' mean and the
        cached part of the defense is linear)."""
        if self.fresh_groups == 1:
            return self.pipeline
        client, defense = self.client, self.pipeline.defense
        if not client.update_is_sample_mean:
            raise ValueError(f"data.grouping fresh with data.cache.path: {type(client).__name__}'s update is not the mean "
                             "of its samples' updates, so it cannot be averaged from cached ones; drop data.cache.path")
        split = defense.split_noise()
        if split is None or not split[0].linear:
            raise ValueError(f"data.grouping fresh with data.cache.path: {type(defense).__name__} is not linear, so an update "
                             "of m samples is not the mean of their cached updates; drop data.cache.path (computed on the fly)")
        return self.pipeline.with_client(client.single_sample())

    def _open_cache(self):
        """The observation cache of the auxiliary updates (built on rank 0 first; the others wait, so
        with several nodes the folder must be on a shared file system)."""
        if self._cache is None:
            distributed = self.trainer is not None and self.trainer.world_size > 1
            builder = self._rank() == 0
            if distributed and not builder:
                self.trainer.strategy.barrier("observation cache")
            if self.trainer is not None:  # build on the run's device (a GPU computes the updates far faster)
                self.pipeline.to(self.trainer.strategy.root_device)
            try:
                self._cache = ObservationCache(self.observation.cache.path, self._cache_pipeline(), self._training_updates(),
                                               self.batch_size, rebuild=self.observation.cache.rebuild and builder,
                                               client_batch=self.client_batch, build=builder,
                                               verify=self.observation.cache.verify)
            finally:
                if distributed and builder:  # release the other ranks even when the build failed
                    self.trainer.strategy.barrier("observation cache")
        return self._cache

    def _stream_loader(self, stream: TrainingStream) -> DataLoader:
        # Training batches are a function of the step (datamodules.training_stream): resuming is exact.
        # One batch per optimizer step is what makes the step the batch's index.
        if self.trainer is not None and self.trainer.accumulate_grad_batches != 1:
            raise ValueError("trainer.accumulate_grad_batches must be 1 (training batches are indexed by the optimizer "
                             "step); raise data.batch_size instead")
        return DataLoader(stream, batch_size=None)

    def _eval_loader(self, stage: str) -> DataLoader:
        return DataLoader(self._splits[self.eval_splits[stage]], batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    predict_dataloader = test_dataloader

    # ---------------------------------------------------------------- the server's observation
    def client_batch(self, batch: dict) -> dict[str, Tensor]:
        """The fields of a loader batch that the client's loss reads."""
        return {name: batch[name] for name in self.pipeline.loss.fields if batch.get(name) is not None}

    def observation_seed(self, batch: dict, training: bool) -> int:
        """The seed of every random draw in computing this batch's updates (dropout, defense noise):
        a training batch's comes from its step (so a resumed run draws the same noise), an evaluation
        batch's from its first update's index (every validation sees the same noisy updates)."""
        if training:
            step = int(batch["step"]) if "step" in batch else self.training_position()
            return step_seed(OBSERVATION, self.seed, self._rank(), step)
        first = int(batch["index"].reshape(-1)[0]) if "index" in batch else 0
        return step_seed(EVALUATION, self.seed, first)

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        if "features" in batch:  # read from the observation cache: nothing to compute
            return batch
        client_batch = self.client_batch(batch)
        device = next(iter(client_batch.values())).device
        self.pipeline.to(device)
        training = self.trainer is not None and self.trainer.training
        with seeded(device, self.observation_seed(batch, training)):  # the caller's random state is left as it was
            keep = self.keep_train_updates if training else self.keep_eval_updates
            observed = self.pipeline(client_batch, keep_update=keep)
        batch["features"] = observed.features
        if observed.update is not None:
            batch["update"] = observed.update
        return batch

    def describe(self) -> dict:
        """JSON-safe summary of the threat model, saved with checkpoints and results."""
        setting = {
            "target": type(self.target).__name__,
            "client": self.client.describe(),
            "defense": self.pipeline.defense.describe(),
            "observed_parameters": len(self.pipeline.names),
            "observed_dim": self.pipeline.observed_dim,
            "hash_bins": self.pipeline.spec.num_bins,
            "samples_per_update": self.samples_per_update,
            **self._describe_data(),
        }
        if self.grouping != "fixed":  # the default is left out, so settings recorded before it existed still match
            setting["grouping"] = self.grouping
        # DP-SGD reports its (epsilon, delta) for one client's local steps under this protocol.
        privacy = self.pipeline.defense.privacy(*self.client.privacy_steps())
        if privacy is not None:
            setting["privacy"] = privacy
        return setting

    def _describe_data(self) -> dict:
        return {}
