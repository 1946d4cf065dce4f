"""Training batches as a function of the step: what makes an interrupted run resume exactly.

Batch number `t` of a run (one batch per optimizer step) is fully determined by (seed, rank, t):
auxiliary updates come in an epoch-seeded permutation (epoch = t // batches per epoch), pseudo-data
is drawn from a generator seeded by t. A stream starts at the position its `position()` callable
returns when iteration begins (the trainer's restored step on a resumed run), so a run stopped at
step n and resumed sees exactly the batches n, n+1, ... of the uninterrupted run: no loader state
has to be saved, and the one-batch prefetch of the training loop cannot shift it. Every batch
carries its `step`, from which the consumer seeds whatever it draws for the batch (noise, negatives).
Streams run in the loading process (`num_workers=0`): a worker forked before a resumed run restores
its step would start from 0, and a batch is a cheap index or draw.

With DDP, rank r of w takes the r-th of w disjoint slices of each permutation (auxiliary data) or
its own generator stream (pseudo-data). Plain PyTorch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from datamodules.client_updates import ClientUpdates

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads nearby (seed, step) pairs apart


#: Salts: one per kind of draw, always the first part of a seed, so no two kinds share a generator.
EPOCH_ORDER, PSEUDO_DATA, OBSERVATION, EVALUATION, NEGATIVES, CACHED_NOISE = range(1, 7)


def step_seed(*parts: int) -> int:
    """A 63-bit seed from integers (salt, seed, rank, step, ...), different for any change of one part."""
    value = 0
    for part in parts:
        value = ((value ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * _MIX + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 29
    return value & 0x7FFFFFFFFFFFFFFF


def step_generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(*parts))


@contextmanager
def seeded(device: torch.device, seed: int):
    """Every draw inside (dropout, defense noise) from `seed` on `device`; the caller's random state
    (CPU and that device's) is restored afterwards."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class TrainingStream(IterableDataset, ABC):
    """Yields ready batches (dicts) for steps `position()`, `position() + 1`, ...; `len()` is the
    number of batches per epoch. Use with `DataLoader(stream, batch_size=None)`."""

    def __init__(self, batches_per_epoch: int, seed: int, rank: int = 0, world_size: int = 1,
                 position: Callable[[], int] | None = None) -> None:
        if batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch={batches_per_epoch} must be >= 1")
        self.batches_per_epoch, self.seed, self.rank, self.world_size = batches_per_epoch, seed, rank, world_size
        self.position = position or (lambda: 0)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("a training stream runs in the loading process: use it with num_workers=0")
        start = self.position()  # read when the first batch is asked for: after a resumed run's restore
        end = (start // self.batches_per_epoch + 1) * self.batches_per_epoch  # to the end of this epoch
        for step in range(start, end):
            yield {**self.batch(step), "step": torch.tensor(step)}

    @abstractmethod
    def batch(self, step: int) -> dict[str, Tensor]:
        """The batch of training step `step` on this rank."""


class AuxiliaryStream(TrainingStream):
    """Auxiliary client updates, each epoch in a fresh permutation fixed by (seed, epoch); drops the
    last incomplete batch of an epoch.

    With `group` = m > 1 the items of `updates` are single samples (fields (N, 1, ...)) and every batch
    groups m consecutive samples of the epoch's permutation into one update (fields (B, m, ...)): each
    epoch forms new groupings, so a run never sees the same update of m samples twice in practice,
    where updates grouped once are seen again every epoch (and memorised: docs/batched_updates.md)."""

    def __init__(self, updates: ClientUpdates, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 position: Callable[[], int] | None = None,
                 features: Callable[[Tensor, torch.Generator], Tensor] | None = None, group: int = 1) -> None:
        """`features(index, generator)`: the observed features of updates `index` (a cache; with `group` > 1,
        `index` is (B, m) and the features are those of each row's update of m samples), put in the
        batch as `features`, with a generator seeded by the step for any noise it adds."""
        if group < 1:
            raise ValueError(f"group={group} must be >= 1")
        if group > 1 and next(iter(updates.fields.values())).shape[1] != 1:
            raise ValueError("fresh groupings group single samples: give updates of one sample each")
        per_epoch = len(updates) // (batch_size * group * world_size)
        if per_epoch < 1:
            what = f"{len(updates)} auxiliary samples" if group > 1 else f"{len(updates)} auxiliary updates"
            unit = f"updates of {group} samples" if group > 1 else "updates"
            raise ValueError(f"only {what}: too few for one batch of {batch_size} {unit} on {world_size} rank(s)")
        super().__init__(per_epoch, seed, rank, world_size, position)
        self.updates, self.batch_size, self.features, self.group = updates, batch_size, features, group
        self._permutation: tuple[int, Tensor] | None = None

    def permutation(self, epoch: int) -> Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            order = torch.randperm(len(self.updates), generator=step_generator(EPOCH_ORDER, self.seed, epoch))
            self._permutation = (epoch, order)
        return self._permutation[1]

    def batch(self, step: int) -> dict[str, Tensor]:
        epoch, i = divmod(step, self.batches_per_epoch)
        if self.group > 1:
            size = self.batch_size * self.group
            start = (i * self.world_size + self.rank) * size
            index = self.permutation(epoch)[start : start + size].view(self.batch_size, self.group)
            # (B * m, 1, ...) single samples -> (B, m, ...) updates
            fields = {name: value[index.reshape(-1)].view(self.batch_size, self.group, *value.shape[2:])
                      for name, value in self.updates.fields.items()}
            batch = {**fields, "index": index}
        else:
            start = (i * self.world_size + self.rank) * self.batch_size
            index = self.permutation(epoch)[start : start + self.batch_size]
            batch = {**{name: value[index] for name, value in self.updates.fields.items()}, "index": index}
        if self.features is not None:
            batch["features"] = self.features(index, step_generator(CACHED_NOISE, self.seed, self.rank, step))
        return batch


class SampledStream(TrainingStream):
    """Batches drawn by `draw(generator)`, with a generator seeded by (seed, rank, step): LTI-P's
    fresh pseudo-data for every batch, reproducible from the step alone."""

    def __init__(self, draw: Callable[[torch.Generator], dict[str, Tensor]], batches_per_epoch: int, seed: int,
                 rank: int = 0, world_size: int = 1, position: Callable[[], int] | None = None) -> None:
        super().__init__(batches_per_epoch, seed, rank, world_size, position)
        self.draw = draw

    def batch(self, step: int) -> dict[str, Tensor]:
        return self.draw(step_generator(PSEUDO_DATA, self.seed, self.rank, step))
