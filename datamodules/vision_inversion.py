"""The LightningDataModule of image/table inversion: data set -> client updates -> defense -> hashed features.

The image counterpart of `TextInversionDataModule`: it owns everything the server knows (global
model, client protocol, defense, hasher) in `pipeline` (the `UpdatePipeline` with the classification
loss) and computes the
observed updates on the batch's device in `on_after_batch_transfer`. Training batches are the
server's auxiliary data (the data set's `train` split); validation and test batches are held-out
client data (`val` / `test` splits) and additionally carry the defended update (`batch["update"]`)
for exact attacks such as SPEAR. Batch keys:

    inputs (U, m, C, H, W) or (U, m, F)   labels (U, m)   index (U,)   features (U, k)   update (U, D), eval only

Inputs and labels travel in the batch for the client's loss (the client knows its labels), the
inverter's loss and the metrics; the attack itself sees `features` (LTI) or `update` (exact attacks).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jsonargparse import lazy_instance
from torch import Tensor

from datamodules.federated import ClassificationLoss, FedSGDClient
from datamodules.inversion_data import InversionDataModule, deprecated
from datamodules.registry import materialize
from datamodules.targets.vision import FCNN, VisionTarget
from datamodules.vision import VISION_DATASETS, VisionData, load_vision_dataset


class ImageInversionDataModule(InversionDataModule):
    train_split = prior_split = "train"
    eval_splits = {"val": "val", "test": "test"}

    def __init__(
        self,
        dataset: str = "digits",
        target: VisionTarget = lazy_instance(FCNN, input_shape=(1, 8, 8)),
        samples_per_update: int | None = None,
        client_mode: Literal["train", "eval"] | None = None,
        **kwargs,
    ) -> None:
        """
        Args:
            dataset: `digits` (8x8, offline), `mnist5k` (28x28, offline), `adult` (table, offline) or
                `cifar10` (32x32x3, Hugging Face hub).
            target: The global model; its `input_shape` must match the data set (default: SPEAR's
                6-layer ReLU FCNN for 8x8 digits). The paper's LTI setting is `LeNet` on CIFAR-10.
            samples_per_update: Deprecated: use client.init_args.samples_per_update.
            client_mode: Deprecated: use client.init_args.mode.
            **kwargs: What the server observes and the sizes, shared with every modality
                (`InversionDataModule`: client, defense, observed, hashing, cache, batch_size, ...).
        """
        super().__init__(**kwargs)
        VISION_DATASETS.get(dataset)  # an unknown name fails here, listing the allowed ones
        target = materialize(target)
        self.dataset_name = dataset
        if samples_per_update is not None or client_mode is not None:
            self._apply_deprecated_client_shortcuts(samples_per_update, client_mode)
        self._build_pipeline(target, ClassificationLoss())
        self.data: VisionData | None = None
        self.mean_input: Tensor | None = None  # the mean auxiliary input, the attack-free baseline (setup)

    def _apply_deprecated_client_shortcuts(self, samples_per_update: int | None, client_mode: str | None) -> None:
        """The old `samples_per_update` / `client_mode` shortcuts of a FedSGD client (one release more)."""
        if samples_per_update is not None:
            deprecated("samples_per_update", "client.init_args.samples_per_update")
        if client_mode is not None:
            deprecated("client_mode", "client.init_args.mode")
        client = self.observation.client
        if type(client) is FedSGDClient and client.describe() == FedSGDClient().describe():  # the default client
            client = FedSGDClient(client_mode or "train", samples_per_update or 1)
            self.observation = dataclasses.replace(self.observation, client=client)
        else:
            given = {"samples_per_update": samples_per_update, "client_mode": client_mode}
            clients = {"samples_per_update": client.samples_per_update, "client_mode": client.mode}
            old_defaults = {"samples_per_update": 1, "client_mode": "train"}  # as before: these count as not given
            disagree = [f"data.{key}={value!r}" for key, value in given.items()
                        if value not in (None, old_defaults[key], clients[key])]
            if disagree:
                raise ValueError(f"{' and '.join(disagree)} disagree with the client {client!r}; set them on the client only")

    # ---------------------------------------------------------------- data preparation
    @property
    def kind(self) -> str:
        return self.data.kind if self.data is not None else "image"

    @property
    def table_columns(self) -> list[tuple[str, str, slice]]:
        """Tables: [(column name, 'continuous' | 'discrete', slice of the row)]; empty for images."""
        return self.data.column_spec if self.data is not None else []

    def destandardize(self, rows: Tensor) -> Tensor:
        """Tables: standardised rows (..., F) -> original units (one-hot coordinates unchanged)."""
        if self.data is None:
            raise RuntimeError("call setup() before de-standardising rows")
        return self.data.destandardize(rows)

    def prepare_data(self) -> None:
        if self.dataset_name == "cifar10":
            load_vision_dataset(self.dataset_name)  # downloads once, on one process

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        self.data = load_vision_dataset(self.dataset_name)
        shape = tuple(self.target.input_shape)
        if self.data.input_shape != shape:
            raise ValueError(
                f"data set {self.dataset_name!r} has inputs {list(self.data.input_shape)} but the target expects "
                f"{list(shape)}; set data.target.init_args.input_shape to {list(self.data.input_shape)}"
            )
        if int(self.data.splits["train"].labels.max()) >= self.target.num_classes:
            raise ValueError(f"data set {self.dataset_name!r} has {self.data.num_classes} classes but the target only {self.target.num_classes}")
        s = self.data.splits
        self._splits = {
            "train": self._as_updates(self.train_samples, True, "train", inputs=s["train"].inputs, labels=s["train"].labels),
            "val": self._as_updates(self.eval_samples, False, inputs=s["val"].inputs, labels=s["val"].labels),
            "test": self._as_updates(self.eval_samples, False, inputs=s["test"].inputs, labels=s["test"].labels),
        }
        # The attack-free baseline: the mean input of the server's auxiliary data.
        self.mean_input = s["train"].inputs.mean(dim=0)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """What the inverter reconstructs per update: (m, *input_shape)."""
        return (self.samples_per_update, *self.target.input_shape)

    @property
    def num_features(self) -> int:
        return self.pipeline.spec.num_bins

    def _describe_data(self) -> dict:
        return {"dataset": self.dataset_name}
