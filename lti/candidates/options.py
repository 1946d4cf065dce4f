"""The options of `lti candidates build|fit|evaluate`, one dataclass per command; they become each
command's `--help` (`lti.command_line`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from lti.command_line import Real

#: The decoding rules of `lti.candidates.decoding.DECODERS`, as a type the parser checks.
Decoder = Literal["argmax", "assign", "lm", "second_layer"]


def _at_least(options: object, minimum: int, *names: str) -> None:
    """Refuses integer options below `minimum` (None: not given, allowed)."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name} {value} must be >= {minimum}")


@dataclass
class BuildOptions:
    """Simulate updates and store their span-test candidates.

    One update per block of the split under the config's threat model (its target, client, defense);
    each update's candidates go to a .safetensors file.

    Args:
        config: An `lti fit` config: its threat model makes the updates.
        out: The .safetensors file to write.
        split: The DataModule split whose blocks become updates.
        count: Candidates per update (K).
        limit: Only LIMIT blocks (the split's first, after `skip`); None: all of them.
        skip: Start at the split's block SKIP (e.g. a fit's held-out tail).
        second_layer: Also store each update's second-layer gradient (for the second_layer decoding rule).
        batch: Updates simulated at once.
        device: The device the updates are simulated on.
        shards: Split the output into this many files.
        overwrite: Replace existing files of the same names.
        overrides: `lti fit` overrides of the config, e.g. `[--data.client.init_args.rank, "16"]`.
    """

    config: str
    out: str
    split: str = "auxiliary"
    count: int = 32
    limit: int | None = None
    skip: int = 0
    second_layer: bool = False
    batch: int = 64
    device: str = "cpu"
    shards: int = 1
    overwrite: bool = False
    overrides: list[str] = field(default_factory=list)

    def check(self) -> None:
        _at_least(self, 1, "count", "limit", "batch", "shards")
        _at_least(self, 0, "skip")


@dataclass
class FitOptions:
    """Train the pointer and evaluate it on held-out candidates.

    Writes `curve.csv`, checkpoints, the final weights (`pointer.safetensors`) and `result.json` (the
    last evaluation, never the best) to `out_dir`.

    Args:
        train: Training candidate files (the server's text).
        eval: Evaluation candidate files (held-out client text).
        out_dir: The run's folder.
        max_steps: Training steps.
        max_time: DD:HH:MM:SS: stop earlier.
        val_every: Evaluate (and checkpoint) every this many steps.
        batch_size: Blocks per training step.
        hidden: The pointer's width (a multiple of `heads`).
        layers: The pointer's transformer layers.
        heads: Attention heads per layer.
        dropout: Dropout, in [0, 1).
        lr: Learning rate.
        weight_decay: AdamW's weight decay.
        accelerator: Lightning's accelerator (cpu, gpu, ...).
        precision: Lightning's precision (32-true, bf16-mixed, ...).
        seed: Seed of the weights and the batches.
        ckpt_path: Resume from this checkpoint.
        overwrite: Replace an earlier run's files in `out_dir`.
        holdout: Keep the training files' last HOLDOUT blocks out of training (to choose decoding settings on).
    """

    train: list[str]
    eval: list[str]
    out_dir: str
    max_steps: int = 10_000
    max_time: str | None = None
    val_every: int = 500
    batch_size: int = 128
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    dropout: Real = 0.1
    lr: Real = 3e-4
    weight_decay: Real = 0.01
    accelerator: str = "cpu"
    precision: str = "32-true"
    seed: int = 0
    ckpt_path: str | None = None
    overwrite: bool = False
    holdout: int = 0

    def check(self) -> None:
        _at_least(self, 1, "max_steps", "val_every", "batch_size", "hidden", "layers", "heads")
        _at_least(self, 0, "holdout")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise ValueError(f"--dropout {self.dropout} must be in [0, 1)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr {self.lr} must be finite and > 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight_decay {self.weight_decay} must be finite and >= 0")


@dataclass
class EvaluateOptions:
    """Score a trained pointer on candidate files, decoding rule by rule.

    One JSON row per rule (`lti.candidates.decoding`) and weight on stdout.

    Args:
        pointer: pointer.safetensors from `lti candidates fit`.
        eval: Candidate files to score.
        tail: Only the files' last TAIL blocks (a fit's `holdout`; at most the files' blocks).
        limit: Then only the first LIMIT blocks (at most those left).
        decode: Decoding rules: argmax, assign (each candidate once), lm (a beam search adding the global
            model's log-probability), second_layer (that search checked by the second-layer span test).
        lm_weight: Weights of the global model's log-probability (lm, second_layer).
        second_weight: Weights of the second-layer span test's score (second_layer).
        beam: Beam width of lm and second_layer.
        out: A JSON file of the rows.
    """

    pointer: str
    eval: list[str]
    tail: int | None = None
    limit: int | None = None
    decode: list[Decoder] = field(default_factory=lambda: ["argmax"])
    lm_weight: list[Real] = field(default_factory=lambda: [0.5])
    second_weight: list[Real] = field(default_factory=lambda: [1.0])
    beam: int = 8
    out: str | None = None

    def check(self) -> None:
        _at_least(self, 1, "tail", "limit", "beam")
        bad = [w for w in (*self.lm_weight, *self.second_weight) if not (math.isfinite(w) and w >= 0)]
        if bad:
            raise ValueError(f"--lm_weight and --second_weight must be finite and >= 0, not {bad[0]}")
