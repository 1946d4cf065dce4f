"""What a federated-learning server observes: client updates, defenses, feature hashing (no Lightning)."""

from datamodules.federated.client import FedSGDClient, per_example_gradients, per_example_gradients_loop
from datamodules.federated.defenses import (
    DEFENSES,
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

__all__ = [
    "DEFENSES", "Defense", "DPSGD", "GaussianNoise", "NoDefense", "Sign", "TopKPruning",
    "FedSGDClient", "per_example_gradients", "per_example_gradients_loop",
    "FeatureHasher", "HashSpec", "murmur3_32", "ParameterSelection", "ObservedUpdates", "UpdatePipeline",
]
