"""Bad input is one line that says what is wrong and how to fix it (docs/reliability.md, "Runs"):
undecodable corpus files, invalid trainer values, unknown class names."""

import pytest

from lti.cli import main


def _error_lines(capsys) -> list[str]:
    """The `lti:` lines of stderr (Lightning's and datasets' progress lines aside), after checking that no
    traceback was printed."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("lti:")]


def _refused(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return _error_lines(capsys)


# ------------------------------------------------------------------------------------------------ input files
ENCODED = {
    # name: (bytes, offset of the first undecodable byte, its line, the likely encoding named)
    "cp1252": ("Fine first line\nna\u00efve caf\u00e9 client text\n".encode("cp1252"), 18, 2, "CP1252"),
    "utf-16": ("Fine first line\nclient text\n".encode("utf-16"), 0, 1, "UTF-16"),
}


@pytest.mark.parametrize("encoding", ENCODED)
def test_an_evaluation_file_that_is_not_utf8_is_named_with_the_byte_offset(make_config, tmp_path, capsys, encoding):
    data, offset, line, named = ENCODED[encoding]
    bad = tmp_path / f"{encoding}.txt"
    bad.write_bytes(data)
    byte = data[offset : offset + 1].hex()
    err = _refused(["test", "--config", str(make_config()), "--data.corpus.init_args.evaluation_files", f"[{bad}]"], capsys)
    assert err == [f"lti: error: corpus file '{bad}' is not UTF-8: byte 0x{byte} at offset {offset} (line {line}) cannot be "
                   f"decoded; it may be {named}: convert it with `iconv -f {named} -t UTF-8 {bad} > {bad}.utf8`"]
    assert not (tmp_path / "ckpt").exists()


def test_the_offset_is_found_past_the_first_read_chunk(tmp_path):
    from datamodules.text.corpora import _first_undecodable

    good = tmp_path / "good.txt"
    good.write_text("fine\n")
    big = tmp_path / "big.txt"
    head = ("x" * 99 + "\n") * 20_000 + "caf"  # 2,000,003 bytes: the bad byte is in the second megabyte
    big.write_bytes(head.encode() + "\u00e9\n".encode("latin-1"))
    error = _first_undecodable([str(good), str(big)])
    assert f"corpus file '{big}' is not UTF-8: byte 0xe9 at offset {len(head)} (line 20001)" in str(error)
    assert _first_undecodable([str(good)]) is None


# ------------------------------------------------------------------------------------------------ trainer values
@pytest.mark.parametrize("option, value, message", [
    ("max_steps", "-5", "lti: error: bad value for 'trainer.max_steps': must be a non-negative integer or -1 (infinite steps). "
                        "You passed in -5."),
    ("max_epochs", "-5", "lti: error: bad value for 'trainer.max_epochs': must be a non-negative integer or -1."),
    ("val_check_interval", "0", "lti: error: bad value for 'trainer.val_check_interval': 0; give a number of steps >= 1 or "
                                "a fraction of an epoch in (0.0, 1.0]"),
    ("check_val_every_n_epoch", "0", "lti: error: bad value for 'trainer.check_val_every_n_epoch': 0; give a number of "
                                     "epochs >= 1, or null to validate by steps only (trainer.val_check_interval)"),
    ("limit_val_batches", "-1", "lti: error: bad value for 'trainer.limit_val_batches': You have passed invalid value -1"),
    ("devices", "0", "lti: error: bad value for 'trainer.devices': `Trainer(devices='0')` value is not a valid input"),
])
def test_an_invalid_trainer_value_is_one_line(make_config, tmp_path, capsys, option, value, message):
    err = _refused(["fit", "--config", str(make_config()), f"--trainer.{option}", value], capsys)
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("*.ckpt"))


# ------------------------------------------------------------------------------------------------ class names
@pytest.mark.parametrize("args, message", [
    (["--data.defense", "GausianNoise"],
     "unknown class 'GausianNoise' for 'data.defense' (did you mean 'GaussianNoise'?); "
     "known: Compose, DPSGD, GaussianNoise, NoDefense, Sign, TopKPruning"),
    (["--data.defense", "datamodules.federated.GausianNoise"],
     "unknown class 'datamodules.federated.GausianNoise' for 'data.defense' (did you mean 'GaussianNoise'?); known: "),
    (["--data.client", "FedSGDClinet"], "unknown class 'FedSGDClinet' for 'data.client' (did you mean 'FedSGDClient'?); known: "),
    (["--model.inverter", "EmbedingInverter"],
     "unknown class 'EmbedingInverter' for 'model.inverter' (did you mean 'EmbeddingInverter'?); known: "),
    (["--trainer.logger", "WandbLoger"], "unknown class 'WandbLoger' for 'trainer.logger' (did you mean 'WandbLogger'?); known: "),
    (["--data", "TextInversionDataModul"],
     "unknown class 'TextInversionDataModul' for 'data' (did you mean 'TextInversionDataModule'?); known: "),
    (["--data.defense", "Bogus"], "unknown class 'Bogus' for 'data.defense'; known: Compose, DPSGD, "),
])
def test_an_unknown_class_name_lists_the_known_ones_with_a_did_you_mean(make_config, capsys, args, message):
    err = _refused(["fit", "--config", str(make_config()), *args], capsys)
    assert len(err) == 1 and err[0].startswith(f"lti: error: {message}"), err


def test_an_unknown_class_path_in_a_yaml_file_too(make_config, tmp_path, capsys):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("data:\n  defense:\n    class_path: datamodules.federated.GausianNoise\n    init_args: {sigma: 0.1}\n")
    err = _refused(["fit", "--config", str(make_config()), "--config", str(overlay)], capsys)
    assert err == ["lti: error: unknown class 'datamodules.federated.GausianNoise' for 'data.defense' (did you mean "
                   "'GaussianNoise'?); known: Compose, DPSGD, GaussianNoise, NoDefense, Sign, TopKPruning"]


def test_registry_names_get_a_did_you_mean():
    from datamodules.federated.defenses import DEFENSES

    with pytest.raises(ValueError) as error:
        DEFENSES.get("sing")
    assert str(error.value) == f"unknown defense 'sing'; allowed: {', '.join(DEFENSES.names())}; did you mean 'sign'?"


def test_a_tsv_corpus_file_that_is_not_utf8_too(tmp_path):
    from datamodules.text.corpora import LocalCorpus

    tsv = tmp_path / "bad.tsv"
    tsv.write_bytes("id\tsentence\n1\tcaf\u00e9 here\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"corpus file '{tsv}' is not UTF-8: byte 0xe9 at offset 17 \(line 2\)"):
        LocalCorpus([str(tsv)], [str(tsv)], format="tsv", text_column="sentence").load()
    good = tmp_path / "good.tsv"
    good.write_text("id\tsentence\n1\tfine here\n")
    with pytest.raises(ValueError, match="no column 'text'"):  # the checks after loading still run
        LocalCorpus([str(good)], [str(good)], format="tsv").load()
