"""Caches that prove what they hold (docs/reliability.md): an observation cache whose bytes were
overwritten, truncated or lost, or whose meta.json is damaged, is refused in one line naming the file
and `data.cache.rebuild` (which rebuilds it); two runs sharing a cache folder never delete each other's
build; a client whose updates differ only by accumulation order (CUDA) is cached, a random one is not.
The hash-bin cache's recovery is tested with the hashing (tests/datamodules/test_hashing.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from conftest import REPO

from datamodules.cache_folder import build_lock, checksums, first_mismatch, remove_dead_partials
from datamodules.federated import NoDefense
from datamodules.observation_cache import CacheOptions, ObservationCache, differ_only_by_accumulation_order
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule

LOGGER = "datamodules.observation_cache"


def _datamodule(corpus_files, cache, **options):
    torch.manual_seed(0)
    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    dm = TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, defense=NoDefense(),
                                 cache=CacheOptions(str(cache), **options))
    dm.setup("fit")
    return dm


def _cached_rows(corpus_files, cache, **options) -> np.ndarray:
    opened = _datamodule(corpus_files, cache, **options)._open_cache()
    return np.asarray(opened._features) * opened._scales.numpy()[:, None]


def _overwrite(path, offset, values: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(values)


def _features_offset(cache) -> int:
    return np.load(cache / "features.npy", mmap_mode="r").offset


@pytest.fixture
def built(corpus_files, tmp_path):
    """A finished cache and its rows."""
    cache = tmp_path / "cache"
    return cache, _cached_rows(corpus_files, cache)


# --------------------------------------------------------------------------------------------------------
# Damaged files: before, read silently (nan or shifted metrics) or a numpy error naming no file


@pytest.mark.parametrize("garbage", ["nan", "finite"])
@pytest.mark.parametrize("verify", ["sampled", "full"])
def test_overwritten_feature_bytes_are_refused_naming_the_file_and_rebuilt_on_request(corpus_files, built, garbage, verify):
    cache, rows = built
    value = np.float16("nan") if garbage == "nan" else np.float16(50)
    _overwrite(cache / "features.npy", _features_offset(cache) + 2 * rows.shape[1] + 10, np.full(200, value).tobytes())
    with pytest.raises(ValueError) as error:
        _datamodule(corpus_files, cache, verify=verify)._open_cache()
    message = str(error.value)
    assert message.startswith(f"observation cache file {str(cache / 'features.npy')!r} does not match its checksum")
    assert message.endswith("set data.cache.rebuild true to rebuild it") and "\n" not in message
    assert np.array_equal(_cached_rows(corpus_files, cache, rebuild=True, verify=verify), rows)


def test_a_truncated_file_is_refused_by_its_size_on_every_open(corpus_files, built):
    cache, _ = built
    size = (cache / "features.npy").stat().st_size
    os.truncate(cache / "features.npy", size - 100)
    with pytest.raises(ValueError, match=r"features.npy' has \d+ bytes, \d+ when it was built \(truncated or replaced\); "
                                         r"set data.cache.rebuild true to rebuild it$"):
        _datamodule(corpus_files, cache)._open_cache()
    # Without verification numpy's "mmap length is greater than file size" is still one line naming the file.
    with pytest.raises(ValueError, match=r"features.npy' cannot be read \(mmap length is greater than file size\); set data"):
        _datamodule(corpus_files, cache, verify="none")._open_cache()


def test_a_missing_file_or_an_unreadable_meta_json_is_refused_in_one_line(corpus_files, built):
    cache, rows = built
    (cache / "scales.npy").unlink()
    with pytest.raises(ValueError, match=r"scales.npy' is missing; set data.cache.rebuild true to rebuild it$"):
        _datamodule(corpus_files, cache)._open_cache()
    assert np.array_equal(_cached_rows(corpus_files, cache, rebuild=True), rows)
    meta = cache / "meta.json"
    meta.write_text(meta.read_text()[:50])
    with pytest.raises(ValueError, match=r"meta.json' is unreadable \(JSONDecodeError: .*\); set data.cache.rebuild true"):
        _datamodule(corpus_files, cache)._open_cache()


def test_a_cache_without_checksums_is_read_with_one_warning_and_rebuilt_with_them_on_request(corpus_files, built, caplog):
    """Caches built before checksums were recorded stay usable (their key still proves what they were
    built for; refusing would force a rebuild of a sound, possibly 11 GB cache): read unverified, saying so."""
    cache, rows = built
    meta = json.loads((cache / "meta.json").read_text())
    del meta["checksums"]
    (cache / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger=LOGGER):
        assert np.array_equal(_cached_rows(corpus_files, cache), rows)
    (record,) = [record for record in caplog.records if record.name == LOGGER]
    assert record.getMessage() == (f"observation cache {str(cache)!r} has no checksums (built by an older version): "
                                   "read unverified; set data.cache.rebuild true to rebuild it with checksums")
    assert np.array_equal(_cached_rows(corpus_files, cache, rebuild=True), rows)
    assert "checksums" in json.loads((cache / "meta.json").read_text())


def test_an_unknown_verification_mode_is_refused(corpus_files, tmp_path):
    with pytest.raises(ValueError, match=r"data.cache.verify='sometimes' must be sampled, full or none"):
        _datamodule(corpus_files, tmp_path / "cache", verify="sometimes")._open_cache()


def test_sampled_checks_read_the_first_and_last_chunks_and_random_others_full_checks_every_chunk(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "data.bin").write_bytes(np.random.default_rng(0).bytes(40 * 64))  # 40 chunks of 64 bytes
    recorded = checksums(folder, ["data.bin"], chunk_bytes=64)
    assert len(recorded["files"]["data.bin"]["chunks"]) == 40
    assert first_mismatch(folder, recorded, "full") is None and first_mismatch(folder, recorded, "sampled") is None
    for chunk in (0, 39):  # the first and the last chunk: found by every sampled check
        _overwrite(folder / "data.bin", chunk * 64 + 3, b"\xff\x00")
        assert "does not match its checksum" in first_mismatch(folder, recorded, "sampled")
        folder.joinpath("data.bin").write_bytes(np.random.default_rng(0).bytes(40 * 64))
    _overwrite(folder / "data.bin", 17 * 64 + 3, b"\xff\x00")  # a middle chunk: full finds it at once ...
    assert first_mismatch(folder, recorded, "full").endswith("(bytes 1088-1152 of 2560): changed or damaged after the build")
    assert first_mismatch(folder, recorded, "none") is None
    # ... sampled ones draw other chunks every open (4 of 38): some open finds it (missed by 200: p ~ 1e-9).
    found = [first_mismatch(folder, recorded, "sampled") is not None for _ in range(200)]
    assert any(found) and not all(found)


# --------------------------------------------------------------------------------------------------------
# Two runs sharing a cache folder: before, the second deleted the first's live build


def _hold_lock(cache, partial: bool):
    """Another process holding the build lock of `cache` (and building into its partial folder) until killed."""
    script = textwrap.dedent(f"""
        import fcntl, os, socket, sys, time
        fd = os.open({str(cache) + '.lock'!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"process {{os.getpid()}} on {{socket.gethostname()}}".encode())
        if {partial}:
            os.mkdir({str(cache)!r} + f".partial-{{socket.gethostname()}}-{{os.getpid()}}")
        print("locked", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _waits(caplog):
    return [record for record in caplog.records if record.name == "datamodules.cache_folder"]


def test_a_second_builder_waits_for_the_live_build_saying_so_and_leaves_its_folder_alone(corpus_files, tmp_path, caplog):
    cache = tmp_path / "cache"
    holder = _hold_lock(cache, partial=True)
    live_partial = tmp_path / f"cache.partial-{socket.gethostname()}-{holder.pid}"
    result = {}
    with caplog.at_level("WARNING", logger="datamodules.cache_folder"):
        waiter = threading.Thread(target=lambda: result.setdefault("rows", _cached_rows(corpus_files, cache)))
        waiter.start()
        try:
            deadline = time.monotonic() + 60
            while not _waits(caplog) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            assert waiter.is_alive() and live_partial.is_dir() and not cache.exists()  # waiting, nothing removed
        finally:
            holder.kill()  # the builder dies: the kernel releases its lock
            holder.wait()
        waiter.join(60)
    (record,) = _waits(caplog)
    assert record.getMessage() == (f"observation cache {str(cache)!r} is being built or checked by process {holder.pid} on "
                                   f"{socket.gethostname()} (lock {str(cache) + '.lock'!r}); waiting for it")
    assert result["rows"].shape[0] > 0 and not live_partial.exists()  # the dead builder's partial is removed


def test_only_partial_builds_of_dead_builders_on_this_host_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, cache = socket.gethostname(), tmp_path / "cache"
    partials = {name: tmp_path / f"cache.partial-{name}" for name in
                (f"{host}-{dead.pid}", f"{host}-{os.getpid()}", f"other-host-{dead.pid}", str(dead.pid))}
    for folder in partials.values():
        folder.mkdir()
    remove_dead_partials(cache)
    assert {name for name, folder in partials.items() if folder.exists()} == {f"{host}-{os.getpid()}", f"other-host-{dead.pid}"}


def test_the_lock_is_released_when_its_holder_raises(tmp_path):
    with pytest.raises(RuntimeError), build_lock(tmp_path / "cache"):
        raise RuntimeError
    with build_lock(tmp_path / "cache"):  # does not wait
        assert (tmp_path / "cache.lock").read_text().startswith(f"process {os.getpid()} on ")


BUILDER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import numpy as np, torch
from datamodules.federated import NoDefense
from datamodules.observation_cache import CacheOptions, ObservationCache
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule
slow = ObservationCache._observe
def observe(self, *args, **kwargs):  # the first run builds until told to go on: the other starts meanwhile
    deadline = time.monotonic() + 120
    while {hold} and not os.path.exists({go!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return slow(self, *args, **kwargs)
ObservationCache._observe = observe
torch.manual_seed(0)  # as _datamodule
target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8)
dm = TextInversionDataModule(target=target, corpus=LocalCorpus([{aux!r}], [{ev!r}]), seq_len=8, batch_size=4,
                             defense=NoDefense(), cache=CacheOptions({cache!r}))
dm.setup("fit")
np.save({out!r}, np.asarray(dm._open_cache()._features))
"""


@pytest.mark.slow
def test_two_runs_building_one_cache_at_once_both_read_the_same_cache(corpus_files, tmp_path):
    """Two processes, as two `lti fit` sharing `data.cache.path`: before, the second deleted the first's
    partial build and the first died on a missing scales.npy."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    runs = []
    for i in range(2):
        script = BUILDER.format(repo=str(REPO), hold=i == 0, go=str(go), aux=str(corpus_files["auxiliary"]),
                                ev=str(corpus_files["evaluation"]), cache=str(cache), out=str(tmp_path / f"run{i}.npy"))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        runs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True))
        if i == 0:  # the second starts while the first builds
            deadline = time.monotonic() + 120
            while not list(tmp_path.glob("cache.partial-*")) and time.monotonic() < deadline and runs[0].poll() is None:
                time.sleep(0.05)
            assert list(tmp_path.glob("cache.partial-*")), runs[0].communicate()[1]
    said = [runs[1].stderr.readline()]
    while said[-1] and "waiting for it" not in said[-1]:  # the second waits for the first's live build ...
        said.append(runs[1].stderr.readline())
    go.touch()  # ... which then ends
    errors = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    assert said[-1].startswith(f"observation cache {str(cache)!r} is being built or checked by process {runs[0].pid}"), said
    assert np.array_equal(np.load(tmp_path / "run0.npy"), np.load(tmp_path / "run1.npy"))


# --------------------------------------------------------------------------------------------------------
# The determinism check of the build: CUDA's accumulation order is not randomness


def _rows(seed=0):
    return torch.randn(8, 300, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-8, 0, 8)[:, None]


def test_accumulation_order_noise_passes_and_dropout_like_differences_are_refused():
    rows = _rows()
    noise = 1e-6 * rows.abs().amax(dim=1, keepdim=True) * torch.randn(rows.shape, generator=torch.Generator().manual_seed(1))
    assert differ_only_by_accumulation_order(rows, rows.clone())
    assert differ_only_by_accumulation_order(rows, rows + noise)  # ~1e-6 relative per row, even on tiny rows
    assert differ_only_by_accumulation_order(torch.zeros(2, 5), torch.zeros(2, 5))
    keep = torch.rand(rows.shape, generator=torch.Generator().manual_seed(2)) > 0.1
    assert not differ_only_by_accumulation_order(rows, rows * keep / 0.9)  # dropout p = 0.1
    small = rows.clone()
    small[-1] += 1e-2 * rows[-1].abs().max()  # one row off by 1% of its scale
    assert not differ_only_by_accumulation_order(rows, small)
    assert not differ_only_by_accumulation_order(torch.zeros(1, 5), torch.full((1, 5), 1e-30))


@pytest.mark.parametrize("perturbation, accepted", [(1e-6, True), (None, False)], ids=["cuda-like", "dropout-like"])
def test_the_build_accepts_accumulation_order_noise_and_refuses_random_updates(corpus_files, tmp_path, monkeypatch,
                                                                               perturbation, accepted):
    """A second computation of the first batch that differs as CUDA's does (atomics) is accepted; before,
    `torch.equal` refused dropout-0 clients on an H100."""
    original = ObservationCache._observe

    def observe(self, batch, seed, defense=None):
        rows = original(self, batch, seed, defense)
        if seed == 0:
            return rows
        scale = rows.abs().amax(dim=1, keepdim=True)
        noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed))
        return rows + (perturbation * scale * noise if perturbation else rows * (noise.abs() > 1.645))  # ~10% doubled

    monkeypatch.setattr(ObservationCache, "_observe", observe)
    if accepted:
        assert _cached_rows(corpus_files, tmp_path / "cache").shape[0] > 0
    else:
        with pytest.raises(ValueError, match="client updates are random"):
            _datamodule(corpus_files, tmp_path / "cache")._open_cache()


# --------------------------------------------------------------------------------------------------------
# Through the command line


def test_a_damaged_cache_ends_lti_fit_with_one_line_naming_the_file(make_config, tmp_path, capsys):
    from lti.cli import main as lti_main

    cache = tmp_path / "cache"
    config = make_config(**{"data.cache": {"path": str(cache)}, "trainer.max_steps": 1, "trainer.val_check_interval": 1,
                            "trainer.limit_val_batches": 1})
    lti_main(["fit", "--config", str(config)])
    _overwrite(cache / "features.npy", _features_offset(cache) + 64, np.full(200, np.float16(50)).tobytes())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_status:  # a second, new run reading the damaged cache
        lti_main(["fit", "--config", str(config), "--overwrite_checkpoints", "true"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lti: error: observation cache file {str(cache / 'features.npy')!r} does not match its checksum (bytes 0-"
        f"{(cache / 'features.npy').stat().st_size} of {(cache / 'features.npy').stat().st_size}): changed or damaged "
        "after the build; set data.cache.rebuild true to rebuild it"]


def test_the_checksum_benchmark_runs(capsys):
    from benchmarks import cache_checksums

    results = cache_checksums.main(["--gigabytes", "0.01", "--bins", "1000", "--repeats", "1"])
    assert [r["step"] for r in results][2:4] == ["full check, warm", "full check, cold"]
    assert "| sampled check, cold |" in capsys.readouterr().out

