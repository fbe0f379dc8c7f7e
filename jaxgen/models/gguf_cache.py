"""A disk cache of converted GGUF models: the second load skips parsing the GGUF metadata
and dequantizing its weights (the embedded SmolLM2: seconds of work -> a read of one file).

One entry per GGUF file, a folder under `cache_dir`:

    weights.bin     every parameter as float32, back to back, each 64-byte aligned
    manifest.json   the model config, the tokenizer (tokenizers JSON + its options; null for a
                    GGUF without tokenizer metadata) and, per array, its name, offset, shape
                    and BLAKE2b digest
    manifest.tag    the keyed BLAKE2b (jaxgen.storage.keyed_hash, the key in cache_dir/key)
                    of the entry's name and manifest.json; written last

Nothing of an entry is used unless it verifies: the manifest's tag first (an edited config
number, a swapped vocabulary entry, an entry planted by someone without the user's key: all
refused before the JSON is parsed), then every array's digest (a BLAKE2b tree: 8 MiB leaves
hashed in parallel, then one root per array - order-sensitive, so swapped halves of a weight
do not pass). Folders are private (jaxgen.storage.private: 0700, checked up the chain before
anything is read), files 0600; a cache folder that is not private is not used (a warning; the
model is built from the GGUF).

Entry names: a hash of the GGUF's real path, then a hash of (its size and mtime, the loader
sources, the format version); a read entry must also fit the model's parameter shapes. A
changed file or a changed loader gets a fresh entry (the old one of the same file is
removed). `load_cached` detects a damaged entry and rebuilds it from the GGUF. Entries are
written to a temporary folder `.building-<host>-<pid>-<random>` and renamed into place: a
crash or a run in parallel never leaves a half-written entry, and nothing waits on a lock.
Every open of the cache removes the temporary folders of builds whose process is gone (same
host, pid not running), and any older than STALE_BUILD_S. A cache that cannot be written
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
    >>> oct(os.stat(os.path.join(folder, WEIGHTS)).st_mode & 0o777)
    '0o600'
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxgen.models.llama import Llama, LlamaConfig, param_shapes
from jaxgen.models.tokenizer import Tokenizer
from jaxgen.storage.keyed_hash import sign, user_key, verify
from jaxgen.storage.private import (
    check_private_file,
    private_folder,
    read_private_file,
    write_private_file,
)

FORMAT_VERSION = 2
ALIGN = 64  # bytes: every array starts on a 64-byte boundary and is padded to one
MANIFEST = "manifest.json"
MANIFEST_TAG = "manifest.tag"
WEIGHTS = "weights.bin"
BUILDING = ".building-"  # + <host>-<pid>-<random>: a build in progress (or a dead one's leftover)
STALE_BUILD_S = 3600  # a temporary entry folder this old was left by a crashed run
LEAF_BYTES = 8 << 20  # the BLAKE2b tree's leaf size
_TAG_DOMAIN = b"jaxgen model cache entry v2"
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


def _host() -> str:
    """This machine's name as it appears in a temporary folder's name (no '-' or '/')."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def building_name() -> str:
    """A fresh temporary folder name: .building-<host>-<pid>-<random>."""
    return f"{BUILDING}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _build_is_dead(name: str) -> bool:
    """Whether temporary folder `name` is this host's and its builder process is gone."""
    parts = name[len(BUILDING):].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != _host() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False  # a process of another user's holds the pid: it is alive
    return False


def remove_dead_builds(cache_dir: str) -> list[str]:
    """Removes the temporary folders of builds that cannot finish (their process is gone, or
    older than STALE_BUILD_S); returns their names. Run on every open of the cache."""
    removed = []
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(BUILDING):
            continue
        path = os.path.join(cache_dir, name)
        try:
            stale = time.time() - os.lstat(path).st_mtime > STALE_BUILD_S
        except OSError:
            continue
        if stale or _build_is_dead(name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def _hash_leaves(buffers: list, pool) -> Callable[[], list[list[bytes]]]:
    """Starts hashing every buffer's LEAF_BYTES leaves (BLAKE2b) on `pool`; returns the
    function that waits for them: per buffer, its leaves' digests in order."""
    jobs = [(b, start) for b, buffer in enumerate(buffers)
            for start in range(0, max(len(buffer), 1), LEAF_BYTES)]
    digests = pool.map(lambda job: hashlib.blake2b(
        buffers[job[0]][job[1]:job[1] + LEAF_BYTES], digest_size=32,
        person=b"jaxgen-leaf").digest(), jobs)  # submitted now (Executor.map is eager)

    def collect() -> list[list[bytes]]:
        out: list[list[bytes]] = [[] for _ in buffers]
        for (b, _), digest in zip(jobs, digests):
            out[b].append(digest)
        return out

    return collect


def _root(leaves: list[bytes], size: int) -> str:
    """The array's digest: BLAKE2b over its byte count and its leaves' digests, in order."""
    root = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=32, person=b"jaxgen-root")
    for leaf in leaves:
        root.update(leaf)
    return root.hexdigest()


def array_digests(buffers: list) -> list[str]:
    """The BLAKE2b tree digest of each byte buffer (numpy uint8 arrays, memoryviews).

    Example:
        >>> a, b = np.arange(16, dtype=np.uint8), np.arange(16, dtype=np.uint8)[::-1].copy()
        >>> d = array_digests([a, b])
        >>> d[0] == array_digests([a])[0], d[0] == d[1], len(d[0])
        (True, False, 64)
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=_hash_workers()) as pool:
        leaves = _hash_leaves(buffers, pool)()
    return [_root(leafs, len(buffer)) for leafs, buffer in zip(leaves, buffers)]


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


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


def _entry_key(folder: str, key: bytes | None) -> bytes:
    """`key`, or the user's key kept in the entry's cache folder (made private)."""
    return key if key is not None else user_key(os.path.dirname(os.path.abspath(folder)))


def _tag_parts(folder: str, manifest: bytes) -> tuple[bytes, ...]:
    """What an entry's tag signs: the format, the entry's name, the manifest's bytes."""
    return _TAG_DOMAIN, os.path.basename(os.path.abspath(folder)).encode(), manifest


def write_entry(folder: str, model: Llama, params: dict, tokenizer: Tokenizer | None, *,
                source: str, key: bytes | None = None) -> None:
    """Writes an entry at `folder` (atomically: a temporary sibling renamed into place),
    its manifest tagged with `key` (default: the user's key in the cache folder).

    Raises ValueError for a model the cache cannot hold exactly (not a Llama, a config or
    tokenizer that does not survive the JSON round trip); OSError when the disk refuses or a
    folder is not private (jaxgen.storage.private.NotPrivate).
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
    parent = str(private_folder(os.path.dirname(os.path.abspath(folder))))
    key = _entry_key(folder, key)
    staging = os.path.join(parent, building_name())
    os.mkdir(staging, 0o700)
    try:
        arrays, buffers, offset = [], [], 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(os.path.join(staging, WEIGHTS), flags, 0o600), "wb") as out:
            for name, value in _flatten(params).items():
                array = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
                size = -(-array.nbytes // ALIGN) * ALIGN
                padded = np.zeros(size, np.uint8)  # [size bytes]
                padded[:array.nbytes] = array.reshape(-1).view(np.uint8)
                out.write(padded.data)
                buffers.append(padded)
                arrays.append({"name": name, "offset": offset, "shape": list(array.shape)})
                offset += size
        for record, digest in zip(arrays, array_digests(buffers)):
            record["blake2b"] = digest
        del buffers
        manifest = json.dumps({"format": FORMAT_VERSION, "source": source, "model": "Llama",
                               "config": config, "tokenizer": token_record, "arrays": arrays,
                               "weights_bytes": offset}).encode()
        write_private_file(os.path.join(staging, MANIFEST), manifest)
        write_private_file(os.path.join(staging, MANIFEST_TAG),
                           sign(key, *_tag_parts(folder, manifest)))
        try:
            os.rename(staging, folder)
        except OSError:  # another run renamed its complete entry into place first: keep it
            if not os.path.isfile(os.path.join(folder, MANIFEST_TAG)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_weights(path: str, size: int) -> np.ndarray:
    """weights.bin as a private copy-on-write map [bytes], checked private and `size` long
    on the open file itself (no link followed)."""
    handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |
                     getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(handle, "rb") as file:
        info = os.fstat(file.fileno())
        check_private_file(path, info)
        if info.st_size != size:
            raise CacheEntryError(f"{path}: {info.st_size} bytes, the manifest says {size}")
        if size == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(file, dtype=np.uint8, mode="c", shape=(size,))  # [bytes]


def read_entry(folder: str, dtype, key: bytes | None = None
               ) -> tuple[Llama, dict, Tokenizer | None]:
    """(model, params, tokenizer) from an entry; params as jax arrays of `dtype`.

    The manifest's tag is checked with `key` (default: the user's key in the cache folder)
    before the manifest is parsed, every array's digest before it is returned. Raises
    CacheEntryError naming what is wrong when the entry is missing, damaged, edited or not
    the user's.
    """
    if not os.path.isdir(folder):  # (private_folder below would create it)
        raise CacheEntryError(f"{folder}: no such cache entry")
    try:
        key = _entry_key(folder, key)
        folder = str(private_folder(folder))
        manifest_bytes = read_private_file(os.path.join(folder, MANIFEST))
        tag = read_private_file(os.path.join(folder, MANIFEST_TAG))
        if not verify(key, *_tag_parts(folder, manifest_bytes), tag):
            raise CacheEntryError(f"{folder}: the manifest's tag does not match (an edited "
                                  f"entry, or one written without the user's key)")
        manifest = json.loads(manifest_bytes)
        if manifest.get("format") != FORMAT_VERSION or manifest.get("model") != "Llama":
            raise CacheEntryError(f"{folder}: another cache format")
        config = LlamaConfig(**{k: _tuples(v) for k, v in manifest["config"].items()})
        expected = {name: tuple(shape) for name, shape in _flatten(param_shapes(config)).items()}
        records = manifest["arrays"]
        if {r["name"]: tuple(r["shape"]) for r in records} != expected:
            raise CacheEntryError(f"{folder}: the arrays do not fit the model's parameters")
        token_record = manifest["tokenizer"]  # None for a GGUF without tokenizer metadata
        tokenizer = None if token_record is None else _tokenizer_from(token_record)
        weights_path = os.path.join(folder, WEIGHTS)
        raw = _read_weights(weights_path, manifest["weights_bytes"])  # [bytes]
        spans = []
        for record in records:
            count = int(np.prod(record["shape"], dtype=np.int64))
            size = -(-count * 4 // ALIGN) * ALIGN
            padded = raw[record["offset"]:record["offset"] + size]  # [size bytes]
            if padded.size != size:
                raise CacheEntryError(f"{weights_path}: {record['name']!r} is cut short")
            spans.append((record, count, padded))
        with concurrent.futures.ThreadPoolExecutor(max_workers=_hash_workers()) as pool:
            leaves_of = _hash_leaves([padded for _, _, padded in spans], pool)
            flat = {record["name"]: jnp.asarray(
                padded[:count * 4].view(np.float32).reshape(record["shape"]), dtype=dtype)
                for record, count, padded in spans}  # converted while the leaves hash
            leaves = leaves_of()
        for (record, _, padded), leafs in zip(spans, leaves):
            if _root(leafs, len(padded)) != record["blake2b"]:
                raise CacheEntryError(f"{weights_path}: {record['name']!r} is damaged "
                                      f"(BLAKE2b mismatch)")
    except CacheEntryError:
        raise
    except Exception as error:  # any damage: a short file, bad JSON, a wrong field, NotPrivate
        raise CacheEntryError(f"{folder}: unreadable cache entry ({type(error).__name__}: "
                              f"{error})") from None
    return Llama(config), _unflatten(flat), tokenizer


def load_cached(path: str, dtype, cache_dir: str,
                build: Callable[[str], tuple[Llama, dict, Tokenizer]]
                ) -> tuple[Llama, dict, Tokenizer]:
    """(model, params, tokenizer) of the GGUF at `path`, from `cache_dir` when an intact entry
    is there; otherwise `build(path)` (float32 params) makes them and the entry is written.
    params come back as jax arrays of `dtype` either way (the same values). A cache folder
    that is not private (or cannot be made) is not used: a warning, then `build(path)`."""
    try:
        name = entry_name(path)
    except OSError:  # the GGUF itself is missing: let the loader say so
        return _cast(build(path), dtype)
    try:
        cache_dir = str(private_folder(cache_dir))
        key = user_key(cache_dir)
    except OSError as error:  # NotPrivate included
        log.warning("not cached (%s: %s)", type(error).__name__, error)
        return _cast(build(path), dtype)
    for leftover in remove_dead_builds(cache_dir):
        log.info("removed %s (a build that cannot finish)", leftover)
    folder = os.path.join(cache_dir, name)
    outcome = "built"
    if os.path.isdir(folder):
        try:
            loaded = read_entry(folder, dtype, key)
            log.info("hit %s", folder)
            return loaded
        except CacheEntryError as error:
            log.warning("rebuilding a damaged cache entry: %s", error)
            shutil.rmtree(folder, ignore_errors=True)
            outcome = "rebuilt"
    model, params, tokenizer = build(path)
    try:
        _remove_older_entries(cache_dir, folder)
        write_entry(folder, model, params, tokenizer, source=os.path.realpath(path), key=key)
        log.info("%s %s", outcome, folder)
    except (OSError, ValueError) as error:
        log.warning("not cached (%s: %s)", type(error).__name__, error)
    return _cast((model, params, tokenizer), dtype)


def _remove_older_entries(cache_dir: str, folder: str) -> None:
    """Entries of the same GGUF path with another version (the file or loader changed)."""
    prefix = os.path.basename(folder).split("-")[0] + "-"
    for name in os.listdir(cache_dir):
        if name.startswith(prefix) and name != os.path.basename(folder):
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)


def _cast(loaded, dtype):
    model, params, tokenizer = loaded
    cast = {name: jnp.asarray(value, dtype=dtype) for name, value in _flatten(params).items()}
    return model, _unflatten(cast), tokenizer
