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

from typing import Literal

from jsonargparse import lazy_instance

from datamodules.federated import (
    ClassificationLoss,
    ClientProtocol,
    Defense,
    FedSGDClient,
    Hashing,
    NoDefense,
    ParameterSelection,
)
from datamodules.inversion_data import InversionDataModule, check_sizes
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
        samples_per_update: int = 1,
        client_mode: Literal["train", "eval"] = "train",
        client: ClientProtocol | None = None,
        defense: Defense = lazy_instance(NoDefense),
        observed: ParameterSelection = lazy_instance(ParameterSelection),
        hash_fraction: float = 0.1,
        hash_bins: int | None = None,
        hash_seed: int = 0,
        hash_signed: bool = False,
        batch_size: int = 64,
        train_samples: int | None = None,
        eval_samples: int | None = 1000,
        keep_eval_updates: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        observation_cache: str | None = None,
        rebuild_observation_cache: bool = False,
    ) -> None:
        """
        Args:
            dataset: `digits` (8x8, offline), `mnist5k` (28x28, offline), `adult` (table, offline) or
                `cifar10` (32x32x3, Hugging Face hub).
            target: The global model; its `input_shape` must match the data set (default: SPEAR's
                6-layer ReLU FCNN for 8x8 digits). The paper's LTI setting is `LeNet` on CIFAR-10.
            samples_per_update: Labelled samples m in one client update (FedSGD: mean gradient over m).
            client_mode: `train` or `eval` mode of the target while the client computes its gradient.
            client: The client protocol, when not FedSGD: e.g. `FedAvgClient` (E local epochs of
                SGD, sends the weight delta). It carries its own samples per update and mode; leave
                `samples_per_update` and `client_mode` at their defaults or equal to its values.
            defense: Client-side defense (default: none); the same registry as for text.
            observed: Which parameters the server observes (default: all).
            hash_fraction: Hashed features k as a fraction of the observed dimension.
            hash_bins: Exact k; overrides `hash_fraction`.
            hash_seed: Seed of the mmh3 feature hash.
            hash_signed: Multiply every coordinate by a hashed +-1 sign before summing.
            batch_size: Client updates per batch.
            train_samples: Use at most this many auxiliary (training-split) samples (None: all).
            eval_samples: Evaluate on the first this many held-out samples (None: all).
            keep_eval_updates: Put the defended update into evaluation batches (needed by exact attacks).
            num_workers: DataLoader workers of the evaluation loaders (training batches are an index or a
                draw made in the main process, so that a resumed run continues exactly; the update
                computation runs in the main process too).
            seed: Seed of the grouping of auxiliary samples into updates.
            observation_cache: Folder of cached training observations (deterministic client; no
                defense, sign, pruning or Gaussian noise), computed once and read from disk every
                epoch (datamodules/observation_cache.py). None: computed on the fly.
            rebuild_observation_cache: Rebuild a cache built for other observations (else refused).
        """
        super().__init__()
        check_sizes(batch_size, train_samples, eval_samples)
        VISION_DATASETS.get(dataset)  # an unknown name fails here, listing the allowed ones
        target, defense, observed = map(materialize, (target, defense, observed))
        self.dataset_name = dataset
        client = materialize(client)
        # jsonargparse carries a compatible `client` over from the default (text) DataModule when a
        # config switches `data.class_path`: a default FedSGD client counts as "not given".
        if client is None or (type(client) is FedSGDClient and client.describe() == FedSGDClient().describe()):
            client = FedSGDClient(client_mode, samples_per_update)
        elif samples_per_update not in (1, client.samples_per_update) or client_mode not in ("train", client.mode):
            raise ValueError(
                f"samples_per_update={samples_per_update} / client_mode={client_mode!r} disagree with the client "
                f"{client!r}; set them on the client only"
            )
        self._build_pipeline(
            target, ClassificationLoss(), client, defense, observed, Hashing(hash_fraction, hash_bins, hash_seed, hash_signed),
            batch_size, train_samples, eval_samples, keep_eval_updates, num_workers, seed,
            observation_cache, rebuild_observation_cache,
        )
        self.data: VisionData | None = None

    # ---------------------------------------------------------------- data preparation
    @property
    def kind(self) -> str:
        return self.data.kind if self.data is not None else "image"

    @property
    def table_columns(self) -> list[tuple[str, str, slice]]:
        """Tables: [(column name, 'continuous' | 'discrete', slice of the row)]; empty for images."""
        return self.data.column_spec if self.data is not None else []

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
            "train": self._as_updates(self.train_samples, True, inputs=s["train"].inputs, labels=s["train"].labels),
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
        return {"dataset": self.dataset_name, "samples_per_update": self.samples_per_update}
