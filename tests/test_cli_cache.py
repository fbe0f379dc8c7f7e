"""The CLI's per-user cache: converted GGUF models (jaxgen/models/gguf_cache.py) and compiled programs
(jaxgen/cli/compile_cache.py). Damaged entries are rebuilt; the cache never changes an answer."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.models import tiny_llama, tiny_tokenizer
from jaxgen.storage.keyed_hash import KEY_FILE
from jaxgen.models.gguf_cache import (
    FORMAT_VERSION,
    MANIFEST,
    WEIGHTS,
    CacheEntryError,
    entry_name,
    load_cached,
    read_entry,
    write_entry,
)

CLI = [sys.executable, "-m", "jaxgen.cli.main"]


def tiny_source(tmp_path):
    """A stand-in for a GGUF file and a build function that counts its calls."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not really a gguf")
    model, params = tiny_llama(seed=3, num_layers=2)
    calls = []

    def build(source):
        calls.append(source)
        return model, params, tiny_tokenizer(chat_template="{{ messages[0]['content'] }}")

    return str(path), model, params, build, calls


def assert_same_params(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same_params(actual[key], value)
        else:
            assert actual[key].dtype == value.dtype
            np.testing.assert_array_equal(np.asarray(actual[key]), np.asarray(value))


def test_second_load_is_a_hit_with_the_same_model(tmp_path):
    path, model, params, build, calls = tiny_source(tmp_path)
    cache = str(tmp_path / "cache")
    first = load_cached(path, jnp.float32, cache, build)
    second = load_cached(path, jnp.float32, cache, build)
    assert len(calls) == 1, "the second load rebuilt instead of reading the cache"
    assert second[0] == model
    assert_same_params(second[1], params)
    assert_same_params(first[1], params)
    tokenizer = second[2]
    assert tokenizer.encode("the stop") == first[2].encode("the stop")
    assert tokenizer.chat_template == first[2].chat_template
    assert tokenizer.eos_token_id == first[2].eos_token_id
    bf16 = load_cached(path, jnp.bfloat16, cache, build)[1]  # one entry serves every dtype
    assert len(calls) == 1 and bf16["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16["embed"]),
                                  np.asarray(params["embed"].astype(jnp.bfloat16)))


def _damage_weights_bytes(folder):
    weights = os.path.join(folder, WEIGHTS)
    with open(weights, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate_weights(folder):
    weights = os.path.join(folder, WEIGHTS)
    os.truncate(weights, os.path.getsize(weights) - 64)


def _garble_manifest(folder):
    with open(os.path.join(folder, MANIFEST), "w") as f:
        f.write('{"format": 1, "arrays": [')


def _drop_manifest(folder):
    os.remove(os.path.join(folder, MANIFEST))


@pytest.mark.parametrize("damage", [_damage_weights_bytes, _truncate_weights, _garble_manifest,
                                    _drop_manifest])
def test_a_damaged_entry_is_detected_and_rebuilt(tmp_path, damage, caplog):
    path, model, params, build, calls = tiny_source(tmp_path)
    cache = str(tmp_path / "cache")
    load_cached(path, jnp.float32, cache, build)
    folder = os.path.join(cache, entry_name(path))
    damage(folder)
    if damage is not _drop_manifest:
        with pytest.raises(CacheEntryError):
            read_entry(folder, jnp.float32)
    with caplog.at_level(logging.INFO, logger="jaxgen.models.gguf_cache"):
        rebuilt = load_cached(path, jnp.float32, cache, build)
    assert len(calls) == 2
    assert_same_params(rebuilt[1], params)
    load_cached(path, jnp.float32, cache, build)  # the rebuilt entry is intact again
    assert len(calls) == 2


def test_a_changed_file_gets_a_fresh_entry_and_the_old_one_goes(tmp_path):
    path, model, params, build, calls = tiny_source(tmp_path)
    cache = tmp_path / "cache"
    load_cached(path, jnp.float32, str(cache), build)
    old = entry_name(path)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert entry_name(path) != old
    load_cached(path, jnp.float32, str(cache), build)
    assert len(calls) == 2
    entries = sorted(p.name for p in cache.iterdir() if p.name != KEY_FILE)  # not the key
    assert entries == [entry_name(path)]


def test_a_crashed_build_is_cleaned_up_later(tmp_path):
    path, model, params, build, calls = tiny_source(tmp_path)
    cache = tmp_path / "cache"
    old, fresh = cache / ".building-old", cache / ".building-fresh"  # fresh: maybe running
    for folder in (old, fresh):
        folder.mkdir(parents=True)
    os.utime(old, (0, 0))
    load_cached(path, jnp.float32, str(cache), build)
    assert not old.exists() and fresh.exists()


def test_an_unwritable_cache_only_costs_time(tmp_path):
    path, model, params, build, calls = tiny_source(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache dir cannot be created under a file")
    loaded = load_cached(path, jnp.float32, str(blocker / "cache"), build)
    assert_same_params(loaded[1], params)


def test_write_refuses_what_it_cannot_hold_exactly(tmp_path):
    model, params = tiny_llama()

    class NotLlama:
        config = model.config

    with pytest.raises(ValueError, match="only Llama"):
        write_entry(str(tmp_path / "e"), NotLlama(), params, tiny_tokenizer(), source="x")


def _cli(args, cache_dir, timeout=900):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAXGEN_CACHE_DIR=str(cache_dir))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def _cache_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 0, result.stderr
    assert lines and lines[-1].startswith("[load"), result.stderr
    return lines[-1]


@pytest.mark.slow  # three runs of the default model in subprocesses (one converts it)
def test_second_run_takes_everything_from_the_cache(tmp_path):
    """Cold: the model is converted and programs compiled; warm: nothing is compiled, the
    model comes from the cache, and the answer is the same. --no-cache leaves nothing."""
    cache = tmp_path / "cache"
    args = ["--max-new-tokens", "4", "--verbose", "Hi"]
    cold = _cli(args, cache)
    assert "model cache built" in _cache_line(cold)
    assert (cache / "xla").is_dir() and any((cache / "xla").iterdir())
    [entry] = [p for p in (cache / "models").iterdir() if p.name != KEY_FILE]
    assert json.loads((entry / MANIFEST).read_text())["format"] == FORMAT_VERSION
    warm = _cli(args, cache)
    line = _cache_line(warm)
    assert "model cache hit" in line and " 0 compiled" in line, line
    assert warm.stdout == cold.stdout
    off = tmp_path / "off"
    third = _cli(args + ["--no-cache"], off)
    assert "no model cache" in _cache_line(third)
    assert third.stdout == cold.stdout and not off.exists()


@pytest.mark.slow
def test_cli_rebuilds_a_damaged_model_cache(tmp_path):
    cache = tmp_path / "cache"
    args = ["--max-new-tokens", "4", "--verbose", "Hi"]
    cold = _cli(args, cache)
    [entry] = [p for p in (cache / "models").iterdir() if p.name != KEY_FILE]
    _damage_weights_bytes(str(entry))
    again = _cli(args, cache)
    assert "model cache rebuilt" in _cache_line(again)
    assert again.stdout == cold.stdout
    assert "model cache hit" in _cache_line(_cli(args, cache))
