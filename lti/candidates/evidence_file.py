"""Candidate evidence files: the span test's candidates of many simulated updates, computed once.

A threat model whose updates are deterministic (no dropout, B = 1: one update per text block) gives
the same candidates each time a block comes round, so the server computes them once per block
(`build`) and the pointer trains on them for as many epochs as it likes. A file is safetensors
(`ids`, `scores`, `coefficients`, `truth`, and with `second_layer` each update's second-layer gradient
`second_spaces` for the `second_layer` decoding rule) with the threat model in its metadata; it is
written whole and renamed into place. `load` refuses files of different threat models or candidate counts;
files whose threat models are recorded in different versions (`CONTENT_FORMAT`) are compared by config.

A file proves what it holds: its metadata records a SHA-256 digest of every tensor (`checksums`, the
algorithm of the observation caches' checksums, `datamodules.cache_folder`; per tensor, since the
digests live inside the file), checked on every load; a file written before them is read with one
warning. Loading also checks what the readers index with: `ids` and `truth` within the vocabulary,
scores and coefficients finite, the shapes the metadata gives. Every refusal is one line that names the
file (and the way out: rebuild it with `lti candidates build ... --overwrite`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor
from tqdm.auto import tqdm

from datamodules.atomic_files import atomic_writer
from exact.span_evidence import CandidateEvidence, SecondLayerEvidence, SpanEvidence

log = logging.getLogger(__name__)

FORMAT = "lti-candidates-1"
#: The tensors' digests: SHA-256 cut to 128 bits, as the observation caches' chunks.
CHECKSUM_ALGORITHM = "sha256-128"
#: Metadata that must agree between the files one run reads.
SHARED = ("format", "config", "overrides", "count", "seq_len", "coefficient_width", "vocab_size", "hash_spec")
#: The version of what a file records by content (`threat_model`, `text`). Raise it when a code change alters
#: that record for an unchanged config (a threat-model class gains a default argument): files of the two
#: versions are then compared by config and overrides, as files without content are, instead of being
#: refused as other threat models. A file written before the version existed is of version "0".
CONTENT_FORMAT = "1"


def differing(a: dict, b: dict, keys: Sequence[str] = SHARED) -> list[str]:
    """The metadata `keys` in which two files (or a file and a pointer's training files) differ. Files that both
    store their threat model by content (`threat_model`), in one `content_format`, are compared by it, not by the
    config's path and overrides: an edited config file changes the content, a moved one does not."""
    same_format = a.get("content_format", "0") == b.get("content_format", "0")
    by_content = "threat_model" in a and "threat_model" in b and same_format
    if by_content:  # the threat model and the text the blocks come from (corpus, packing)
        keys = [k for k in keys if k not in ("config", "overrides")] + ["threat_model", "text"]
    return [k for k in keys if a.get(k) != b.get(k)]


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


def tensor_checksum(tensor: Tensor) -> str:
    """The digest of a tensor's dtype, shape and bytes (what `checksums` records per tensor)."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:32]


def checksums(tensors: dict[str, Tensor]) -> str:
    """The `checksums` metadata entry of a file holding `tensors` (JSON)."""
    return json.dumps({"algorithm": CHECKSUM_ALGORITHM, "tensors": {k: tensor_checksum(v) for k, v in sorted(tensors.items())}})


def _rebuild(path: str | Path, metadata: dict) -> str:
    config, split = metadata.get("config", "CONFIG"), metadata.get("split", "SPLIT")
    return f"rebuild it with `lti candidates build --config {config} --split {split} ... --out {path} --overwrite`"


def _check_checksums(path: str | Path, metadata: dict, tensors: dict[str, Tensor]) -> None:
    """Refuses a file whose tensors differ from the digests recorded when it was written (one line); a file
    written before checksums existed is read with a warning."""
    name = f"candidate evidence file {path}"
    if "checksums" not in metadata:
        log.warning(f"{name} has no checksums (written by an older version): read unverified; {_rebuild(path, metadata)} "
                    "to add them")
        return
    try:
        recorded = json.loads(metadata["checksums"])
        algorithm, digests = recorded["algorithm"], recorded["tensors"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{name} has unreadable checksums ({type(error).__name__}); {_rebuild(path, metadata)}") from None
    if algorithm != CHECKSUM_ALGORITHM:
        raise ValueError(f"{name} has checksums of an unknown kind ({algorithm!r}); {_rebuild(path, metadata)}")
    for key, tensor in tensors.items():
        if key not in digests:
            raise ValueError(f"{name} holds a tensor {key!r} its checksums do not list; {_rebuild(path, metadata)}")
        if tensor_checksum(tensor) != digests[key]:
            raise ValueError(f"{name}: tensor {key!r} does not match its checksum (changed or damaged after it was "
                             f"written); {_rebuild(path, metadata)}")
    missing = sorted(set(digests) - set(tensors))
    if missing:
        raise ValueError(f"{name} lacks the tensor(s) {', '.join(missing)} its checksums list; {_rebuild(path, metadata)}")


def _check_values(path: str | Path, metadata: dict, tensors: dict[str, Tensor]) -> None:
    """Refuses tensors the readers would index or score wrongly: shapes other than the metadata's, token
    ids outside the vocabulary, scores or coefficients that are not finite (one line naming the tensor)."""
    name = f"candidate evidence file {path}"
    try:
        vocab, count, seq_len, width = (int(metadata[k]) for k in ("vocab_size", "count", "seq_len", "coefficient_width"))
    except (KeyError, ValueError) as error:
        raise ValueError(f"{name} has unreadable metadata ({type(error).__name__}: {error}); {_rebuild(path, metadata)}") from None
    rows = tensors["ids"].shape[0]
    shapes = {"ids": (rows, count), "scores": (rows, count), "coefficients": (rows, count, width), "truth": (rows, seq_len)}
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{name}: tensor {key!r} has shape {tuple(tensors[key].shape)}, its metadata says {shape}; "
                             f"{_rebuild(path, metadata)}")
    if "second_spaces" in tensors and (tensors["second_spaces"].dim() != 3 or tensors["second_spaces"].shape[0] != rows):
        raise ValueError(f"{name}: tensor 'second_spaces' has shape {tuple(tensors['second_spaces'].shape)}, not one "
                         f"(d, width) matrix per row of its {rows}; {_rebuild(path, metadata)}")
    for key in ("ids", "truth"):
        tensor = tensors[key]
        if tensor.is_floating_point() or tensor.is_complex():
            raise ValueError(f"{name}: tensor {key!r} holds {tensor.dtype}, not token ids; {_rebuild(path, metadata)}")
        if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab):
            bad = int(tensor.min()) if int(tensor.min()) < 0 else int(tensor.max())
            raise ValueError(f"{name}: tensor {key!r} holds token id {bad}, outside the vocabulary [0, {vocab}); "
                             f"{_rebuild(path, metadata)}")
    for key in ("scores", "coefficients", "second_spaces"):
        if key in tensors and not bool(torch.isfinite(tensors[key]).all()):
            bad = int((~torch.isfinite(tensors[key])).sum())
            raise ValueError(f"{name}: tensor {key!r} holds {bad} values that are not finite (nan or inf); "
                             f"{_rebuild(path, metadata)}")


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
    for option, value in (("count", count), ("batch", batch), ("limit", limit)):
        if value is not None and value < 1:
            raise ValueError(f"--{option} {value} must be >= 1")
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
        if limit > len(blocks):  # else fewer blocks than asked, silently
            raise ValueError(f"--limit {limit}: the {split} split has {len(blocks)} blocks from block {skip} on")
        blocks, mask = blocks[:limit], mask[:limit]
    if shards > len(blocks):
        raise ValueError(f"--shards {shards}: more files than the {len(blocks)} blocks to write")
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
                "hash_spec": json.dumps(pipeline.spec.to_dict()),
                # the whole threat model by content: what the file means does not change with its config file
                "threat_model": json.dumps(data.threat_model.to_dict(), sort_keys=True),
                "content_format": CONTENT_FORMAT,
                "text": json.dumps(_text_of(data), sort_keys=True, default=str)}
    for path, index in zip(paths, torch.arange(len(blocks)).tensor_split(len(paths))):
        path.parent.mkdir(parents=True, exist_ok=True)
        where = {"first_block": str(skip + int(index[0]) if len(index) else skip)}  # this file's first block in the split
        shard = {k: v[index].contiguous() for k, v in tensors.items()}
        with atomic_writer(path) as f:
            f.write(save(shard, metadata={**metadata, **where, "checksums": checksums(shard)}))
    return paths


def _text_of(data) -> dict:
    """The corpus and packing the blocks come from, as the config gave them (the threat model holds neither)."""
    recorded = getattr(data, "recorded_config", None) or {}
    return {"corpus": recorded.get("corpus", type(data.corpus).__name__), "packing": data.packing}


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
        _check_checksums(path, metadata, tensors)
        _check_values(path, metadata, tensors)
        first = first or (path, metadata)
        differ = differing(metadata, first[1], (*SHARED, "split"))
        if differ:
            raise ValueError(f"{path} and {first[0]} differ in {', '.join(differ)}: files of one threat model and split only")
        if "first_block" in metadata:
            tensors["blocks"] = int(metadata["first_block"]) + torch.arange(tensors["ids"].shape[0])
        parts.append(tensors)
    # what every file has (the second-layer gradients, the block indices of files that record them)
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if all(k in p for p in parts)}
    return EvidenceSet(cat["ids"].long(), cat["scores"].float(), cat["coefficients"], cat["truth"].long(),
                       {k: v for k, v in first[1].items() if k not in ("first_block", "checksums")},
                       cat.get("blocks"), cat.get("second_spaces"))


def check_pointer_fits(data: EvidenceSet, trained_on: dict, tail: int, name: str) -> None:
    """Refuse evidence a pointer cannot be evaluated on (`trained_on`: its metadata, `load_pointer`):
    candidates built otherwise than its training candidates, or blocks of its own training split that it
    trained on (`tail`: the rows taken from the end of the files, a fit's --holdout)."""
    differ = differing(trained_on, data.metadata)
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
