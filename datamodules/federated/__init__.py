"""What a federated-learning server observes: client updates, defenses, feature hashing (no Lightning)."""

from datamodules.federated.accounting import dp_epsilon
from datamodules.federated.client import (
    CLIENT_PROTOCOLS,
    ClientProtocol,
    FedSGDClient,
    per_example_gradients,
    per_example_gradients_loop,
)
from datamodules.federated.defenses import (
    DEFENSES,
    Compose,
    Defense,
    DPSGD,
    GaussianNoise,
    NoDefense,
    Sign,
    TopKPruning,
)
from datamodules.federated.hashing import FeatureHasher, HashSpec, murmur3_32
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.pipeline import ObservedUpdates, UpdatePipeline
from datamodules.federated.presets import LORA_TARGETS, PARTIAL_PRESETS, preset_patterns
from datamodules.federated.protocols import FedAvgClient, LoRAClient

__all__ = [
    "CLIENT_PROTOCOLS", "ClientProtocol", "FedAvgClient", "LoRAClient", "dp_epsilon",
    "LORA_TARGETS", "PARTIAL_PRESETS", "preset_patterns", "Compose",
    "DEFENSES", "Defense", "DPSGD", "GaussianNoise", "NoDefense", "Sign", "TopKPruning",
    "FedSGDClient", "per_example_gradients", "per_example_gradients_loop",
    "FeatureHasher", "HashSpec", "murmur3_32", "ParameterSelection", "ObservedUpdates", "UpdatePipeline",
]
