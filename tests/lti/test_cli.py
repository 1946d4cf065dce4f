"""End-to-end runs of the `lti` CLI on tiny configs (in-process: one Lightning import for all)."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO

from lti.cli import main


def _metrics(root: Path, stage: str) -> dict:
    return json.loads((root / f"{stage}_metrics.json").read_text())


def test_fit_test_predict_write_results_and_secure_checkpoints(make_config, tmp_path):
    config = make_config()
    main(["fit", "--config", str(config)])
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.exists()
    assert ckpt.is_symlink() and ckpt.resolve() == tmp_path / "ckpt" / "step4.ckpt"  # one full copy, not two
    state = torch.load(ckpt, weights_only=True)  # tensors and plain data only
    assert state["lti"]["hash_spec"]["num_bins"] > 0 and state["lti"]["setting"]["target"] == "Transformer3"

    main(["test", "--config", str(config), "--ckpt_path", str(ckpt)])
    root = tmp_path / "run"
    result = _metrics(root, "test")
    metrics = result["metrics"]
    for key in ("test/lti/token_acc", "test/lti/rouge1", "test/lti/rouge2", "test/lti/rougeL", "test/baseline/token_acc"):
        assert 0.0 <= metrics[key] <= 1.0, key
    samples = [json.loads(line) for line in (root / "test_samples.jsonl").read_text().splitlines()]
    assert len(samples) == result["num_updates"] == 8
    assert {"reference", "lti", "lti_token_acc", "lti_rouge1"} <= set(samples[0])
    assert samples[0]["reference"].startswith("Held out line 0")
    # The file's aggregate equals the mean of the per-sample scores (same updates, same decoding).
    assert metrics["test/lti/rouge1"] == pytest.approx(sum(s["lti_rouge1"] for s in samples) / len(samples), abs=1e-5)
    assert (root / "val_metrics.json").exists()  # validation during fit

    main(["predict", "--config", str(config), "--ckpt_path", str(ckpt)])
    predictions = (root / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 8 and "reconstruction" in json.loads(predictions[0])


def test_validate_without_checkpoint_reports_the_untrained_inverter_as_untrained(make_config, tmp_path, capsys):
    main(["validate", "--config", str(make_config(**{"results.print_table": True}))])
    result = _metrics(tmp_path / "run", "val")
    assert "val/lti/token_acc" in result["metrics"] and "val/baseline/token_acc" in result["metrics"]
    assert result["notes"][0].startswith("no checkpoint was loaded: the inverter is untrained")
    out = capsys.readouterr().out
    assert "val results (8 updates, untrained inverter)" in out
    assert "  untrained inverter: " in out and "LTI reconstruction" not in out
    assert "DataLoader 0" not in out  # the results table replaces Lightning's copy of it
    main(["predict", "--config", str(make_config())])
    assert "lti: note: no --ckpt_path: these predictions come from an untrained inverter" in capsys.readouterr().out


def _dager_overlay(make_config):
    # DAGER needs two attention layers; 8 tokens per update stay below d = 16.
    config = make_config(**{"trainer.max_steps": 1, "data.target.init_args.num_layers": 2, "results.print_table": True})
    return ["--config", str(config), "--config", str(REPO / "configs/exact/dager.yaml")]


def test_validate_with_an_exact_attack_and_no_checkpoint_evaluates_the_exact_attack_alone(make_config, tmp_path, capsys):
    main(["validate", *_dager_overlay(make_config)])
    out = capsys.readouterr().out
    assert "lti: note: no --ckpt_path, so no trained inverter to evaluate: DAGER alone" in out
    assert "  DAGER reconstruction: 'Held out line 0" in out and "LTI reconstruction" not in out
    result = _metrics(tmp_path / "run", "val")
    alone = result["metrics"]
    assert alone["val/dager/exact_fraction"] == 1.0
    assert not any(key.startswith(("val/lti/", "val/loss")) for key in alone)  # no untrained inverter
    samples = [json.loads(line) for line in (tmp_path / "run" / "val_samples.jsonl").read_text().splitlines()]
    assert len(samples) == result["num_updates"] == 8 and samples[0]["reference"] == samples[0]["dager"]
    assert not any("lti" in s for s in samples)

    # With a checkpoint both attacks are evaluated; the attack-free baseline is the one reported alone.
    main(["fit", *_dager_overlay(make_config)])
    capsys.readouterr()
    main(["validate", *_dager_overlay(make_config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    out = capsys.readouterr().out
    assert "  LTI reconstruction  : " in out and "  DAGER reconstruction: 'Held out line 0" in out
    both = _metrics(tmp_path / "run", "val")["metrics"]
    assert "val/lti/token_acc" in both and both["val/dager/exact_fraction"] == 1.0
    assert both["val/baseline/token_acc"] == alone["val/baseline/token_acc"]


def test_a_fit_shorter_than_its_validation_interval_ends_with_a_validation(make_config, tmp_path, capsys):
    config = make_config(**{"trainer.max_steps": 3, "trainer.val_check_interval": 4, "results.print_table": True,
                            "curve.path": str(tmp_path / "curve.csv")})
    main(["fit", "--config", str(config)])
    assert _metrics(tmp_path / "run", "val")["global_step"] == 3
    out = capsys.readouterr().out
    assert "val results (8 updates)" in out
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3
    # A last step that validates anyway validates once.
    main(["fit", "--config", str(make_config(**{"trainer.val_check_interval": 2, "curve.path": str(tmp_path / "curve2.csv"),
                                                "checkpoint.dirpath": str(tmp_path / "ckpt2")}))])
    assert [line.split(",")[0] for line in (tmp_path / "curve2.csv").read_text().splitlines()[1:]] == ["2", "4"]


def test_a_fit_says_where_its_checkpoints_are_and_prints_no_known_noise(make_config, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"project": "lti-test", "offline": True, "save_dir": str(tmp_path / "wandb")}}
    config = make_config(**{"trainer.logger": logger, "trainer.enable_progress_bar": True})
    main(["fit", "--config", str(config)])
    import wandb

    wandb.finish()
    out, err = capfd.readouterr()
    folder = tmp_path / "ckpt"
    assert re.search(rf"lti: checkpoints in {re.escape(str(folder))}: step4.ckpt \([\d.]+ kB\), last.ckpt -> step4.ckpt; "
                     rf"`--ckpt_path {re.escape(str(folder / 'last.ckpt'))}` tests or resumes this run", out)
    assert "Training steps" in out and "4/4" in out  # the progress bar counts steps up to max_steps
    for noise in ("Tip:", "litlogger", "anonymous", "Epoch 0/-2", "v_num", "LeafSpec"):
        assert noise not in out + err, noise


def test_checkpoint_from_another_hash_spec_is_rejected(make_config, tmp_path, capsys):
    config = make_config(**{"trainer.max_steps": 1, "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--data.hashing.bins", "7"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    trained_bins = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["lti"]["hash_spec"]["num_bins"]
    assert err[-1] == (f"lti: error: checkpoint was trained on other observed updates (num_bins: checkpoint {trained_bins}, "
                       "now 7); use the same target, observed parameters and hash settings")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.defense", "GaussianNoise", "--data.defense.sigma", "-1"], "gaussian noise sigma=-1.0 must be a finite number >= 0"),
        (["--data.defense", "TopKPruning", "--data.defense.fraction_removed", "1.0"], "pruning fraction_removed=1.0 is outside [0, 1)"),
        (["--data.seq_len", "9"], "sequence length 9 exceeds the target model's 8 positions"),
        (["--data.corpus.auxiliary_files", "[/no/such.txt]"], "corpus file '/no/such.txt' does not exist"),
        (["--data.target.init_args.vocab_size", "1000"], "tokenizer 'embedded-gpt2' has 50257 tokens but the target model's vocabulary has 1000"),
    ],
)
def test_bad_input_gives_one_line_and_writes_no_checkpoint(make_config, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(make_config()), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_unknown_defense_class_is_named_in_the_error(make_config, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(make_config()), "--data.defense", "Bogus"])
    assert "Bogus" in capsys.readouterr().err


def test_lti_p_trains_on_pseudo_data(make_config, tmp_path):
    config = make_config(**{"data.training_data": "pseudo", "data.pseudo_batches_per_epoch": 2, "trainer.max_steps": 2,
                            "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


def test_wandb_offline_run_is_written(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"project": "lti-test", "offline": True, "save_dir": str(tmp_path / "wandb")}}
    config = make_config(**{"trainer.logger": logger, "trainer.max_steps": 2, "trainer.val_check_interval": 2})
    main(["fit", "--config", str(config)])
    import wandb

    wandb.finish()
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("run-*.wandb"))
    assert list(runs[0].glob("files/media/table/val/samples*.table.json"))


def _is_audit_config(path) -> bool:
    return "threat_model" in (yaml.safe_load(path.read_text()) or {})


# Every `lti` config (grid files under configs/matrix/ are not `lti` configs: tests/test_matrix.py loads them;
# nor are audit configs, which tests/lti/test_audit.py parses).
@pytest.mark.parametrize("config", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")
                                          if p.parent.name != "matrix" and not _is_audit_config(p)))
def test_every_config_parses(config, capsys):
    # Overlays need their run under them: vision protocols, the paper's defense rows, the recipe's cells.
    bases = {"configs/vision/protocols/": "configs/vision/lti_digits.yaml", "configs/paper/defenses/": "configs/paper/lti_wikitext103.yaml",
             "configs/reproduction/lti/": "configs/reproduction/lti.yaml", "configs/reproduction/lti_p/": "configs/reproduction/lti_p.yaml",
             "configs/audit/first_layers": "configs/audit/inverter_smollm2_lora.yaml"}
    base = next((["--config", str(REPO / run)] for folder, run in bases.items() if config.startswith(folder)), [])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *base, "--config", str(REPO / config), "--print_config"])
    assert exit_info.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)
    assert "data" in parsed and "model" in parsed
    if config.startswith("configs/vision/protocols/"):  # the overlay's client replaces the base's FedSGD one
        expected = yaml.safe_load((REPO / config).read_text())["data"]["client"]  # the one overlay shape
        assert parsed["data"]["init_args"]["client"]["class_path"] == expected["class_path"]


@pytest.mark.parametrize("base", ["configs/lti.yaml", "configs/lti_p.yaml"])
@pytest.mark.parametrize("defense", sorted(p.name for p in (REPO / "configs" / "defenses").glob("*.yaml")))
def test_each_attack_composes_with_each_defense(base, defense, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / base), "--config", str(REPO / "configs" / "defenses" / defense), "--print_config"])
    parsed = yaml.safe_load(capsys.readouterr().out)
    data = parsed["data"]["init_args"]  # model and data are chosen by class_path (text inversion by default)
    assert parsed["data"]["class_path"] == "datamodules.text_inversion.TextInversionDataModule"
    assert data["training_data"] == ("pseudo" if "lti_p" in base else "auxiliary")
    assert data["defense"]["class_path"].startswith("datamodules.federated.")


@pytest.mark.parametrize("base", ["configs/quickstart.yaml", "configs/lti.yaml", "configs/lti_p.yaml"])
@pytest.mark.parametrize("protocol", sorted(p.name for p in (REPO / "configs" / "protocols").glob("*.yaml")))
def test_each_attack_composes_with_each_client_protocol(base, protocol, capsys):
    overlay = REPO / "configs" / "protocols" / protocol
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / base), "--config", str(overlay), "--config", str(REPO / "configs" / "defenses" / "dpsgd.yaml"), "--print_config"])
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    data = data.get("init_args", data)  # the data module may be given by class_path (subclass mode)
    expected = yaml.safe_load(overlay.read_text())["data"]["client"]
    assert data["client"]["class_path"] == expected["class_path"]
    for key, value in expected["init_args"].items():  # the overlay wins over the base's FedSGD init_args
        if not isinstance(value, dict):
            assert data["client"]["init_args"][key] == value, key
    assert data["defense"]["class_path"] == "datamodules.federated.DPSGD"


def test_cosine_schedule_with_warmup_decays_to_zero_at_max_steps(make_config, tmp_path):
    config = make_config(**{"model.scheduler": "cosine", "model.warmup_steps": 1, "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 4
    assert state["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(0.0, abs=1e-12)
    assert state["lr_schedulers"][0]["base_lrs"][0] == pytest.approx(1e-3)


def test_halfway_drop_schedule_divides_the_lr_by_ten_from_half_of_the_steps(make_config, tmp_path):
    from lti.module import SCHEDULES

    assert [SCHEDULES["halfway_drop"](p) for p in (0.0, 0.49, 0.5, 1.0)] == [1.0, 1.0, 0.1, 0.1]
    config = make_config(**{"model.scheduler": "halfway_drop", "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 4
    assert state["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(1e-4)


@pytest.mark.parametrize("attack", ["lti", "lti_p"])
def test_paper_configs_are_the_papers_schedule_with_its_learning_rate_per_defense(attack, capsys):
    lrs = {"none": 1e-3, "sign": 1e-5, "prune": 1e-3, "gauss": 1e-4}
    for defense, lr in lrs.items():
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(REPO / f"configs/paper/{attack}_wikitext103.yaml"),
                  "--config", str(REPO / f"configs/paper/defenses/{defense}.yaml"), "--print_config"])
        parsed = yaml.safe_load(capsys.readouterr().out)
        model, data = parsed["model"]["init_args"], parsed["data"]["init_args"]
        assert model["lr"] == lr and model["scheduler"] == "halfway_drop"
        assert parsed["trainer"]["max_epochs"] == 100 and parsed["trainer"]["check_val_every_n_epoch"] == 1
        assert data["train_samples"] == 180_135 and data["eval_samples"] == 1000 and data["batch_size"] == 64
        assert data["corpus"]["init_args"]["evaluation_split"] == "validation"
        assert data["training_data"] == ("pseudo" if attack == "lti_p" else "auxiliary")
        if attack == "lti_p":
            assert data["pseudo_batches_per_epoch"] == 180_135 // 64


@pytest.mark.parametrize("args, message", [
    (["--data.seq_len", "4"], "lti: error: checkpoint was trained for positions per update (sequence length x sequences per update) 8, "
                              "this run has 4; use the checkpoint's data.seq_len and data.client samples_per_update"),
    (["--model.inverter.init_args.hidden", "16"], "lti: error: checkpoint's inverter.trunk.0.weight has shape (32, "),
])
def test_a_checkpoint_for_other_inverter_shapes_is_one_line_and_writes_nothing(make_config, tmp_path, capsys, args, message):
    config = make_config(**{"trainer.max_steps": 1, "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), *args])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("lti:")]
    assert len(err) == 1 and err[0].startswith(message)
    assert not (tmp_path / "run" / "test_metrics.json").exists()


def test_testing_under_another_defense_than_trained_is_said_once_and_recorded(make_config, tmp_path, capsys):
    config = make_config(**{"trainer.max_steps": 1, "trainer.limit_val_batches": 0})
    main(["fit", "--config", str(config)])
    main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
          "--data.defense", "datamodules.federated.Sign"])
    out = capsys.readouterr().out
    assert out.count("lti: note: the inverter was trained under defense none; it is evaluated under this run's defense") == 1
    setting = _metrics(tmp_path / "run", "test")["setting"]
    assert setting["defense"] == {"name": "sign"} and setting["trained_under"] == {"defense": {"name": "none"}}
    # Same threat model: nothing to say, nothing recorded.
    main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    assert "lti: note" not in capsys.readouterr().out
    assert "trained_under" not in _metrics(tmp_path / "run", "test")["setting"]


@pytest.mark.parametrize("args, message", [
    (["--data.hash_fracton", "0.1"], "lti: error: unknown option 'data.hash_fracton' (did you mean 'data.hash_fraction'?)"),
    (["--data.bach_size", "8"], "lti: error: unknown option 'data.bach_size' (did you mean 'data.batch_size'?)"),
    (["--data.hashing.fracton", "0.1"], "lti: error: unknown option 'data.hashing.fracton' (did you mean 'data.hashing.fraction'?)"),
    (["--model.inverter.init_args.hiden", "8"], "lti: error: unknown option 'model.inverter.hiden' (did you mean 'model.inverter.hidden'?)"),
    (["--seed_everythng", "1"], "lti: error: unknown option 'seed_everythng' (did you mean 'seed_everything'?)"),
    (["--data.batch_size", "abc"], "lti: error: bad value for 'data.batch_size': Expected a <class 'int'>. Got value: abc"),
])
def test_config_typos_and_bad_values_are_one_line_without_the_usage_dump(make_config, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(make_config()), *args])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "ckpt").exists()


def test_a_typo_in_a_yaml_file_is_one_line_too(make_config, tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  hashing:\n    fracton: 0.2\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(make_config()), "--config", str(typo)])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert err == ["lti: error: unknown option 'data.hashing.fracton' (did you mean 'data.hashing.fraction'?); "
                   "`lti fit --help` lists every option"]


def test_a_trainer_option_typo_gets_a_suggestion(make_config, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(make_config()), "--trainer.max_stepz", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lti: error: unknown option 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)")


def test_shipped_configs_hold_no_paths_outside_the_repository():
    for path in (REPO / "configs").rglob("*.yaml"):
        lines = [line.split("#", 1)[0] for line in path.read_text().splitlines()]  # comments may show examples
        includes = [line.split(":", 1)[1].strip() for line in lines if line.startswith("config:")]
        for included in includes:  # an overlay may include another shipped one, by a path relative to itself
            assert (path.parent / included).resolve().is_relative_to(REPO / "configs"), path
        body = "\n".join(line for line in lines if not line.startswith("config:"))
        assert "../" not in body and "/work/" not in body and "/home/" not in body, path


def test_a_sentences_config_without_its_file_says_which_option_to_pass(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--config", str(REPO / "configs/exact/dager_gpt2_sentences.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lti: error: LocalCorpus needs at least one file: pass --data.corpus.init_args.evaluation_files")


def test_the_checkpoint_line_names_sizes_and_links(tmp_path):
    from lti.console import describe_checkpoints

    assert describe_checkpoints(tmp_path) is None
    with open(tmp_path / "step1000.ckpt", "wb") as f:
        f.truncate(734_624_664)  # sparse: the quickstart's size (weights and Adam's two moments)
    (tmp_path / "last.ckpt").symlink_to("step1000.ckpt")
    assert describe_checkpoints(tmp_path) == (f"lti: checkpoints in {tmp_path}: step1000.ckpt (735 MB), last.ckpt -> step1000.ckpt; "
                                              f"`--ckpt_path {tmp_path / 'last.ckpt'}` tests or resumes this run")


def test_one_helper_unwraps_class_path_sections_for_the_checkpoints_arguments_and_the_recorded_configs():
    from types import SimpleNamespace

    from jsonargparse import Namespace

    from lti.trainer_cli import DEFAULT_MODEL, LTICLI, init_args, record_configs

    arguments = Namespace(decoding="argmax", inverter=Namespace(class_path="X", init_args=Namespace(width=4)))
    parsed = Namespace(class_path=DEFAULT_MODEL, init_args=arguments)
    assert init_args(parsed) is arguments  # the parsed config itself: the CLI writes evaluation-only choices into it
    assert init_args({"class_path": "X", "init_args": {"a": 1}}) == {"a": 1}
    assert init_args({"a": 1}) == {"a": 1} and init_args(None) is None  # no class_path: the section is its arguments
    cli = SimpleNamespace(config={"test": Namespace(model=parsed)})
    LTICLI._model_arguments(cli, "test")["decoding"] = "distinct"
    assert parsed.init_args.decoding == "distinct"
    assert LTICLI._model_arguments(SimpleNamespace(config={"test": Namespace(model=None)}), "test") is None
    model, data = SimpleNamespace(inverter=object()), SimpleNamespace(threat_model=SimpleNamespace(record_content=lambda s: None))
    record_configs(model, data, {"model": parsed, "data": {"class_path": "D", "init_args": {"packing": "blocks"}}})
    assert data.recorded_config == {"packing": "blocks"}
    assert model.inverter_record == {"class_path": "X", "init_args": {"width": 4}}
    record_configs(model, data, {"model": {"inverter": {"class_path": "Y"}}, "data": None})  # sections without class_path
    assert data.recorded_config == {} and model.inverter_record == {"class_path": "Y"}


@pytest.mark.parametrize("defense", sorted(p.name for p in (REPO / "configs" / "defenses").glob("*.yaml")))
@pytest.mark.parametrize("base", ["configs/quickstart.yaml", "configs/vision/lti_digits.yaml"])
def test_one_defense_overlay_applies_to_text_and_vision(base, defense, capsys):
    overlay = REPO / "configs" / "defenses" / defense
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / base), "--config", str(overlay), "--print_config"])
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert data["defense"]["class_path"] == yaml.safe_load(overlay.read_text())["data"]["defense"]["class_path"]
    for key, value in yaml.safe_load(overlay.read_text())["data"]["defense"].get("init_args", {}).items():
        assert data["defense"]["init_args"][key] == value


@pytest.mark.parametrize("overlay, base", [
    *[(f"configs/paper/defenses/{name}.yaml", "configs/paper/lti_wikitext103.yaml") for name in ("none", "sign", "prune", "gauss")],
    *[(f"configs/reproduction/{recipe}/{name}.yaml", f"configs/reproduction/{recipe}.yaml")
      for recipe in ("lti", "lti_p") for name in ("sign", "prune", "gauss")],
])
def test_recipe_defense_overlays_include_the_one_defense_overlay(overlay, base, capsys):
    """Each setting's parameters (Gaussian sigma = 0.01, pruning 0.99) live in configs/defenses/ only."""
    included = (REPO / overlay).parent / yaml.safe_load((REPO / overlay).read_text())["config"]
    assert included.resolve().parent == REPO / "configs" / "defenses"
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / base), "--config", str(REPO / overlay), "--print_config"])
    parsed = yaml.safe_load(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / base), "--config", str(included), "--print_config"])
    alone = yaml.safe_load(capsys.readouterr().out)
    assert parsed["data"]["init_args"]["defense"] == alone["data"]["init_args"]["defense"]
    assert "defense:" not in (REPO / overlay).read_text()  # not restated
