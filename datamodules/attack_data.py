"""What an attack may read from the data side: the declared interface between the DataModules and the attacks.

The learned attacks (`lti.module`, `lti.vision_module`) and the exact-attack callbacks
(`exact.callbacks`) read a DataModule only through these Protocols, never by probing it. Both
DataModules implement them; what a modality lacks has a defined value in `InversionDataModule`
(no tokenizer or sequence length for images, no table columns for text). `require` checks a
DataModule once, before an attack reads it, and names in one line what is missing.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from datamodules.federated.pipeline import UpdatePipeline
from datamodules.inversion_spec import InversionSpec


@runtime_checkable
class AttackData(Protocol):
    """What every attack may read (the exact attacks read only this)."""

    #: The server's observation: global model, client protocol, defense, hash spec; `split(update)` per parameter.
    pipeline: UpdatePipeline
    #: The data side's seed (the learned attacks' step-seeded draws).
    seed: int
    #: m, the samples (text: sequences) of one client update, as the client protocol says (known to the server).
    samples_per_update: int
    #: Tokens per sequence (None: images and tables).
    seq_len: int | None
    #: Decodes token ids (None: images and tables).
    tokenizer: Any | None
    #: Tables: [(column name, 'continuous' | 'discrete', slice of a row)]; empty for text and images.
    table_columns: list[tuple[str, str, slice]]

    def describe(self) -> dict:
        """JSON-safe summary of the threat model."""

    def auxiliary_inputs(self, limit: int) -> Tensor:
        """Up to `limit` of the server's own model inputs (N, ...), a prior (never evaluation data)."""

    def destandardize(self, rows: Tensor) -> Tensor:
        """Tables: standardised rows (..., F) -> original units."""


@runtime_checkable
class TextAttackData(AttackData, Protocol):
    """What the learned text attack reads besides `AttackData`."""

    #: The problem the inverter solves: features, positions, vocabulary, embedding, token counts (after setup).
    inversion_spec: InversionSpec
    #: (m * L,) the per-position majority token of the server's data: the attack-free baseline (after setup).
    majority_tokens: Tensor | None
    #: What the server observes and how (client, defense, observed, hashing, cache).
    observation: Any
    #: Whether evaluation batches carry the defended update (`batch["update"]`).
    keep_eval_updates: bool
    #: Whether training batches carry it too (set by an attack that reads it; on-the-fly updates only).
    keep_train_updates: bool

    def decode(self, ids: Tensor, mask: Tensor | None = None) -> list[str]:
        """(U, m * L) token ids -> U texts."""


@runtime_checkable
class ImageAttackData(AttackData, Protocol):
    """What the learned image/table attack reads besides `AttackData`."""

    #: 'image' or 'table'.
    kind: str
    #: k, hashed features per update.
    num_features: int
    #: (m, *input_shape): what the inverter reconstructs per update.
    output_shape: tuple[int, ...]
    #: The mean auxiliary input: the attack-free baseline (after setup).
    mean_input: Tensor | None


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods a Protocol declares, its bases' first."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        declared = list(cls.__dict__.get("__annotations__", {}))
        declared += [name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")]
        names += [name for name in declared if name not in names]
    return names


def missing_members(datamodule: object, protocol: type = AttackData) -> list[str]:
    """What `datamodule` lacks of `protocol` (looked up without running properties, so before setup too)."""
    missing = []
    for name in protocol_members(protocol):
        try:
            inspect.getattr_static(datamodule, name)
        except AttributeError:
            missing.append(name)
    return missing


def require(datamodule: object, protocol: type = AttackData, reader: str = "the attack") -> None:
    """Raise one line when `datamodule` does not implement `protocol` (what `reader` reads)."""
    if datamodule is None:
        raise ValueError(f"{reader} reads the data side from a DataModule ({protocol.__name__}); none was given")
    missing = missing_members(datamodule, protocol)
    if missing:
        raise ValueError(f"{reader} reads {protocol.__name__} from the DataModule, but {type(datamodule).__name__} "
                         f"lacks {', '.join(missing)} (datamodules/attack_data.py)")
