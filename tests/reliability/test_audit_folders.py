"""`lti audit`'s folder holds one audit and proves it (docs/reliability.md, "Audit folders"): the threat
model by content, rounds added on request, attack scores kept per set of attack options, one live audit
per folder, round files checked against their checksums, one line for every fault, client text kept in
the folder, and a huge single-line corpus file tokenised in pieces."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from conftest import REPO  # noqa: E402

from lti.audit.folder import AuditFileDamaged  # noqa: E402
from lti.audit.options import AttackOptions, AuditOptions, FederationOptions  # noqa: E402
from lti.audit.run import Audit  # noqa: E402

TINY = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")


def options(out: Path, rounds: int = 2, threat_model: str = TINY, args=(), **attacks) -> AuditOptions:
    return AuditOptions(threat_model=threat_model, threat_model_args=list(args), out_dir=str(out),
                        federation=FederationOptions(clients=2, rounds=rounds, lr=0.5),
                        attacks=AttackOptions(probe_sequences=0, **attacks), utility_sequences=4)


def run(opts: AuditOptions, said: list | None = None) -> list[dict]:
    return Audit(opts, say=(said.append if said is not None else lambda *_: None)).run()


def cli_args(opts: AuditOptions) -> list[str]:
    fed = opts.federation
    return ["audit", "--threat_model", opts.threat_model, "--out_dir", opts.out_dir, "--federation.clients", str(fed.clients),
            "--federation.rounds", str(fed.rounds), "--federation.lr", str(fed.lr), "--attacks.probe_sequences", "0",
            "--utility_sequences", str(opts.utility_sequences)]


def one_line_exit(argv: list[str], capsys) -> tuple[int, str]:
    from lti.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("lti audit:")]
    assert len(lines) == 1, err
    assert not any("Traceback" in line for line in err), err
    return exit_info.value.code, lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[AuditOptions, Path, list[dict]]:
    out = tmp_path_factory.mktemp("finished") / "audit"
    opts = options(out)
    return opts, out, run(opts)


def copy_of(finished, tmp_path: Path) -> tuple[AuditOptions, Path]:
    opts, out, _ = finished
    copy = tmp_path / "audit"
    shutil.copytree(out, copy)
    return replace(opts, out_dir=str(copy)), copy


def scores_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("attacks-*.json"))


# ---------------------------------------------------------------- 1. the folder knows what it holds
def test_audit_json_records_the_threat_models_resolved_content_and_hashes(finished):
    _, out, _ = finished
    identity = json.loads((out / "audit.json").read_text())
    content = identity["threat_model_content"]
    assert content["data"]["init_args"]["defense"]["class_path"] == "datamodules.federated.NoDefense"
    assert content["data"]["init_args"]["client"]["init_args"]["rank"] == 8
    for key in ("threat_model_sha256", "model_sha256", "client_data_sha256"):
        assert len(identity[key]) == 64
    assert "rounds" not in identity["federation"]


def test_a_resume_after_the_threat_model_was_edited_in_place_is_refused_naming_the_key(tmp_path):
    config = tmp_path / "threat.yaml"
    config.write_text(Path(TINY).read_text())
    out = tmp_path / "audit"
    run(options(out, rounds=1, threat_model=str(config), dager=False))
    config.write_text(Path(TINY).read_text().replace("datamodules.federated.NoDefense", "datamodules.federated.Sign"))
    with pytest.raises(ValueError) as error:
        run(options(out, rounds=2, threat_model=str(config), dager=False))
    assert str(error.value) == (f"{out} holds an audit of another threat model: data.defense.class_path was "
                                "'datamodules.federated.NoDefense', now 'datamodules.federated.Sign'; choose another --out_dir")
    assert not (out / "rounds" / "r002").exists()
    # The same content through an overlay, or from a copy of the config elsewhere: the same threat model.
    config.write_text(Path(TINY).read_text())
    with pytest.raises(ValueError, match="data.client.rank was 8, now 4"):
        run(options(out, rounds=2, threat_model=str(config), args=["--data.client.init_args.rank", "4"], dager=False))
    records = run(options(out, rounds=2, threat_model=TINY, dager=False))
    assert [r["round"] for r in records] == [1, 2]


def test_a_rerun_with_another_lr_names_the_setting_and_both_values(finished, tmp_path, capsys):
    opts, copy = copy_of(finished, tmp_path)
    code, line = one_line_exit([*cli_args(opts), "--federation.lr", "0.25"], capsys)  # the last value counts
    assert code == 2
    assert line == (f"lti audit: error: {copy} holds an audit of another federation: federation.lr was 0.5, now 0.25; "
                    "choose another --out_dir")


def test_an_older_audit_json_without_the_content_still_resumes_and_is_filled_in(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    identity = json.loads((copy / "audit.json").read_text())
    older = {key: identity[key] for key in ("threat_model", "threat_model_args", "federation", "flower_dp")}
    older["federation"]["rounds"] = 2  # as written then
    (copy / "audit.json").write_text(json.dumps(older))
    said = []
    records = run(opts, said)
    assert [r["attacks"]["dager"]["token_acc"] for r in records] == [r["attacks"]["dager"]["token_acc"] for r in finished[2]]
    assert any("written before audit folders recorded the threat model's content" in line for line in said)
    assert json.loads((copy / "audit.json").read_text())["threat_model_content"] == identity["threat_model_content"]
    (copy / "audit.json").write_text(json.dumps({**older, "threat_model_args": ["--data.seq_len", "8"]}))
    with pytest.raises(ValueError, match="another threat model: threat_model_args was"):
        run(opts)


# ---------------------------------------------------------------- 2. rounds can be added
def test_rounds_can_be_added_to_a_finished_audit_and_fewer_are_reported_as_such(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    kept = {name: (copy / "rounds" / "r002" / name).read_bytes() for name in ("after.safetensors", "round.json")}
    more = run(replace(opts, federation=replace(opts.federation, rounds=3)))
    assert [r["round"] for r in more] == [1, 2, 3]
    assert more[2]["utility_before"] == more[1]["utility_after"]  # continued from round 2's aggregate
    assert all((copy / "rounds" / "r002" / name).read_bytes() == data for name, data in kept.items())
    said = []
    fewer = run(replace(opts, federation=replace(opts.federation, rounds=1)), said)
    assert [r["round"] for r in fewer] == [1]
    assert "The folder holds 3 rounds; this report shows rounds 1–1" in (copy / "report.md").read_text()
    assert (copy / "rounds" / "r003" / "round.json").exists()  # nothing removed


# ---------------------------------------------------------------- 3. attack scores kept per option set
def test_a_rerun_with_other_attack_options_adds_its_scores_beside_the_earlier_ones(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    first = scores_files(copy / "rounds" / "r001")
    assert len(first) == 1
    before = first[0].read_bytes()
    again = run(replace(opts, attacks=replace(opts.attacks, dager=False, batched=False)))
    assert all(r["attacks"] == {} for r in again)  # the report is this run's: no attack ran
    assert "(not attacked)" in (copy / "report.md").read_text()
    assert first[0].read_bytes() == before  # the earlier scores, byte for byte
    assert len(scores_files(copy / "rounds" / "r001")) == 2
    stamp = first[0].stat().st_mtime_ns
    back = run(opts)  # the first options again: their scores are reported, not recomputed
    assert [r["attacks"]["dager"]["token_acc"] for r in back] == [r["attacks"]["dager"]["token_acc"] for r in finished[2]]
    assert first[0].stat().st_mtime_ns == stamp


def test_scores_written_before_the_option_files_are_still_used(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    for folder in sorted((copy / "rounds").iterdir()):
        (scores,) = scores_files(folder)
        scores.rename(folder / "attacks.json")  # as written by the previous version
    records = run(opts)
    assert [r["attacks"]["dager"]["token_acc"] for r in records] == [r["attacks"]["dager"]["token_acc"] for r in finished[2]]
    assert scores_files(copy / "rounds" / "r001") == []  # not attacked again


# ---------------------------------------------------------------- 4. one live audit per folder
def test_a_second_audit_into_a_folder_in_use_is_refused_naming_the_pid(finished, tmp_path, capsys):
    opts, copy = copy_of(finished, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom lti.checkpoint_folder import claim\nclaim(sys.argv[1])\n"
         "print('locked', flush=True)\ntime.sleep(120)", str(copy)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, line = one_line_exit(cli_args(opts), capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert line == (f"lti audit: error: audit folder {copy} is in use by process {holder.pid}, a live `lti audit`; wait "
                    "for it, or write elsewhere with --out_dir DIR")
    assert (copy / "report.md").read_bytes() == (Path(finished[1]) / "report.md").read_bytes()  # untouched
    run(opts)  # the lock of the killed holder is taken over


def test_a_start_that_fails_before_its_first_round_leaves_the_folder_as_it_found_it(tmp_path, capsys):
    opts = options(tmp_path / "new", rounds=1, dager=False)
    bad = [*cli_args(opts), "--federation.batch_size", "100000"]
    code, line = one_line_exit(bad, capsys)
    assert code == 2 and "fewer than federation.batch_size=100000" in line
    assert not (tmp_path / "new").exists()  # the folder it created is gone
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    code, _ = one_line_exit([*cli_args(replace(opts, out_dir=str(existing))), "--federation.batch_size", "100000"], capsys)
    assert code == 2
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    assert [r["round"] for r in run(replace(opts, out_dir=str(existing)))] == [1]  # the corrected rerun


# ---------------------------------------------------------------- 5. round files checked
def test_bytes_overwritten_in_a_round_file_are_refused_naming_the_file(finished, tmp_path, capsys):
    opts, copy = copy_of(finished, tmp_path)
    replies = copy / "rounds" / "r002" / "replies.safetensors"
    data = bytearray(replies.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    replies.write_bytes(bytes(data))
    code, line = one_line_exit([*cli_args(opts), "--attacks.dager", "false", "--attacks.samples", "1"], capsys)
    assert code == 2
    assert line == (f"lti audit: error: audit file {replies} does not match its checksum in round.json (changed or "
                    f"damaged after it was written); delete the folder {replies.parent} to run round 2 (and the rounds "
                    "after it) again")
    shutil.rmtree(replies.parent)  # what the line says to do
    records = run(opts)
    assert [r["round"] for r in records] == [1, 2]
    assert replies.read_bytes() == (finished[1] / "rounds" / "r002" / "replies.safetensors").read_bytes()


def test_round_files_recorded_without_checksums_are_read_with_one_warning(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    for folder in (copy / "rounds").iterdir():
        record = json.loads((folder / "round.json").read_text())
        del record["sha256"]
        (folder / "round.json").write_text(json.dumps(record))
    said = []
    run(replace(opts, attacks=replace(opts.attacks, samples=1)), said)  # other options: both rounds read again
    assert sum("recorded without checksums" in line for line in said) == 1


@pytest.mark.parametrize("name", ["after.safetensors", "round.json", "audit.json"])
def test_a_truncated_audit_file_is_one_line_naming_it(finished, tmp_path, capsys, name):
    opts, copy = copy_of(finished, tmp_path)
    path = copy / name if name == "audit.json" else copy / "rounds" / "r002" / name
    os.truncate(path, path.stat().st_size // 2)
    # A resume that adds a round reads round 2's aggregate (and every round.json for the report).
    code, line = one_line_exit([*cli_args(replace(opts, federation=replace(opts.federation, rounds=3)))], capsys)
    assert code == 2
    assert line.startswith(f"lti audit: error: audit file {path} ")
    assert "delete" in line


def test_without_checksums_a_truncated_safetensors_file_is_still_one_line(finished, tmp_path):
    opts, copy = copy_of(finished, tmp_path)
    record = json.loads((copy / "rounds" / "r002" / "round.json").read_text())
    del record["sha256"]
    (copy / "rounds" / "r002" / "round.json").write_text(json.dumps(record))
    after = copy / "rounds" / "r002" / "after.safetensors"
    os.truncate(after, after.stat().st_size // 2)
    with pytest.raises(AuditFileDamaged, match=f"audit file {after} cannot be read"):
        run(replace(opts, federation=replace(opts.federation, rounds=3)))


# ---------------------------------------------------------------- 6. one line everywhere
def test_a_full_disk_mid_audit_is_one_line_exit_1_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    import contextlib

    import lti.audit.run as audit_run

    real = audit_run.atomic_writer

    @contextlib.contextmanager
    def full_in_round_2(path, what="write"):
        with real(path, what) as file:
            if "r002" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            yield file

    monkeypatch.setattr(audit_run, "atomic_writer", full_in_round_2)
    opts = options(tmp_path / "a", rounds=2, dager=False)
    code, line = one_line_exit(cli_args(opts), capsys)
    assert code == 1
    assert line == (f"lti audit: error: disk full: could not write {tmp_path / 'a' / 'rounds' / 'r002' / 'sent.safetensors'}: "
                    f"No space left on device (finished rounds are kept in {opts.out_dir}; a rerun resumes)")
    assert (tmp_path / "a" / "rounds" / "r001" / "round.json").exists()
    assert not [p for p in (tmp_path / "a").rglob("*") if ".tmp-" in p.name]
    monkeypatch.setattr(audit_run, "atomic_writer", real)
    assert [r["round"] for r in run(opts)] == [1, 2]


def test_a_read_only_out_dir_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "readonly"
    out.mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(out)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, line = one_line_exit(cli_args(options(out, dager=False)), capsys)
    assert code == 2
    assert line == f"lti audit: error: out_dir {out} cannot be written (Read-only file system); choose another --out_dir"
    monkeypatch.setattr(os, "open", real_open)
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        out.chmod(0o555)
        try:
            code, line = one_line_exit(cli_args(options(out, dager=False)), capsys)
        finally:
            out.chmod(0o755)
        assert code == 2 and "cannot be written (Permission denied)" in line


@pytest.mark.parametrize("argv, message", [
    (["--federation.lr", "nan"], "lti audit: error: bad value for 'federation.lr': expected float, got nan"),
    (["--attacks.samples", "-1"], "lti audit: error: attacks.samples=-1 must be >= 0 (0: no reconstructions shown)"),
    (["--federation.lrr", "1"], "lti audit: error: unknown option 'federation.lrr' (did you mean 'federation.lr'?); "
                                "`lti audit --help` lists every option"),
])
def test_bad_values_are_one_whole_line(argv, message, tmp_path, capsys):
    code, line = one_line_exit(["audit", "--threat_model", TINY, "--out_dir", str(tmp_path / "a"), *argv], capsys)
    assert code == 2 and line == message
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- 7. client text stays in the run folder
def test_client_text_stays_in_the_run_folder(tmp_path):
    """A clean HOME, XDG cache and LTI cache: after an audit with W&B, no file outside out_dir holds a
    sentence of the clients' (evaluation) text."""
    pytest.importorskip("wandb")
    home, cache, lti_cache, out = (tmp_path / name for name in ("home", "xdg", "lti", "out"))
    for folder in (home, cache, lti_cache):
        folder.mkdir()
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "LTI_", "XDG_"))}
    environment.update(HOME=str(home), XDG_CACHE_HOME=str(cache), LTI_CACHE_DIR=str(lti_cache), HF_HUB_OFFLINE="1",
                       HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TMPDIR=str(home))
    command = [sys.executable, "-m", "lti.cli", *cli_args(options(out, rounds=1, dager=False)), "--wandb", "true"]
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    evaluation = next((out / "corpus_cache").rglob("evaluation.txt"))
    sentences = [line[:80] for line in evaluation.read_text().splitlines() if len(line) > 80][:20]
    assert sentences
    outside = [p for root in (home, cache, lti_cache) for p in root.rglob("*") if p.is_file()]
    for path in outside:
        data = path.read_bytes()
        assert not any(s.encode() in data for s in sentences), f"client text in {path}"
    assert (out / "wandb").is_dir()


# ---------------------------------------------------------------- 8. one huge line
def test_a_huge_single_line_is_tokenised_in_pieces_with_the_same_ids(caplog):
    import logging
    import random

    from datasets import Dataset, DatasetDict

    from datamodules.text.packing import tokenize_splits
    from datamodules.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    words = (REPO / "README.md").read_text().split() + ["  two spaces", "tab\there", "é", "don't", "'s"]
    generator = random.Random(0)
    line = " ".join(generator.choice(words) for _ in range(300_000))  # about 2 MB, one line
    assert len(line) > 1_500_000
    splits = DatasetDict(evaluation=Dataset.from_dict({"text": [line, "a short row"]}))
    with caplog.at_level(logging.INFO, logger="datamodules.text.packing"):
        pieces = tokenize_splits(splits, tokenizer, piece_chars=200_000)["evaluation"]["input_ids"]
    assert pieces[0] == tokenizer(line + "\n")["input_ids"]  # GPT-2's BPE: the same ids as the whole line
    assert pieces[1] == tokenizer("a short row\n")["input_ids"]
    assert any("tokenised in" in record.getMessage() and "pieces" in record.getMessage() for record in caplog.records)
