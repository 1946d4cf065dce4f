"""Candidate evidence files (`lti candidates`) keep what they promise (issue 43): a file whose bytes changed
after it was written, or that holds token ids outside the vocabulary, is refused in one line naming the
file and the way out; counts beyond the files (`--tail`, `--limit`) and other values that would be run
silently are refused in one line too."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lti.candidates.evidence_file import CONTENT_FORMAT, build, checksums, load
from lti.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")
BLOCKS = 32


@pytest.fixture(scope="module")
def evidence(tmp_path_factory) -> Path:
    """One evidence file of 32 blocks of the tiny LoRA Llama's evaluation split (8 candidates each)."""
    path = tmp_path_factory.mktemp("evidence") / "eval.safetensors"
    build(TINY, "evaluation", path, count=8, limit=BLOCKS, batch=32)
    return path


@pytest.fixture
def copy(evidence, tmp_path) -> Path:
    target = tmp_path / "eval.safetensors"
    target.write_bytes(evidence.read_bytes())
    return target


def _contents(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _rewrite(path: Path, change, keep_checksums: bool = True) -> None:
    """The file rewritten with `change(tensors)` applied, its checksums recomputed (as a writer with a bug
    would write it), or dropped (a file written before checksums existed)."""
    tensors, metadata = _contents(path)
    change(tensors)
    metadata.pop("checksums", None)
    if keep_checksums:
        metadata["checksums"] = checksums(tensors)
    save_file(tensors, str(path), metadata=metadata)


def _evaluate(capsys, *args: str) -> str:
    """`lti candidates evaluate ...` refused: its stderr, checked to be one line with exit code 2."""
    with pytest.raises(SystemExit) as error:
        main(["candidates", "evaluate", *args])
    err = capsys.readouterr().err
    assert error.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lti candidates: error: "), err
    return lines[0]


def _pointer_args(path: Path) -> list[str]:
    # the file is read before the pointer: a pointer that does not exist is never reached
    return ["--pointer", str(path.parent / "no_pointer.safetensors"), "--eval", f"[{path}]"]


def test_a_written_file_records_checksums_and_loads_clean(evidence, caplog):
    _, metadata = _contents(evidence)
    recorded = json.loads(metadata["checksums"])
    assert recorded["algorithm"] == "sha256-128"
    assert sorted(recorded["tensors"]) == ["coefficients", "ids", "scores", "truth"]
    with caplog.at_level(logging.WARNING):
        data = load([evidence])
    assert len(data) == BLOCKS and "checksums" not in data.metadata and not caplog.records


def test_a_2kb_overwrite_in_an_evidence_files_coefficients_is_one_line(copy, capsys):
    header = struct.unpack("<Q", copy.read_bytes()[:8])[0]
    begin, end = json.loads(copy.read_bytes()[8 : 8 + header])["coefficients"]["data_offsets"]
    assert end - begin > 4096
    start = 8 + header + (begin + end) // 2
    data = bytearray(copy.read_bytes())
    # half-precision values of the size of real coefficients: nothing but the checksum can tell
    data[start : start + 2048] = torch.full((1024,), 0.25, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    copy.write_bytes(bytes(data))
    line = _evaluate(capsys, *_pointer_args(copy))
    assert f"candidate evidence file {copy}: tensor 'coefficients' does not match its checksum" in line
    assert "--overwrite" in line and "lti candidates build --config" in line


def test_truth_out_of_range_is_one_line(copy, capsys):
    _rewrite(copy, lambda t: t["truth"].__setitem__((3, 2), 50257 + 5))
    line = _evaluate(capsys, *_pointer_args(copy))
    assert f"candidate evidence file {copy}: tensor 'truth' holds token id 50262, outside the vocabulary [0, 50257)" in line


@pytest.mark.parametrize("value", [50257, -1], ids=["beyond", "negative"])
def test_ids_out_of_vocabulary_are_one_line(copy, capsys, value):
    _rewrite(copy, lambda t: t["ids"].__setitem__((0, 0), value))
    line = _evaluate(capsys, *_pointer_args(copy))
    assert f"tensor 'ids' holds token id {value}, outside the vocabulary" in line and str(copy) in line


def test_coefficients_that_are_not_finite_are_one_line(copy):
    _rewrite(copy, lambda t: t["coefficients"].__setitem__((1, 1, 0), float("nan")))
    with pytest.raises(ValueError, match=r"tensor 'coefficients' holds 1 values that are not finite"):
        load([copy])


def test_a_file_without_checksums_is_read_with_one_warning_and_still_range_checked(copy, caplog):
    _rewrite(copy, lambda t: None, keep_checksums=False)
    with caplog.at_level(logging.WARNING):
        assert len(load([copy])) == BLOCKS
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "has no checksums (written by an older version): read unverified" in warnings[0]
    _rewrite(copy, lambda t: t["truth"].__setitem__((0, 0), 10**6), keep_checksums=False)
    with pytest.raises(ValueError, match="tensor 'truth' holds token id 1000000"):
        load([copy])


def test_a_tensor_of_another_shape_than_the_metadata_says_is_one_line(copy):
    _rewrite(copy, lambda t: t.__setitem__("ids", t["ids"][:, :4].contiguous()))
    with pytest.raises(ValueError, match=r"tensor 'ids' has shape \(32, 4\), its metadata says \(32, 8\)"):
        load([copy])


@pytest.mark.parametrize("args, message", [
    (["--tail", "1000"], "--tail 1000: {file} hold(s) 32 blocks"),
    (["--limit", "0"], "--limit 0 must be >= 1"),
    (["--tail", "0"], "--tail 0 must be >= 1"),
    (["--limit", "33"], "--limit 33: {file} hold(s) 32 blocks"),
    (["--tail", "8", "--limit", "9"], "--limit 9: the last 8 of {file} hold(s) 8 blocks"),
    (["--beam", "0"], "--beam 0 must be >= 1"),
], ids=["tail-beyond", "limit-0", "tail-0", "limit-beyond", "limit-beyond-tail", "beam-0"])
def test_counts_beyond_the_file_or_zero_are_one_line(evidence, capsys, args, message):
    line = _evaluate(capsys, *_pointer_args(evidence), *args)
    assert message.format(file=evidence) in line


@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "--limit 0 must be >= 1"),
    (["--count", "0"], "--count 0 must be >= 1"),
    (["--batch", "0"], "--batch 0 must be >= 1"),
    (["--shards", "0"], "--shards 0 must be >= 1"),
    (["--limit", "-4"], "--limit -4 must be >= 1"),
], ids=["limit-0", "count-0", "batch-0", "shards-0", "limit-negative"])
def test_build_refuses_values_it_would_run_silently(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as error:
        main(["candidates", "build", "--config", TINY, "--out", str(tmp_path / "x.safetensors"), *args])
    err = capsys.readouterr().err
    assert error.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not any(tmp_path.iterdir())


def test_build_refuses_a_limit_beyond_the_split_and_more_shards_than_blocks(tmp_path):
    with pytest.raises(ValueError, match=r"--limit 100000: the evaluation split has \d+ blocks from block 0 on"):
        build(TINY, "evaluation", tmp_path / "x.safetensors", limit=100_000)
    with pytest.raises(ValueError, match="--shards 4: more files than the 2 blocks to write"):
        build(TINY, "evaluation", tmp_path / "x.safetensors", limit=2, shards=4)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--max_steps", "0"], "--max_steps 0 must be >= 1"),
    (["--heads", "3"], "--hidden 256 must be a multiple of --heads 3"),
    (["--dropout", "1.5"], "--dropout 1.5 must be in [0, 1)"),
    (["--lr", ".nan"], "--lr nan must be finite and > 0"),  # YAML's NaN, as jsonargparse reads the value
    (["--weight_decay", "-1"], "--weight_decay -1.0 must be finite and >= 0"),
    (["--holdout", "-2"], "--holdout -2 must be >= 0"),
], ids=["max_steps-0", "heads", "dropout", "lr-nan", "weight_decay", "holdout"])
def test_fit_refuses_values_before_writing_anything(evidence, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as error:
        main(["candidates", "fit", "--train", f"[{evidence}]", "--eval", f"[{evidence}]", "--out_dir", str(tmp_path / "fit"), *args])
    err = capsys.readouterr().err
    assert error.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "fit").exists()


def test_files_record_their_threat_model_by_content_and_are_compared_by_it(evidence, tmp_path):
    """A file means what it was built from, not what its config file says today: a moved config gives files that
    load together; an edited one (other adapters) gives files that are refused together."""
    from datamodules.threat_model import ThreatModel

    _, metadata = _contents(evidence)
    assert json.loads(metadata["threat_model"]) == ThreatModel.from_config(TINY).to_dict()
    moved = tmp_path / "moved.yaml"
    moved.write_text(Path(TINY).read_text())
    build(str(moved), "evaluation", tmp_path / "moved.safetensors", count=8, limit=4, batch=4)
    assert len(load([evidence, tmp_path / "moved.safetensors"])) == BLOCKS + 4
    edited = tmp_path / "edited.yaml"
    edited.write_text(Path(TINY).read_text().replace("rank: 8", "rank: 4"))
    build(str(edited), "evaluation", tmp_path / "edited.safetensors", count=8, limit=4, batch=4)
    with pytest.raises(ValueError, match="differ in .*threat_model"):
        load([evidence, tmp_path / "edited.safetensors"])
    # The same threat model over other text (another corpus) is refused too: the blocks would not be one split.
    other_text = tmp_path / "other_text.yaml"
    other_text.write_text(Path(TINY).read_text().replace(
        "    class_path: datamodules.text.EmbeddedCorpus",
        "    class_path: datamodules.text.LocalCorpus\n"
        f"    init_args: {{auxiliary_files: [{REPO / 'README.md'}], evaluation_files: [{REPO / 'docs' / 'usage.md'}]}}"))
    build(str(other_text), "evaluation", tmp_path / "other_text.safetensors", count=8, limit=4, batch=4)
    assert json.loads(_contents(tmp_path / "other_text.safetensors")[1]["threat_model"]) == json.loads(metadata["threat_model"])
    with pytest.raises(ValueError, match="differ in text"):
        load([evidence, tmp_path / "other_text.safetensors"])


def _edit_metadata(path: Path, change) -> None:
    """The file rewritten with `change(metadata)` applied; its tensors, and so its checksums, unchanged."""
    tensors, metadata = _contents(path)
    change(metadata)
    save_file(tensors, str(path), metadata=metadata)


def test_files_of_another_content_format_are_compared_by_config_and_of_one_format_by_content(evidence, copy, tmp_path):
    """A threat-model class that gains a default argument changes what a file records by content for an unchanged
    config: an older file (no `content_format`) of the same config still loads with a new one; files of one
    format are still compared by content."""
    _, metadata = _contents(evidence)
    assert metadata["content_format"] == CONTENT_FORMAT

    def older(metadata: dict) -> None:  # written before the version existed, and before `gguf_file` was an argument
        del metadata["content_format"]
        content = json.loads(metadata["threat_model"])
        del content["target"]["init_args"]["gguf_file"]
        metadata["threat_model"] = json.dumps(content, sort_keys=True)

    _edit_metadata(copy, older)
    assert len(load([evidence, copy])) == len(load([copy, evidence])) == 2 * BLOCKS
    # compared as files without content are: by the config and overrides they were built from
    _edit_metadata(copy, lambda metadata: metadata.update(config=str(tmp_path / "other.yaml")))
    with pytest.raises(ValueError, match="differ in config: "):
        load([evidence, copy])

    def other_rank(metadata: dict) -> None:
        content = json.loads(metadata["threat_model"])
        content["client"]["init_args"]["rank"] = 4
        metadata["threat_model"] = json.dumps(content, sort_keys=True)

    same_format = tmp_path / "rank4.safetensors"
    same_format.write_bytes(evidence.read_bytes())
    _edit_metadata(same_format, other_rank)
    with pytest.raises(ValueError, match="differ in threat_model: "):
        load([evidence, same_format])
