"""What a federated-learning server observes: client updates, defenses, feature hashing (no Lightning)."""

from datamodules.federated.accounting import dp_epsilon
from datamodules.federated.defenses import (
    DEFENSES,
    DPSGD,
    Compose,
    Defense,
    GaussianNoise,
    NoDefense,
    Sign,
    TopKPruning,
)
from datamodules.federated.hashing import FeatureHasher, Hashing, HashSpec, murmur3_32
from datamodules.federated.losses import CLIENT_LOSSES, ClassificationLoss, ClientLoss, NextTokenLoss
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.pipeline import ObservedUpdates, UpdatePipeline
from datamodules.federated.protocols import (
    CLIENT_PROTOCOLS,
    ClientProtocol,
    FedAvgClient,
    FedSGDClient,
    LoRAClient,
    Observation,
)
from datamodules.targets.architectures import LORA_TARGETS, PARTIAL_PRESETS, preset_patterns

__all__ = [
    "CLIENT_PROTOCOLS", "ClientProtocol", "FedAvgClient", "LoRAClient", "dp_epsilon",
    "LORA_TARGETS", "PARTIAL_PRESETS", "preset_patterns", "Compose",
    "DEFENSES", "Defense", "DPSGD", "GaussianNoise", "NoDefense", "Sign", "TopKPruning",
    "FedSGDClient", "Observation", "CLIENT_LOSSES", "ClientLoss", "NextTokenLoss", "ClassificationLoss",
    "FeatureHasher", "Hashing", "HashSpec", "murmur3_32", "ParameterSelection", "ObservedUpdates", "UpdatePipeline",
]
