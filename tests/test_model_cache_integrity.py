"""The model cache (jaxgen/models/gguf_cache.py) uses nothing that does not verify: swapped
halves of a weight, an edited manifest number, swapped vocabulary entries, an entry signed
with another key are all rebuilt (never a hit); folders are private and files 0600; the
leftovers of a dead build go on the next open of the cache."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.models import gguf_cache, tiny_llama, tiny_tokenizer
from jaxgen.models.gguf_cache import (
    MANIFEST,
    MANIFEST_TAG,
    WEIGHTS,
    CacheEntryError,
    building_name,
    entry_name,
    load_cached,
    read_entry,
    write_entry,
)


@pytest.fixture
def source(tmp_path):
    """(gguf path, model, params, build, calls): a stand-in GGUF and a counting build."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not really a gguf")
    model, params = tiny_llama(seed=3, num_layers=2, vocab_size=261)
    calls = []

    def build(source_path):
        calls.append(source_path)
        return model, params, tiny_tokenizer(chat_template="{{ messages[0]['content'] }}")

    return str(path), model, params, build, calls


def _entry(cache, path) -> str:
    return os.path.join(cache, entry_name(path))


def _manifest(folder) -> dict:
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


def _rewrite_manifest(folder, change) -> None:
    manifest = _manifest(folder)
    change(manifest)
    with open(os.path.join(folder, MANIFEST), "w") as f:  # the file keeps its 0600 mode
        json.dump(manifest, f)


@pytest.fixture(autouse=True)
def _cache_log_reaches_caplog(monkeypatch):
    """The CLI's CacheStats (another test in this process) stops this logger's records at the
    logger; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("jaxgen.models.gguf_cache"), "propagate", True)


def _assert_rebuilt(path, cache, build, calls, params, caplog):
    with caplog.at_level(logging.INFO, logger="jaxgen.models.gguf_cache"):
        model, loaded, tokenizer = load_cached(path, jnp.float32, cache, build)
    assert len(calls) == 2, "the damaged entry was used (a hit) instead of being rebuilt"
    assert any(r.getMessage().startswith("rebuilt ") for r in caplog.records)
    for key in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(params[key]))
    assert tokenizer.encode("the stop") == tiny_tokenizer().encode("the stop")
    load_cached(path, jnp.float32, cache, build)  # the rebuilt entry is a hit again
    assert len(calls) == 2


def test_swapped_halves_of_a_weight_are_not_a_hit(source, tmp_path, caplog):
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)
    [record] = [r for r in _manifest(folder)["arrays"] if r["name"] == "embed"]
    size = int(np.prod(record["shape"])) * 4
    with open(os.path.join(folder, WEIGHTS), "r+b") as f:
        f.seek(record["offset"])
        data = f.read(size)
        swapped = data[size // 2:] + data[:size // 2]
        assert swapped != data
        # a sum of the words (the old checksum) cannot tell: the test must catch the swap
        assert np.frombuffer(data, np.uint64).sum() == np.frombuffer(swapped, np.uint64).sum()
        f.seek(record["offset"])
        f.write(swapped)
    with pytest.raises(CacheEntryError, match=r"'embed' is damaged \(BLAKE2b mismatch\)"):
        read_entry(folder, jnp.float32)
    _assert_rebuilt(path, cache, build, calls, params, caplog)


def test_an_edited_manifest_number_is_not_a_hit(source, tmp_path, caplog):
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)
    _rewrite_manifest(folder, lambda m: m["config"].update(rope_theta=500000.0))
    with pytest.raises(CacheEntryError, match=r"the manifest's tag does not match"):
        read_entry(folder, jnp.float32)
    _assert_rebuilt(path, cache, build, calls, params, caplog)
    assert load_cached(path, jnp.float32, cache, build)[0].config.rope_theta == 10000.0


def test_swapped_vocabulary_entries_are_not_a_hit(source, tmp_path, caplog):
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)

    def swap_two_tokens(manifest):
        backend = json.loads(manifest["tokenizer"]["backend"])
        vocab = backend["model"]["vocab"]
        vocab["st"], vocab["op"] = vocab["op"], vocab["st"]
        manifest["tokenizer"]["backend"] = json.dumps(backend)

    _rewrite_manifest(folder, swap_two_tokens)
    with pytest.raises(CacheEntryError, match=r"tag does not match"):
        read_entry(folder, jnp.float32)
    _assert_rebuilt(path, cache, build, calls, params, caplog)


def test_an_entry_signed_with_another_key_is_not_a_hit(source, tmp_path, caplog):
    """A planted entry (written by someone without the user's key) does not verify."""
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)
    planted = {**params, "embed": params["embed"] * 0}
    os.rename(folder, folder + ".old")
    write_entry(folder, model, planted, tiny_tokenizer(), source=path, key=b"k" * 32)
    with pytest.raises(CacheEntryError, match=r"tag does not match"):
        read_entry(folder, jnp.float32)
    _assert_rebuilt(path, cache, build, calls, params, caplog)


def test_a_renamed_entry_does_not_verify(source, tmp_path):
    """The tag binds the entry's name: one GGUF's entry cannot stand in for another's."""
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)
    other = os.path.join(cache, "0" * 16 + "-" + "1" * 16)
    os.rename(folder, other)
    with pytest.raises(CacheEntryError, match=r"tag does not match"):
        read_entry(other, jnp.float32)


def test_folders_are_private_and_files_0600(source, tmp_path):
    path, model, params, build, calls = source
    cache = tmp_path / "cache"
    old_umask = os.umask(0)  # the widest umask: modes must not depend on it
    try:
        load_cached(path, jnp.float32, str(cache), build)
    finally:
        os.umask(old_umask)
    folder = _entry(str(cache), path)
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    for name in (MANIFEST, MANIFEST_TAG, WEIGHTS):
        assert oct(os.stat(os.path.join(folder, name)).st_mode & 0o777) == "0o600", name
    assert oct((cache / "key").stat().st_mode & 0o777) == "0o600"


def test_a_cache_others_can_write_is_not_used(source, tmp_path, caplog):
    path, model, params, build, calls = source
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone could swap the entries
    cache = shared / "cache"
    with caplog.at_level(logging.INFO, logger="jaxgen.models.gguf_cache"):
        loaded = load_cached(path, jnp.float32, str(cache), build)
        load_cached(path, jnp.float32, str(cache), build)
    assert len(calls) == 2
    assert not cache.exists() or not any(cache.iterdir()), "something was written there"
    assert any("not cached" in r.getMessage() and "writable by group or others" in
               r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(np.asarray(loaded[1]["embed"]), np.asarray(params["embed"]))


def test_an_entry_file_made_writable_by_others_is_rebuilt(source, tmp_path):
    path, model, params, build, calls = source
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = _entry(cache, path)
    os.chmod(os.path.join(folder, WEIGHTS), 0o666)
    with pytest.raises(CacheEntryError, match=r"writable by group or others"):
        read_entry(folder, jnp.float32)
    load_cached(path, jnp.float32, cache, build)
    assert len(calls) == 2


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_builds_leftover_goes_on_the_next_open(source, tmp_path):
    path, model, params, build, calls = source
    cache = tmp_path / "cache"
    load_cached(path, jnp.float32, str(cache), build)  # the entry exists: the next is a hit
    host = building_name().split("-")[1]
    dead = cache / f".building-{host}-{_dead_pid()}-0a1b2c3d"
    alive = cache / f".building-{host}-{os.getppid()}-0a1b2c3d"  # a running process's
    elsewhere = cache / ".building-otherhost-1-0a1b2c3d"  # another host's: age rule only
    for folder in (dead, alive, elsewhere):
        folder.mkdir()
        (folder / WEIGHTS).write_bytes(b"\0" * 4096)
    load_cached(path, jnp.float32, str(cache), build)
    assert len(calls) == 1, "the second open was a hit"
    assert not dead.exists(), "a dead build's leftover survived the open"
    assert alive.exists() and elsewhere.exists()
    os.utime(elsewhere, (0, 0))  # older than STALE_BUILD_S: the backstop
    load_cached(path, jnp.float32, str(cache), build)
    assert not elsewhere.exists() and alive.exists()


def test_building_names_carry_host_and_pid():
    name = building_name()
    prefix, host, pid, random = name.split("-")
    assert prefix == ".building" and pid == str(os.getpid()) and len(random) == 8
    assert not gguf_cache._build_is_dead(name)  # this process: alive
