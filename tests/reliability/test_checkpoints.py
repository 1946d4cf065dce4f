"""Checkpoints survive what happens to machines: a process killed mid-save, a full disk, damaged
files. Each test reproduces the fault, then checks the one-line message, the exit code and that
nothing saved earlier is lost (docs/reliability.md, "Runs")."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from lti.cli import main


def _fit(config, *args):
    main(["fit", "--config", str(config), *args])


def _lti(*args, env=None, cwd=None, timeout=300):
    """`lti` in a child process: its exit code and error lines."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lti.cli", *args], env=env, cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout)


def _lti_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("lti:")]


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _no_files_under(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file()]


# ------------------------------------------------------------------------------------------------ writes
def test_a_saved_checkpoint_is_byte_for_byte_lightnings(tmp_path):
    """The atomic save writes what Lightning's own save writes: successful runs' files do not change."""
    from lightning.fabric.utilities.cloud_io import _atomic_save

    from lti.checkpoint_files import save_checkpoint

    state = {"state_dict": {"w": torch.arange(1000.0).reshape(10, 100)}, "global_step": 3, "lti": {"setting": {"a": 1}}}
    _atomic_save(state, tmp_path / "lightning.ckpt")
    save_checkpoint(state, tmp_path / "ours.ckpt")
    assert (tmp_path / "ours.ckpt").read_bytes() == (tmp_path / "lightning.ckpt").read_bytes()
    assert _files(tmp_path) == ["lightning.ckpt", "ours.ckpt"]  # no temporary file left


CHILD_SAVE = """
import sys, torch
from lti.checkpoint_files import save_checkpoint
state = {"state_dict": {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(int(sys.argv[2]))}}
save_checkpoint(state, sys.argv[1])
"""


def _kill_mid_save(target: Path, tmpdir: Path, megabytes: int = 256) -> bool:
    """Starts a child that saves a `megabytes` checkpoint to `target` and kills it (SIGKILL) as soon as its
    temporary file has data; False when the save finished before it could be killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD_SAVE, str(target), str(megabytes)], env=env)
    temp = target.with_name(f".{target.name}.tmp-{child.pid}")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            if temp.exists() and temp.stat().st_size > 0:
                child.send_signal(signal.SIGKILL)
                child.wait()
                return True
            time.sleep(0.002)
        return False
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_save_killed_midway_leaves_the_previous_file_and_nothing_in_tmpdir(tmp_path):
    """`kill -9` during a save: the file under the checkpoint's name is the previous one, whole; the
    partial file is beside it (not in $TMPDIR, which may be another file system) and is cleaned up by
    the next run into that folder."""
    from lti.checkpoint_files import check_checkpoint, save_checkpoint
    from lti.checkpoint_folder import claim

    folder, tmpdir = tmp_path / "ckpt", tmp_path / "tmpdir"
    folder.mkdir()
    tmpdir.mkdir()
    target = folder / "step8.ckpt"
    save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 4}, target)
    before = target.read_bytes()
    if not _kill_mid_save(target, tmpdir):
        pytest.skip("the save finished before it could be killed (a very fast disk)")
    assert target.read_bytes() == before  # the previous checkpoint, whole
    check_checkpoint(target)
    (orphan,) = [p for p in folder.iterdir() if p.name.startswith(".step8.ckpt.tmp-")]
    assert _no_files_under(tmpdir) == []
    claimed = claim(folder, ckpt_path=str(target))  # the next fit into the folder (here: resuming from it)
    claimed.release()
    assert not orphan.exists() and len(claimed.notes) == 1
    assert claimed.notes[0].startswith(f"lti: note: removed 1 partial file that an interrupted save left in {folder}")


@pytest.mark.slow
def test_kill_minus_nine_of_lti_fit_mid_save_then_resume(make_config, tmp_path):
    """The whole fault: `lti fit` killed while it saves its second checkpoint (88 MB here), then resumed
    from `last.ckpt`: the first checkpoint is whole, $TMPDIR holds nothing, the resume runs."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    folder = tmp_path / "ckpt"
    config = make_config(**{"trainer.max_steps": 3, "checkpoint.every_n_train_steps": 1, "trainer.limit_val_batches": 0,
                            "model.inverter.init_args.hidden": 20000})
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "lti.cli", "fit", "--config", str(config)], env=env, cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = False
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None:
            partial = [p for p in folder.glob(".step2.ckpt.tmp-*") if p.stat().st_size > 0] if folder.exists() else []
            if partial:
                child.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.002)
    finally:
        if child.poll() is None and not killed:
            child.kill()
        child.wait()
    if not killed:
        pytest.skip("the second save finished before it could be killed")
    assert "step2.ckpt" not in _files(folder)  # never a short file under a checkpoint's name
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 1
    assert _no_files_under(tmpdir) == []
    proc = _lti("fit", "--config", str(config), "--ckpt_path", str(folder / "last.ckpt"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lti: note: removed 1 partial file that an interrupted save left in" in proc.stdout
    assert [f for f in _files(folder) if f.startswith(".step")] == []
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 3


# ------------------------------------------------------------------------------------------------ full disk
def _check_disk_full_outcome(folder: Path, err: str) -> None:
    lines = _lti_lines(err)
    assert lines == [f"lti: error: disk full: could not save checkpoint {folder / 'step2.ckpt'}: No space left on device; "
                     f"the last good checkpoint is {folder / 'last.ckpt'} -> step1.ckpt"], err
    assert "Traceback" not in err and "Logging error" not in err
    assert [f for f in _files(folder) if f.endswith(".ckpt") or ".tmp-" in f] == ["last.ckpt", "step1.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 1  # the last good one, whole


def test_a_full_disk_stops_the_fit_with_one_line_and_keeps_the_last_good_checkpoint(make_config, tmp_path, capsys,
                                                                                    monkeypatch):
    """Simulated: the second save's write fails with ENOSPC midway (the test below fills a real, tiny
    file system where the platform allows one)."""
    import lti.checkpoint_files

    saves, real_save = [], torch.save

    def save_then_fill(state, file):
        saves.append(file)
        if len(saves) == 2:
            file.write(b"PK\x03\x04" + b"\0" * 1000)  # a part of the archive, then the disk is full
            raise RuntimeError("PytorchStreamWriter failed writing file") from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(state, file)

    monkeypatch.setattr(lti.checkpoint_files.torch, "save", save_then_fill)
    config = make_config(**{"trainer.max_steps": 3, "checkpoint.every_n_train_steps": 1, "trainer.limit_val_batches": 0})
    with pytest.raises(SystemExit) as exit_info:
        _fit(config)
    assert exit_info.value.code == 1
    _check_disk_full_outcome(tmp_path / "ckpt", capsys.readouterr().err)


def _can_mount_a_tiny_file_system() -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_a_tiny_file_system(), reason="no user namespace to mount a tiny tmpfs in")
def test_a_real_full_disk_stops_the_fit_with_one_line(make_config, tmp_path):
    """A tmpfs with room for one checkpoint and a half (mounted in a user namespace, no root needed); the
    run folder, the checkpoints and a W&B offline run are on it."""
    sizing = make_config(**{"trainer.max_steps": 1, "trainer.limit_val_batches": 0, "checkpoint.dirpath": str(tmp_path / "sizing")})
    _fit(sizing)
    size_kb = int((tmp_path / "sizing" / "step1.ckpt").stat().st_size * 1.5 / 1024) + 64
    disk = tmp_path / "disk"
    disk.mkdir()
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"project": "lti-test", "offline": True, "save_dir": str(disk / "run")}}
    config = make_config(**{"trainer.max_steps": 3, "checkpoint.every_n_train_steps": 1, "trainer.limit_val_batches": 0,
                            "checkpoint.dirpath": str(disk / "ckpt"), "trainer.default_root_dir": str(disk / "run"),
                            "trainer.logger": logger})
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {disk} && "
              f"{sys.executable} -m lti.cli fit --config {config}; code=$?; "
              f"ls -a {disk / 'ckpt'} > {tmp_path / 'files.txt'}; "
              f"cp -P {disk / 'ckpt'}/*.ckpt {tmp_path}/; exit $code")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = _lti_lines(proc.stderr)
    assert lines == [f"lti: error: disk full: could not save checkpoint {disk / 'ckpt' / 'step2.ckpt'}: No space left on "
                     f"device; the last good checkpoint is {disk / 'ckpt' / 'last.ckpt'} -> step1.ckpt"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
    listed = (tmp_path / "files.txt").read_text().split()
    assert [f for f in listed if f.endswith(".ckpt") or ".tmp-" in f] == ["last.ckpt", "step1.ckpt"]
    assert torch.load(tmp_path / "step1.ckpt", weights_only=True)["global_step"] == 1


# ------------------------------------------------------------------------------------------------ damaged files
def _damage(kind: str, good: Path, path: Path) -> str:
    """Writes a damaged copy of `good` to `path`; returns the reason the error gives."""
    data = bytearray(good.read_bytes())
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 6])  # what a cut-short copy leaves
        return "cut short: the archive has no end"
    if kind == "flipped bytes":
        import zipfile

        member = max(zipfile.ZipFile(good).infolist(), key=lambda i: i.file_size)  # the largest weight
        start = member.header_offset + 30 + len(member.filename.encode()) + len(member.extra)
        for offset in range(start + 64, start + 72):
            data[offset] ^= 0xFF
        path.write_bytes(data)
        return f"the bytes of {member.filename} fail their checksum"
    if kind == "random bytes":
        path.write_bytes(os.urandom(4096))
        return "not a zip archive, as torch.save writes"
    if kind == "empty":
        path.write_bytes(b"")
        return "not a zip archive, as torch.save writes"
    if kind == "no model state":
        torch.save({"weights": torch.ones(3)}, path)
        return "it holds no model state"
    raise ValueError(kind)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, corpus_files):
    from conftest import tiny_config

    folder = tmp_path_factory.mktemp("good")
    config = tiny_config(folder, corpus_files, **{"trainer.max_steps": 1, "trainer.limit_val_batches": 0})
    _fit(config)
    return config, folder / "ckpt" / "step1.ckpt"


@pytest.mark.parametrize("kind", ["truncated", "flipped bytes", "random bytes", "empty", "no model state"])
@pytest.mark.parametrize("command", ["test", "fit"])
def test_a_damaged_checkpoint_is_one_line(good_checkpoint, tmp_path, capsys, kind, command):
    """`lti test` of it, or a fit resumed from it: "not a checkpoint, or damaged: PATH (reason)", exit 2,
    nothing written. Flipped bytes inside a weight load silently with torch.load alone."""
    config, good = good_checkpoint
    bad = tmp_path / "bad.ckpt"
    reason = _damage(kind, good, bad)
    folder, root = tmp_path / "ckpt", tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(config), "--ckpt_path", str(bad), "--checkpoint.dirpath", str(folder),
              "--trainer.default_root_dir", str(root)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert _lti_lines(err) == [f"lti: error: not a checkpoint, or damaged: {bad} ({reason})"], err
    assert "Traceback" not in err
    assert not any(p.suffix == ".ckpt" for p in folder.glob("*")) and not (root / "test_metrics.json").exists()


def test_a_dangling_last_ckpt_says_what_it_links_to(good_checkpoint, tmp_path, capsys):
    config, _ = good_checkpoint
    (tmp_path / "last.ckpt").symlink_to("step9.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "last.ckpt")])
    assert exit_info.value.code == 2
    assert _lti_lines(capsys.readouterr().err) == [
        f"lti: error: checkpoint {tmp_path / 'last.ckpt'} links to step9.ckpt, which does not exist"]
    # A run killed between removing its previous checkpoint and moving the link: the new one is named.
    shutil.copy(good_checkpoint[1], tmp_path / "step10.ckpt")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--ckpt_path", str(tmp_path / "last.ckpt"), "--checkpoint.dirpath", str(tmp_path)])
    assert _lti_lines(capsys.readouterr().err) == [
        f"lti: error: checkpoint {tmp_path / 'last.ckpt'} links to step9.ckpt, which does not exist; "
        "the folder holds step10.ckpt"]


def test_bytes_flipped_in_a_weight_load_silently_without_the_check(good_checkpoint, tmp_path):
    """Why the check reads the archive's checksums: torch.load alone accepts the damaged file."""
    _, good = good_checkpoint
    bad = tmp_path / "bad.ckpt"
    _damage("flipped bytes", good, bad)
    damaged = torch.load(bad, weights_only=True)["state_dict"]
    intact = torch.load(good, weights_only=True)["state_dict"]
    assert any(not torch.equal(damaged[k], intact[k]) for k in intact)


def test_a_save_that_fails_leaves_no_temporary_file(tmp_path):
    from datamodules.atomic_files import WriteFailed, atomic_writer

    target = tmp_path / "x.json"
    target.write_text("before")
    with pytest.raises(WriteFailed, match=f"could not write {target}: No space left on device"):
        with atomic_writer(target) as file:
            file.write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert target.read_text() == "before" and _files(tmp_path) == ["x.json"]
    with pytest.raises(ZeroDivisionError):  # not an operating-system error: raised as it is, cleaned up all the same
        with atomic_writer(target) as file:
            file.write(b"half")
            1 / 0
    assert _files(tmp_path) == ["x.json"]
