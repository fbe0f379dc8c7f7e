"""A disk cache of converted GGUF models: the second load skips parsing the GGUF metadata
and dequantizing its weights (the embedded SmolLM2: seconds of work -> a read of one file).

One entry per GGUF file, a folder under `cache_dir`:

    weights.bin     every parameter as float32, back to back, each 64-byte aligned
    manifest.json   the model config, the tokenizer (tokenizers JSON + its options; null for a
                    GGUF without tokenizer metadata) and, per
                    array, its name, offset, shape and checksum; written last

Entry names: a hash of the GGUF's real path, then a hash of (its size and mtime, the loader
sources, the format version); a read entry must also fit the model's parameter shapes. A
changed file or a changed loader gets a fresh entry (the old one of the same file is
removed). `load_cached` detects a damaged entry (a file missing or short, a manifest that
does not parse, a checksum that does not match) and rebuilds it from the GGUF. Entries are
written to a temporary folder and renamed into place: a crash or a run in parallel never
leaves a half-written entry, and nothing waits on a lock. A cache that cannot be written
(read-only, disk full) only costs the time it would have saved.

Outcomes are logged on the "jaxgen.models.gguf_cache" logger: "hit", "built", "rebuilt".

Example (a tiny model and tokenizer written and read back):
    >>> import tempfile
    >>> from jaxgen.models import tiny_llama, tiny_tokenizer
    >>> from jaxgen.models.gguf_cache import read_entry, write_entry
    >>> model, params = tiny_llama()
    >>> folder = os.path.join(tempfile.mkdtemp(), "entry")
    >>> write_entry(folder, model, params, tiny_tokenizer(), source="tiny")
    >>> model2, params2, tok2 = read_entry(folder, jnp.float32)
    >>> model2 == model, bool(jnp.all(params2["embed"] == params["embed"]))
    (True, True)
    >>> tok2.encode("the stop") == tiny_tokenizer().encode("the stop")
    True
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxgen.models.llama import Llama, LlamaConfig, param_shapes
from jaxgen.models.tokenizer import Tokenizer

FORMAT_VERSION = 1
ALIGN = 64  # bytes: every array starts on a 64-byte boundary and is padded to one
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
STALE_BUILD_S = 3600  # a temporary entry folder this old was left by a crashed run
# the sources that decide what an entry holds (llama.py is left out on purpose: a read
# entry is checked against param_shapes(config), and a config field it lacks fails loudly)
_LOADER_SOURCES = ("gguf_checkpoint.py", "gguf_tokenizer.py", "tokenizer.py", "gguf_cache.py")
log = logging.getLogger(__name__)


class CacheEntryError(ValueError):
    """A cache entry that is missing, incomplete or damaged (the caller rebuilds it)."""


def entry_name(path: str) -> str:
    """Folder name of `path`'s entry: <hash of the real path>-<hash of its version>."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    version = hashlib.sha256()
    version.update(json.dumps([FORMAT_VERSION, stat.st_size, stat.st_mtime_ns]).encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _LOADER_SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            version.update(f.read())
    return f"{_short_hash(real)}-{version.hexdigest()[:16]}"


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"layers": {"wq": a}} -> {"layers/wq": a} (nested dicts of arrays only)."""
    flat = {}
    for key, value in tree.items():
        if "/" in key:
            raise ValueError(f"parameter name {key!r} holds '/'")
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def _checksum(padded: np.ndarray) -> int:
    """Sum of the bytes as 64-bit words (wrapping): one fast pass, catches damaged bytes."""
    return int(padded.view(np.uint64).sum(dtype=np.uint64))


def _tuples(value):
    """JSON lists back to the tuples LlamaConfig holds."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _tokenizer_record(tokenizer: Tokenizer) -> dict:
    return {"backend": tokenizer.backend.to_str(),
            "special_tokens": tokenizer.special_tokens,
            "additional_special_tokens": list(tokenizer.additional_special_tokens),
            "chat_template": tokenizer.chat_template,
            "add_bos_token": tokenizer.add_bos_token, "add_eos_token": tokenizer.add_eos_token,
            "clean_up_tokenization_spaces": tokenizer.clean_up_tokenization_spaces}


def _tokenizer_from(record: dict) -> Tokenizer:
    import tokenizers

    options = {k: v for k, v in record.items() if k != "backend"}
    return Tokenizer(tokenizers.Tokenizer.from_str(record["backend"]), **options)


def write_entry(folder: str, model: Llama, params: dict, tokenizer: Tokenizer | None, *,
                source: str) -> None:
    """Writes an entry at `folder` (atomically: a temporary sibling renamed into place).

    Raises ValueError for a model the cache cannot hold exactly (not a Llama, a config or
    tokenizer that does not survive the JSON round trip); OSError when the disk refuses.
    """
    if type(model) is not Llama:
        raise ValueError(f"only Llama models are cached, not {type(model).__name__}")
    config = dataclasses.asdict(model.config)
    if LlamaConfig(**{k: _tuples(v) for k, v in json.loads(json.dumps(config)).items()}) \
            != model.config:
        raise ValueError("the model config does not survive a JSON round trip")
    token_record = None if tokenizer is None else _tokenizer_record(tokenizer)
    if token_record is not None and \
            _tokenizer_from(json.loads(json.dumps(token_record))).backend.to_str() != \
            token_record["backend"]:
        raise ValueError("the tokenizer does not survive a JSON round trip")
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        arrays, offset = [], 0
        with open(os.path.join(staging, WEIGHTS), "wb") as out:
            for name, value in _flatten(params).items():
                array = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
                size = -(-array.nbytes // ALIGN) * ALIGN
                padded = np.zeros(size, np.uint8)
                padded[:array.nbytes] = array.reshape(-1).view(np.uint8)
                out.write(padded.data)
                arrays.append({"name": name, "offset": offset, "shape": list(array.shape),
                               "checksum": _checksum(padded)})
                offset += size
        manifest = {"format": FORMAT_VERSION, "source": source, "model": "Llama",
                    "config": config, "tokenizer": token_record, "arrays": arrays,
                    "weights_bytes": offset}
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        try:
            os.rename(staging, folder)
        except OSError:  # another run renamed its complete entry into place first: keep it
            if not os.path.isfile(os.path.join(folder, MANIFEST)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_entry(folder: str, dtype) -> tuple[Llama, dict, Tokenizer]:
    """(model, params, tokenizer) from an entry; params as jax arrays of `dtype`.

    Raises CacheEntryError naming what is wrong when the entry is missing or damaged.
    """
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT_VERSION or manifest.get("model") != "Llama":
            raise CacheEntryError(f"{folder}: another cache format")
        weights_path = os.path.join(folder, WEIGHTS)
        if os.path.getsize(weights_path) != manifest["weights_bytes"]:
            raise CacheEntryError(f"{weights_path}: {os.path.getsize(weights_path)} bytes, "
                                  f"the manifest says {manifest['weights_bytes']}")
        config = LlamaConfig(**{k: _tuples(v) for k, v in manifest["config"].items()})
        token_record = manifest["tokenizer"]  # None for a GGUF without tokenizer metadata
        tokenizer = None if token_record is None else _tokenizer_from(token_record)
        raw = np.memmap(weights_path, dtype=np.uint8, mode="c")  # [bytes], private pages
        flat = {}
        for record in manifest["arrays"]:
            shape = tuple(record["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            size = -(-count * 4 // ALIGN) * ALIGN
            padded = raw[record["offset"]:record["offset"] + size]
            if padded.size != size or _checksum(padded) != record["checksum"]:
                raise CacheEntryError(f"{weights_path}: {record['name']!r} is damaged "
                                      f"(checksum mismatch)")
            host = padded[:count * 4].view(np.float32).reshape(shape)
            flat[record["name"]] = jnp.asarray(host, dtype=dtype)
        expected = {name: tuple(shape) for name, shape in _flatten(param_shapes(config)).items()}
        if {name: tuple(a.shape) for name, a in flat.items()} != expected:
            raise CacheEntryError(f"{folder}: the arrays do not fit the model's parameters")
    except CacheEntryError:
        raise
    except Exception as error:  # any damage: a short file, bad JSON, a wrong field
        raise CacheEntryError(f"{folder}: unreadable cache entry ({type(error).__name__}: "
                              f"{error})") from None
    return Llama(config), _unflatten(flat), tokenizer


def load_cached(path: str, dtype, cache_dir: str,
                build: Callable[[str], tuple[Llama, dict, Tokenizer]]
                ) -> tuple[Llama, dict, Tokenizer]:
    """(model, params, tokenizer) of the GGUF at `path`, from `cache_dir` when an intact entry
    is there; otherwise `build(path)` (float32 params) makes them and the entry is written.
    params come back as jax arrays of `dtype` either way (the same values)."""
    try:
        folder = os.path.join(cache_dir, entry_name(path))
    except OSError:  # the GGUF itself is missing: let the loader say so
        return _cast(build(path), dtype)
    outcome = "built"
    if os.path.isdir(folder):
        try:
            loaded = read_entry(folder, dtype)
            log.info("hit %s", folder)
            return loaded
        except CacheEntryError as error:
            log.warning("rebuilding a damaged cache entry: %s", error)
            shutil.rmtree(folder, ignore_errors=True)
            outcome = "rebuilt"
    model, params, tokenizer = build(path)
    try:
        _remove_older_entries(cache_dir, folder)
        write_entry(folder, model, params, tokenizer, source=os.path.realpath(path))
        log.info("%s %s", outcome, folder)
    except (OSError, ValueError) as error:
        log.warning("not cached (%s: %s)", type(error).__name__, error)
    return _cast((model, params, tokenizer), dtype)


def _remove_older_entries(cache_dir: str, folder: str) -> None:
    """Entries of the same GGUF path with another version (the file or loader changed), and
    temporary folders a crashed run left (older than STALE_BUILD_S)."""
    prefix = os.path.basename(folder).split("-")[0] + "-"
    if not os.path.isdir(cache_dir):
        return
    for name in os.listdir(cache_dir):
        path = os.path.join(cache_dir, name)
        stale = False
        if name.startswith(".building-"):
            try:
                stale = time.time() - os.path.getmtime(path) > STALE_BUILD_S
            except OSError:
                continue
        if stale or (name.startswith(prefix) and name != os.path.basename(folder)):
            shutil.rmtree(path, ignore_errors=True)


def _cast(loaded, dtype):
    model, params, tokenizer = loaded
    cast = {name: jnp.asarray(value, dtype=dtype) for name, value in _flatten(params).items()}
    return model, _unflatten(cast), tokenizer
