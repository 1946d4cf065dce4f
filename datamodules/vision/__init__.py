"""Images and tables for vision LTI and SPEAR: offline data sets (no Lightning; their clients are the shared `datamodules.federated` protocols with `ClassificationLoss`)."""

from datamodules.vision.datasets import (
    CIFAR10,
    VISION_DATASETS,
    Adult,
    Digits,
    MNIST5k,
    Split,
    TableColumn,
    VisionData,
    VisionSource,
    load_vision_dataset,
)

__all__ = [
    "VISION_DATASETS", "VisionSource", "VisionData", "Split", "TableColumn", "load_vision_dataset",
    "Digits", "MNIST5k", "Adult", "CIFAR10",
]
