"""Images and tables for vision LTI and SPEAR: offline data sets and the vision client pipeline (no Lightning)."""

from datamodules.vision.datasets import (
    VISION_DATASETS, Adult, CIFAR10, Digits, MNIST5k, Split, TableColumn, VisionData, VisionSource, load_vision_dataset,
)
from datamodules.vision.pipeline import (
    VisionClient, VisionFedAvgClient, VisionUpdatePipeline, classification_loss, per_sample_gradients, per_sample_gradients_loop,
)

__all__ = [
    "VISION_DATASETS", "VisionSource", "VisionData", "Split", "TableColumn", "load_vision_dataset",
    "Digits", "MNIST5k", "Adult", "CIFAR10",
    "VisionClient", "VisionFedAvgClient", "VisionUpdatePipeline", "classification_loss", "per_sample_gradients", "per_sample_gradients_loop",
]
