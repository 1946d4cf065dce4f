"""Candidate evidence files: the span test's candidates of many simulated updates, computed once.

A threat model whose updates are deterministic (no dropout, B = 1: one update per text block) gives
the same candidates each time a block comes round, so the server computes them once per block
(`build`) and the pointer trains on them for as many epochs as it likes. A file is safetensors
(`ids`, `scores`, `coefficients`, `truth`, and with `second_layer` each update's second-layer gradient
`second_spaces` for the `second_layer` decoding rule) with the threat model in its metadata; it is
written whole and renamed into place. `load` refuses files of different threat models or candidate counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor
from tqdm.auto import tqdm

from exact.span_evidence import CandidateEvidence, SecondLayerEvidence, SpanEvidence
from lti.atomic_files import atomic_writer

FORMAT = "lti-candidates-1"
#: Metadata that must agree between the files one run reads.
SHARED = ("format", "config", "overrides", "count", "seq_len", "coefficient_width", "vocab_size", "hash_spec")


@dataclass
class EvidenceSet:
    ids: Tensor  #: (N, K) int64
    scores: Tensor  #: (N, K) float32
    coefficients: Tensor  #: (N, K, width) float16
    truth: Tensor  #: (N, L) int64: the true tokens, read for the loss and scores only
    metadata: dict
    #: (N,) each row's block index in its split (files that do not record where they start: None)
    blocks: Tensor | None = None
    #: (N, d, width) float32: each update's second-layer gradient (files built with `second_layer`), else None
    second_spaces: Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def rows(self, index: slice) -> EvidenceSet:
        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]
        return EvidenceSet(self.ids[index], self.scores[index], self.coefficients[index], self.truth[index],
                           self.metadata, part(self.blocks), part(self.second_spaces))

    def head(self, count: int) -> EvidenceSet:
        return self.rows(slice(0, count))

    def tail(self, count: int) -> EvidenceSet:
        return self.rows(slice(len(self) - count, len(self)))


def shard_paths(out: str | Path, shards: int) -> list[Path]:
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out} must end in .safetensors")
    if shards == 1:
        return [out]
    return [out.with_name(f"{out.stem}.{i:02d}-of-{shards:02d}.safetensors") for i in range(shards)]


def build(config: str, split: str, out: str | Path, count: int = 32, limit: int | None = None,
          overrides: Sequence[str] = (), batch: int = 64, device: str = "cpu", shards: int = 1,
          overwrite: bool = False, skip: int = 0, second_layer: bool = False) -> list[Path]:
    """Simulate the update of each of `limit` blocks of `split` (from block `skip` on) under the `lti fit`
    config's threat model and store its `count` candidates (and, with `second_layer`, its second-layer
    gradient). Returns the files written; existing files of the same names are refused before any work
    unless `overwrite`."""
    from lti.trainer_cli import instantiate  # the CLI layer builds the threat model from a config

    if shards < 1:
        raise ValueError(f"--shards {shards} must be >= 1")
    if skip < 0:
        raise ValueError(f"--skip {skip} must be >= 0")
    paths = shard_paths(out, shards)
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{existing[0]} exists: choose another --out, or --overwrite")
    _, data = instantiate(config, list(overrides))
    if data.samples_per_update != 1:
        raise ValueError(f"candidate evidence reads updates of one sequence; the config's client sends "
                         f"{data.samples_per_update} (data.client samples_per_update)")
    data.setup("fit")
    pipeline = data.pipeline.to(device)
    blocks, mask = data.blocks(split)
    if skip >= len(blocks):
        raise ValueError(f"--skip {skip}: the {split} split has {len(blocks)} blocks")
    blocks, mask = blocks[skip:], mask[skip:]
    if limit is not None:
        blocks, mask = blocks[:limit], mask[:limit]
    if not bool(mask.all()):
        raise ValueError(f"the {split} split has padded blocks; candidate evidence needs full blocks")
    evidence = SpanEvidence(pipeline.target, list(pipeline.names), data.seq_len, data.seq_len)
    candidates = CandidateEvidence(evidence, count)
    second = SecondLayerEvidence(pipeline.target, list(pipeline.names), data.seq_len) if second_layer else None
    parts: dict[str, list[Tensor]] = {"ids": [], "scores": [], "coefficients": [], **({"second_spaces": []} if second else {})}
    for start in tqdm(range(0, len(blocks), batch), desc=f"candidates of {split}", unit="batch"):
        ids = blocks[start : start + batch].to(device)
        update = pipeline.split(pipeline({"input_ids": ids[:, None]}, keep_update=True).update)
        found = candidates(update)
        parts["ids"].append(found.ids.to(torch.int32).cpu())
        parts["scores"].append(found.scores.cpu())
        parts["coefficients"].append(found.coefficients.half().cpu())
        if second is not None:
            parts["second_spaces"].append(second.input_spaces(update).cpu())
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    tensors["truth"] = blocks.to(torch.int32)
    metadata = {"format": FORMAT, "config": str(config), "overrides": json.dumps(list(overrides)), "split": split,
                "count": str(count), "seq_len": str(data.seq_len), "vocab_size": str(evidence.inputs.vocab_size),
                "coefficient_width": str(tensors["coefficients"].shape[-1]), "blocks": str(len(blocks)),
                # what determines the updates (observed parameters and the global model's weights), as the
                # learned inverter's checkpoints record it: the audit compares it with its own
                "hash_spec": json.dumps(pipeline.spec.to_dict())}
    for path, index in zip(paths, torch.arange(len(blocks)).tensor_split(len(paths))):
        path.parent.mkdir(parents=True, exist_ok=True)
        where = {"first_block": str(skip + int(index[0]) if len(index) else skip)}  # this file's first block in the split
        with atomic_writer(path) as f:
            f.write(save({k: v[index].contiguous() for k, v in tensors.items()}, metadata={**metadata, **where}))
    return paths


def load(paths: Sequence[str | Path]) -> EvidenceSet:
    """The files' candidates, concatenated; a one-line error for a missing file, another format or
    files of different threat models."""
    if not paths:
        raise ValueError("no candidate evidence files given")
    parts, first = [], None
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"candidate evidence file {path} does not exist (lti candidates build writes it)")
        try:
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata() or {}
                names = [k for k in ("ids", "scores", "coefficients", "truth", "second_spaces") if k in f.keys()]
                tensors = {k: f.get_tensor(k) for k in names} if metadata.get("format") == FORMAT else None
        except Exception as error:  # safetensors' own error types are not ValueErrors
            raise ValueError(f"{path} is not a readable safetensors file: {str(error).splitlines()[0]}") from None
        if tensors is None:
            raise ValueError(f"{path} is not a candidate evidence file (format {metadata.get('format')!r})")
        missing = [k for k in ("ids", "scores", "coefficients", "truth") if k not in tensors]
        if missing:
            raise ValueError(f"{path} lacks the tensor(s) {', '.join(missing)} of a candidate evidence file")
        first = first or (path, metadata)
        differ = [k for k in (*SHARED, "split") if metadata.get(k) != first[1].get(k)]
        if differ:
            raise ValueError(f"{path} and {first[0]} differ in {', '.join(differ)}: files of one threat model and split only")
        if "first_block" in metadata:
            tensors["blocks"] = int(metadata["first_block"]) + torch.arange(tensors["ids"].shape[0])
        parts.append(tensors)
    # what every file has (the second-layer gradients, the block indices of files that record them)
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if all(k in p for p in parts)}
    return EvidenceSet(cat["ids"].long(), cat["scores"].float(), cat["coefficients"], cat["truth"].long(),
                       {k: v for k, v in first[1].items() if k != "first_block"}, cat.get("blocks"), cat.get("second_spaces"))


def check_pointer_fits(data: EvidenceSet, trained_on: dict, tail: int, name: str) -> None:
    """Refuse evidence a pointer cannot be evaluated on (`trained_on`: its metadata, `load_pointer`):
    candidates built otherwise than its training candidates, or blocks of its own training split that it
    trained on (`tail`: the rows taken from the end of the files, a fit's --holdout)."""
    differ = [k for k in SHARED if trained_on.get(k) != data.metadata.get(k)]
    if differ:
        raise ValueError(f"the pointer was trained on candidates that differ from {name} in {', '.join(differ)}")
    if trained_on.get("split") == data.metadata["split"]:
        _check_held_out(data, trained_on, tail, name)


def _check_held_out(data: EvidenceSet, trained_on: dict, tail: int, name: str) -> None:
    end = trained_on.get("train_blocks_end", trained_on.get("train_blocks"))
    if data.blocks is not None and end is not None:
        if int(data.blocks.min()) < int(end):
            raise ValueError(f"{name} holds blocks {int(data.blocks.min())}.. of the pointer's training split, which "
                             f"trained on its blocks before {end}: evaluate later blocks only")
        return
    holdout = int(trained_on.get("holdout", 0))
    if not 0 < tail <= holdout:
        # the training split's last `holdout` blocks were kept out of training; the rest were trained on
        raise ValueError(f"{name} is the pointer's training split: evaluate its held-out blocks only "
                         f"(--tail at most its --holdout, {holdout})")
