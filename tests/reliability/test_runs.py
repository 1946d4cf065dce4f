"""Runs that cannot trample each other, results that say what they measured, and client text that
stays in the run folder (docs/reliability.md, "Runs")."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import EVAL_LINES, REPO

from lti.cli import main


def _lti_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("lti:")]


def _snapshot(folder: Path) -> dict[str, object]:
    """Every file's bytes and every link's target in `folder`."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in sorted(folder.iterdir())}


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


# ------------------------------------------------------------------------------------------------ one folder, one run
def test_a_fit_into_a_folder_in_use_by_a_live_run_is_refused(make_config, tmp_path, capsys):
    from lti.checkpoint_folder import claim

    folder = tmp_path / "ckpt"
    live = claim(folder)  # what a live `lti fit` holds (its lock: this process's PID)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(make_config())])
        assert exit_info.value.code == 2
        assert _lti_lines(capsys.readouterr().err) == [
            f"lti: error: checkpoint folder {folder} is in use by process {os.getpid()}, a live `lti fit`; wait for it, "
            "or write elsewhere with --checkpoint.dirpath DIR"]
        assert [p.name for p in folder.iterdir()] == [".lock"]
    finally:
        live.release()
    main(["fit", "--config", str(make_config())])  # free again
    assert (folder / "last.ckpt").resolve().name == "step4.ckpt" and not (folder / ".lock").exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(make_config, tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".lock").write_text(f"{pid} {socket.gethostname()}\n")
    main(["fit", "--config", str(make_config())])
    out = capsys.readouterr().out
    assert (f"lti: note: {folder} was locked by process {pid}, which is gone (stopped without cleaning up); "
            "lock taken over") in out
    assert (folder / "last.ckpt").resolve().name == "step4.ckpt" and not (folder / ".lock").exists()


@pytest.mark.slow
def test_two_fits_at_once_into_one_folder(make_config, tmp_path):
    """Two real `lti fit` processes: the second, started while the first trains, is refused; the first
    ends normally and `last.ckpt` is its model."""
    folder = tmp_path / "ckpt"
    first_config = make_config(**{"trainer.max_steps": 500, "trainer.val_check_interval": 500, "trainer.limit_val_batches": 0})
    first = subprocess.Popen([sys.executable, "-m", "lti.cli", "fit", "--config", str(first_config)], env=_env(),
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (folder / ".lock").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert (folder / ".lock").exists(), "the first fit never took its folder's lock"
        second_config = tmp_path / "second.yaml"
        second_config.write_text(first_config.read_text().replace("max_steps: 500", "max_steps: 4"))
        second = subprocess.run([sys.executable, "-m", "lti.cli", "fit", "--config", str(second_config)], env=_env(),
                                cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first fit ended before the second started: make it longer"
        assert second.returncode == 2, second.stderr[-2000:]
        assert _lti_lines(second.stderr) == [
            f"lti: error: checkpoint folder {folder} is in use by process {first.pid}, a live `lti fit`; wait for it, "
            "or write elsewhere with --checkpoint.dirpath DIR"]
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step500.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 500


def test_a_second_run_into_a_folder_with_an_earlier_runs_checkpoints(make_config, tmp_path, capsys):
    """The quickstart run twice: the second is refused with the three ways on, and the first run's
    checkpoints are untouched; resuming is allowed; `--overwrite_checkpoints true` replaces them."""
    config = make_config()
    folder = tmp_path / "ckpt"
    main(["fit", "--config", str(config)])
    before = _snapshot(folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    assert _lti_lines(capsys.readouterr().err) == [
        f"lti: error: checkpoint folder {folder} holds an earlier run's checkpoints (last.ckpt -> step4.ckpt, step4.ckpt); "
        f"resume that run with --ckpt_path {folder / 'last.ckpt'}, write elsewhere with --checkpoint.dirpath DIR, "
        "or replace them with --overwrite_checkpoints true"]
    assert _snapshot(folder) == before
    # Fine-tuning another folder's checkpoint into this one would leave two runs' files side by side too.
    other = tmp_path / "other.ckpt"
    other.write_bytes(before["step4.ckpt"])
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--ckpt_path", str(other), "--trainer.max_steps", "6"])
    assert _snapshot(folder) == before

    main(["fit", "--config", str(config), "--ckpt_path", str(folder / "last.ckpt"), "--trainer.max_steps", "6"])
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step6.ckpt"]

    capsys.readouterr()
    main(["fit", "--config", str(config), "--overwrite_checkpoints", "true"])
    assert (f"lti: note: replaced the earlier run's checkpoints in {folder} (--overwrite_checkpoints): "
            "removed last.ckpt -> step6.ckpt, step6.ckpt") in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step4.ckpt"]
    first = torch.load(other, weights_only=True)["state_dict"]  # the first run's model, copied above
    fresh = torch.load(folder / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(first[k], fresh[k]) for k in first)  # the same config from scratch: the same model


# ------------------------------------------------------------------------------------------------ trained_under
@pytest.fixture(scope="module")
def undefended_checkpoint(tmp_path_factory, corpus_files):
    """A checkpoint trained without defense (2 attention layers, so DAGER runs next to it)."""
    from conftest import tiny_config

    folder = tmp_path_factory.mktemp("undefended")
    config = tiny_config(folder, corpus_files, **{"trainer.max_steps": 1, "trainer.limit_val_batches": 0,
                                                  "data.target.init_args.num_layers": 2})
    main(["fit", "--config", str(config)])
    return config, folder / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("command", ["test", "validate"])
@pytest.mark.parametrize("overlays", [[], ["configs/exact/dager.yaml"]], ids=["lti", "lti+dager"])
def test_evaluating_under_another_defense_than_trained_is_recorded(undefended_checkpoint, tmp_path, capsys, command,
                                                                   overlays):
    config, ckpt = undefended_checkpoint
    stage = {"test": "test", "validate": "val"}[command]
    args = [a for overlay in [*overlays, "configs/defenses/sign.yaml"] for a in ("--config", str(REPO / overlay))]
    main([command, "--config", str(config), *args, "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(tmp_path),
          "--trainer.limit_val_batches", "1.0"])
    setting = json.loads((tmp_path / f"{stage}_metrics.json").read_text())["setting"]
    assert setting["defense"] == {"name": "sign"} and setting["trained_under"] == {"defense": {"name": "none"}}
    assert capsys.readouterr().out.count("lti: note: the inverter was trained under defense none") == 1


def test_predicting_under_another_defense_than_trained_is_said(undefended_checkpoint, tmp_path, capsys):
    config, ckpt = undefended_checkpoint
    main(["predict", "--config", str(config), "--config", str(REPO / "configs/defenses/sign.yaml"), "--ckpt_path", str(ckpt),
          "--trainer.default_root_dir", str(tmp_path)])
    assert "lti: note: the inverter was trained under defense none" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ client text
@pytest.mark.slow
def test_a_logged_wandb_table_leaves_no_client_text_outside_the_run_folder(make_config, tmp_path):
    """W&B stages a copy of every logged table for upload, by default under ~/.local/share/wandb; here
    HOME and TMPDIR are empty folders, and after a fit and a test no file under them holds client text."""
    home, tmpdir, run = tmp_path / "home", tmp_path / "tmpdir", tmp_path / "run"
    home.mkdir()
    tmpdir.mkdir()
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"project": "lti-test", "offline": True, "save_dir": str(run)}}
    config = make_config(**{"trainer.logger": logger, "trainer.max_steps": 2, "trainer.val_check_interval": 2})
    env = _env(HOME=str(home), TMPDIR=str(tmpdir), WANDB_MODE="offline",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))  # the corpus files' cached copy (README) is not the point here
    for name in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_DIR"):
        env.pop(name, None)
    for command in (["fit", "--config", str(config)],
                    ["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")]):
        proc = subprocess.run([sys.executable, "-m", "lti.cli", *command], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    client_text = EVAL_LINES[0][:20]

    def holding_client_text(folder: Path) -> list[str]:
        return [str(p) for p in folder.rglob("*") if p.is_file() and client_text.encode() in p.read_bytes()]

    assert holding_client_text(home) == [] and holding_client_text(tmpdir) == []
    staged = list((run / "wandb" / "artifacts" / "staging").iterdir())
    assert len(staged) >= 2 and all(client_text.encode() in p.read_bytes() for p in staged)  # one per logged table
    assert not (home / ".local" / "share" / "wandb").exists()


def test_a_fit_keeps_the_corpus_copies_of_client_text_in_the_run_folder(make_config, tmp_path):
    """`datasets` keeps an Arrow copy of a LocalCorpus file (and of its tokenisation) in
    ~/.cache/huggingface/datasets, the embedded corpus its split files in ~/.cache/lti/corpora: `lti fit`
    points `$LTI_TEXT_CACHE_DIR` to `<default_root_dir>/corpus_cache`, as `lti audit` does. HOME, the XDG
    and HF caches, the LTI cache and TMPDIR are empty folders; after a fit none of them holds client text."""
    run = tmp_path / "run"  # the tiny config's trainer.default_root_dir
    outside = {name: tmp_path / name for name in ("home", "xdg", "hf", "lti", "tmpdir")}
    for folder in outside.values():
        folder.mkdir()
    env = {k: v for k, v in _env().items() if not k.startswith(("HF_", "XDG_", "LTI_", "WANDB_"))}
    env.update(HOME=str(outside["home"]), XDG_CACHE_HOME=str(outside["xdg"]), HF_HOME=str(outside["hf"]),
               LTI_CACHE_DIR=str(outside["lti"]), TMPDIR=str(outside["tmpdir"]), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    config = make_config(**{"trainer.max_steps": 2, "trainer.val_check_interval": 2})
    proc = subprocess.run([sys.executable, "-m", "lti.cli", "fit", "--config", str(config)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    client_text = [line.encode() for line in EVAL_LINES]

    def holding_client_text(folder: Path) -> list[str]:
        return [str(p) for p in folder.rglob("*") if p.is_file() and any(t in p.read_bytes() for t in client_text)]

    assert {name: holding_client_text(folder) for name, folder in outside.items()} == {name: [] for name in outside}
    assert holding_client_text(run / "corpus_cache" / "datasets")  # the Arrow copy, where the run writes


def test_a_text_cache_folder_the_user_set_is_kept_and_the_environment_restored_after_the_run(make_config, tmp_path,
                                                                                            monkeypatch):
    mine = tmp_path / "mine"
    monkeypatch.setenv("LTI_TEXT_CACHE_DIR", str(mine))
    main(["fit", "--config", str(make_config(**{"trainer.max_steps": 2, "trainer.val_check_interval": 2}))])
    assert os.environ["LTI_TEXT_CACHE_DIR"] == str(mine)
    assert (mine / "datasets").is_dir() and not (tmp_path / "run" / "corpus_cache").exists()
    monkeypatch.delenv("LTI_TEXT_CACHE_DIR")
    main(["test", "--config", str(make_config()), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    assert (tmp_path / "run" / "corpus_cache" / "datasets").is_dir() and "LTI_TEXT_CACHE_DIR" not in os.environ
