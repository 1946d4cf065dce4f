"""The candidate pointer's trained weights as safetensors (no code runs on load), with its sizes and the
threat model of its training candidates in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

from datamodules.atomic_files import atomic_writer
from lti.candidates.pointer import CandidatePointer


def save_pointer(pointer: CandidatePointer, path: str | Path, evidence_metadata: dict, train_blocks: int,
                 holdout: int, train_blocks_end: int | None = None) -> None:
    """The trained weights (the fixed embedding is not among them) with the sizes, the threat model and
    the training split's blocks used (the first `train_blocks`; the `holdout` after them were not;
    where the files record block indices, every block trained on is before `train_blocks_end`) in the
    metadata, written whole and renamed into place."""
    metadata = {"sizes": json.dumps(pointer.sizes), "coefficient_width": str(pointer.coefficient_width),
                "positions": str(pointer.positions), "train_blocks": str(train_blocks), "holdout": str(holdout),
                **({"train_blocks_end": str(train_blocks_end)} if train_blocks_end is not None else {}),
                **{f"evidence.{k}": v for k, v in evidence_metadata.items() if k != "blocks"}}
    state = {k: v.detach().cpu().contiguous() for k, v in pointer.state_dict().items()}
    with atomic_writer(path) as f:
        f.write(save(state, metadata=metadata))


def load_pointer(path: str | Path, embedding: Tensor) -> tuple[CandidatePointer, dict]:
    """A pointer saved by `save_pointer` (safetensors: no code runs on load), and its evidence metadata."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"pointer weights {path} do not exist (lti candidates fit writes pointer.safetensors)")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:  # safetensors' own error types are not ValueErrors
        raise ValueError(f"{path} is not a readable safetensors file: {str(error).splitlines()[0]}") from None
    if "sizes" not in metadata:
        raise ValueError(f"{path} holds no candidate pointer (no sizes in its metadata)")
    pointer = CandidatePointer(embedding, int(metadata["coefficient_width"]), int(metadata["positions"]),
                               **json.loads(metadata["sizes"]))
    try:
        pointer.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(f"{path} does not fit a pointer of its own sizes: {str(error).splitlines()[0]}") from None
    evidence = {k[len("evidence."):]: v for k, v in metadata.items() if k.startswith("evidence.")}
    evidence.update({k: metadata[k] for k in ("train_blocks", "holdout", "train_blocks_end") if k in metadata})
    return pointer.to(embedding.device).eval(), evidence
