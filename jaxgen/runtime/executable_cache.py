"""Compiled generate programs kept on disk as serialized executables: a warm process runs
them without tracing, lowering or compiling.

JAX's persistent compilation cache (jaxgen.cli.compile_cache) saves the compile, but it still traces
and lowers a program to find it (its key hashes the lowered module): for the default model's
two streaming programs that is about half a CPU-second per `jaxgen` run. This cache keys a
program by what determines it, computed without tracing:

  * the entry (jaxgen.runtime.compiled's `start`, `advance`, ...) and its static arguments (the loop, the layout),
  * every dynamic argument's tree structure (with its static aux data: the config's static
    fields, the model's config), shapes, dtypes, weak types and shardings,
  * jax and jaxlib versions, the backend and its devices, every jax config value (but
    cache and logging settings), $XLA_FLAGS / $LIBTPU_INIT_ARGS and the native kernels'
    setting as parsed (jaxgen.runtime.backend.kernel_setting: `=0` and `=off` are one key),
  * the host CPU's vendor and feature flags (`jaxgen.storage.host_cpu`: XLA:CPU compiles for
    the features it finds, and the CPU layouts choose some paths by vendor),
  * a hash of jaxgen's own source files, the native kernels' included (the program is the
    code's output).

The static parts are pickled to be hashed (pickle.dumps only: nothing here is ever
unpickled). A call whose static parts reference code outside jaxgen, jax, numpy and the
standard library (a user's processor, a tokenizer) could change without its pickle changing,
so it is not cached here (it runs as a plain jit); so are calls under a trace (jax.vmap,
jit), processes with several devices, and programs jaxgen.runtime.executable_format cannot
write as plain values.

An entry is one file `<entry>-<key>.exe` (0600, in a 0700 folder): a magic line, a keyed tag
(jaxgen.storage.keyed_hash, with the user's secret kept beside the cache), and the body: a
JSON header (jaxgen.runtime.executable_format: avals, donation, the output tree, the native
targets the program calls) and XLA's own executable bytes. Reading checks the file (a plain
file of the user's, not a link) and the tag before anything in it is parsed: an entry
another user planted, or a damaged, truncated or stale one, is a miss with a one-line
warning, compiled again and rewritten. Loading an entry registers (builds) only the native
kernels its program calls. Entries are written to a temporary file and renamed, so a reader
never sees half an entry; nothing here ever waits on a lock. The newest MAX_ENTRIES entries
are kept on disk and the MAX_LOADED most recently used programs in memory.

Programs are compiled past JAX's persistent cache here: an executable read back from that
cache serializes without its code on XLA:CPU (running it fails), so it could not be stored.

Off by default; the CLI turns it on (jaxgen.cli.compile_cache.enable_compile_cache).

Example (a second store on the same folder, as a second process would, reads the program):
    >>> import tempfile, jax.numpy as jnp
    >>> add = jax.jit(lambda x, *, loop: x + loop, static_argnames=("loop",))
    >>> folder = tempfile.mkdtemp()
    >>> ExecutableStore(folder).call("add", add, (jnp.arange(3),), {"loop": 1})
    Array([1, 2, 3], dtype=int32)
    >>> second = ExecutableStore(folder)
    >>> second.call("add", add, (jnp.arange(3),), {"loop": 1}), second.counts["hits"]
    (Array([1, 2, 3], dtype=int32), 1)
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
import pickle
import tempfile
import time
import warnings

import jax

from jaxgen.runtime import backend
from jaxgen.runtime.executable_format import Uncacheable, compile_fresh, describe, rebuild
from jaxgen.storage.host_cpu import host_cpu
from jaxgen.storage.keyed_hash import TAG_BYTES, sign, user_key, verify
from jaxgen.storage.private import (
    private_folder_or_fallback,
    read_private_file,
    write_private_file,
)

logger = logging.getLogger(__name__)

MAGIC = b"jaxgen-executable 2\n"
MAX_ENTRIES = 32  # entries kept on disk (the most recently used)
MAX_LOADED = 8  # programs kept loaded in memory (the most recently used)
STALE_WRITE_S = 3600.0  # a temporary file this old was left by a writer that died
SUFFIX = ".exe"
# modules whose classes and functions may appear in a cached call's static parts: their code
# is covered by the key (jaxgen's source hash, the jax / jaxlib versions) or never changes
TRUSTED_MODULES = ("jaxgen", "jax", "jaxlib", "numpy", "ml_dtypes", "builtins", "copyreg",
                   "collections", "functools", "operator", "enum", "_codecs", "types",
                   "dataclasses")
ENVIRONMENT_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # + the kernels' setting, arch

_STORE: ExecutableStore | None = None
_SOURCE_HASH: list[str] = []


def enable(folder: str, key_folder: str | None = None) -> None:
    """Keeps and reuses this process's generate programs in `folder` (a private folder,
    created if missing), signed with the user's secret in `key_folder` (default: `folder`)."""
    global _STORE
    _STORE = ExecutableStore(folder, key_folder)


def disable() -> None:
    """Back to plain jit calls (entries on disk stay)."""
    global _STORE
    _STORE = None


def stats() -> dict:
    """What the enabled cache did in this process: "hits" (programs read back), "written",
    "damaged" (entries found unusable and dropped), "uncached" (calls run as plain jits)."""
    return dict(_STORE.counts) if _STORE is not None else {}


def call(name: str, jitted, args: tuple, **statics):
    """`jitted(*args, **statics)` (statics: its static keyword arguments), through the enabled
    cache if there is one."""
    if _STORE is None:
        return jitted(*args, **statics)
    return _STORE.call(name, jitted, args, statics)


class _CheckedPickler(pickle.Pickler):
    """A pickler for hashing: refuses classes and functions from outside TRUSTED_MODULES, and
    writes sets in a fixed order (a set of strings iterates in an order that changes from one
    process to the next)."""

    def persistent_id(self, obj):
        if isinstance(obj, (set, frozenset)):
            return type(obj).__name__, sorted(_static_bytes(item) for item in obj)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            module = getattr(obj, "__module__", None) or ""
            if module.split(".", 1)[0] not in TRUSTED_MODULES:
                raise Uncacheable(f"{module}.{getattr(obj, '__qualname__', obj)} is not "
                                  f"jaxgen's")
        return NotImplemented


def _static_bytes(value) -> bytes:
    buffer = io.BytesIO()
    try:
        _CheckedPickler(buffer, protocol=4).dump(value)
    except Uncacheable:
        raise
    except Exception as error:  # lambdas, closures, objects pickle cannot take
        raise Uncacheable(f"static parts do not pickle: {error}") from None
    return buffer.getvalue()


def source_hash() -> str:
    """SHA-256 of jaxgen's source files (the package's Python and native sources), once per
    process."""
    if not _SOURCE_HASH:
        root = pathlib.Path(__file__).resolve().parent.parent  # the jaxgen package folder
        digest = hashlib.sha256()
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc"), *root.rglob("*.h")]):
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        _SOURCE_HASH.append(digest.hexdigest())
    return _SOURCE_HASH[0]


def environment() -> tuple:
    """Everything outside the call that shapes a compiled program."""
    import jaxlib

    devices = jax.devices()
    config = tuple(sorted((name, repr(value)) for name, value in jax.config.values.items()
                          if "cache" not in name and "log" not in name))
    return (jax.__version__, jaxlib.__version__, jax.default_backend(),
            devices[0].client.platform_version,
            tuple((d.platform, d.device_kind, d.id, d.process_index) for d in devices),
            jax.process_count(), config,
            tuple((name, os.environ.get(name, "")) for name in ENVIRONMENT_VARIABLES),
            ("native kernels", backend.kernel_setting()), ("kernel arch", backend.kernel_arch()),
            ("host cpu", host_cpu()),
            source_hash())


def _leaf_signature(leaf) -> tuple:
    if isinstance(leaf, jax.core.Tracer):
        raise Uncacheable("called under a trace")
    aval = jax.typeof(leaf)
    sharding = getattr(leaf, "sharding", None)
    return (type(leaf).__name__, repr(aval), repr(sharding),
            getattr(leaf, "committed", None))


def program_key(name: str, args: tuple, statics: dict, environment_bytes: bytes) -> str:
    """The entry's key: a hash of everything that determines the compiled program."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    signature = tuple(_leaf_signature(leaf) for leaf in leaves)
    digest = hashlib.sha256(environment_bytes)
    digest.update(name.encode() + b"\0")
    digest.update(_static_bytes((treedef, sorted(statics.items()))))
    digest.update(repr(signature).encode())
    return digest.hexdigest()[:40]


class ExecutableStore:
    """One private folder of signed executables, and the programs this process loaded."""

    def __init__(self, folder: str, key_folder: str | None = None):
        self.folder = str(private_folder_or_fallback(folder, "executable cache"))
        self.key_folder = self.folder if key_folder is None else str(key_folder)
        self.loaded: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.counts = {"hits": 0, "written": 0, "damaged": 0, "uncached": 0}
        self._environments: dict[tuple, bytes] = {}  # the variables' values -> environment
        self._secret: bytes | None = None

    def path(self, name: str, key: str) -> str:
        return os.path.join(self.folder, f"{name}-{key}{SUFFIX}")

    def secret(self) -> bytes:
        """The user's key that signs entries (created on first use, beside the cache)."""
        if self._secret is None:
            try:
                self._secret = user_key(self.key_folder)
            except OSError as error:  # not private: entries of this process only
                fallback = tempfile.mkdtemp(prefix="jaxgen-")
                warnings.warn(f"jaxgen: not using the cache key in {self.key_folder} ({error});"
                              f" using {fallback} for this run", RuntimeWarning, stacklevel=2)
                self._secret = user_key(fallback)
        return self._secret

    def _environment(self) -> bytes:
        values = tuple(os.environ.get(name, "") for name in
                       (*ENVIRONMENT_VARIABLES, "JAXGEN_CPU_KERNELS"))
        if values not in self._environments:
            self._environments[values] = _static_bytes(environment())
        return self._environments[values]

    def call(self, name: str, jitted, args: tuple, statics: dict):
        try:
            if jax.device_count() != 1:
                raise Uncacheable("several devices")
            key = program_key(name, args, statics, self._environment())
        except Uncacheable as why:
            logger.debug("%s runs as a plain jit: %s", name, why)
            self.counts["uncached"] += 1
            return jitted(*args, **statics)
        program = self._loaded(key) or self._read(name, key, args)
        if program is not None:
            try:
                return program(*args)
            except (TypeError, ValueError) as error:  # the argument check, before running
                logger.info("%s: stored program refused the arguments (%s); compiling",
                            name, error)
                self.loaded.pop(key, None)
                self._drop(self.path(name, key))
        program = self._compile_and_write(name, jitted, args, statics, key)
        return program(*args)

    def _loaded(self, key: str):
        program = self.loaded.get(key)
        if program is not None:
            self.loaded.move_to_end(key)
        return program

    def _remember(self, key: str, program) -> None:
        self.loaded[key] = program
        self.loaded.move_to_end(key)
        while len(self.loaded) > MAX_LOADED:
            self.loaded.popitem(last=False)  # its executable is freed with the last reference

    def _read(self, name: str, key: str, args: tuple):
        path = self.path(name, key)
        try:
            blob = read_private_file(path)  # a plain file of the user's, not a link
            header, executable = open_entry(blob, self.secret(), key)  # the tag, first
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            return self._damaged(name, path, error)
        targets = header.get("native_targets")
        if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            return self._damaged(name, path, ValueError("no list of native targets"))
        if not backend.register_native_targets(targets):
            logger.info("%s: the stored program calls %s, not available now; compiling",
                        name, ", ".join(targets))
            return None
        try:
            program = rebuild(header, executable, args)
        except Exception as error:  # noqa: BLE001  (from another build: a miss, rewritten)
            return self._damaged(name, path, error)
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: pruned last
        self.counts["hits"] += 1
        self._remember(key, program)
        return program

    def _damaged(self, name: str, path: str, error: Exception) -> None:
        logger.warning("%s: damaged executable cache entry %s (%s: %s); recompiling", name,
                       path, type(error).__name__, " ".join(str(error).split())[:200])
        self.counts["damaged"] += 1
        self._drop(path)

    def _compile_and_write(self, name: str, jitted, args: tuple, statics: dict, key: str):
        lowered = jitted.lower(*args, **statics)
        program = compile_fresh(lowered)
        self._remember(key, program)
        try:
            header, executable = describe(program, args)
            targets = backend.native_target_names()
            text = lowered.as_text() if targets else ""
            header["native_targets"] = [target for target in targets if target in text]
            write_private_file(self.path(name, key),
                               make_entry(header, executable, self.secret(), key))
        except Uncacheable as why:
            logger.info("%s: executable not kept (%s)", name, why)
            return program
        except Exception as error:  # noqa: BLE001  (disk full, read-only: not kept)
            logger.info("%s: executable not kept (%s: %s)", name, type(error).__name__, error)
            return program
        self.counts["written"] += 1
        self._prune()
        return program

    def _drop(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.remove(path)

    def _prune(self) -> None:
        try:
            scanned = list(os.scandir(self.folder))
            entries = [entry for entry in scanned if entry.name.endswith(SUFFIX)]
            entries.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
            stale = [entry for entry in scanned if entry.name.startswith(".writing-")
                     and entry.stat().st_mtime < time.time() - STALE_WRITE_S]
        except OSError:
            return
        for entry in entries[MAX_ENTRIES:] + stale:
            self._drop(entry.path)


def make_entry(header: dict, executable: bytes, secret: bytes, key: str) -> bytes:
    """An entry file's bytes: MAGIC, the keyed tag, then the body (the header's length, the
    JSON header with the key, XLA's executable)."""
    text = json.dumps({**header, "key": key}, sort_keys=True).encode()
    body = len(text).to_bytes(8, "little") + text + executable
    return MAGIC + sign(secret, MAGIC, key.encode(), body) + body


def open_entry(blob: bytes, secret: bytes, key: str) -> tuple[dict, bytes]:
    """(header, executable) of an entry file for `key`; ValueError, before anything is parsed,
    when its tag is not this user's for this key, and when it is not whole."""
    head = len(MAGIC) + TAG_BYTES
    if len(blob) < head + 8 or not blob.startswith(MAGIC):
        raise ValueError("not an executable cache entry of this version")
    body = blob[head:]
    if not verify(secret, MAGIC, key.encode(), body, blob[len(MAGIC):head]):
        raise ValueError("its keyed tag does not match (damaged, or not written by this user)")
    size = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + size])
    if not isinstance(header, dict) or header.get("key") != key:
        raise ValueError("the entry holds another key")
    return header, body[8 + size:]


__all__ = ["ExecutableStore", "Uncacheable", "call", "disable", "enable", "environment",
           "make_entry", "open_entry", "program_key", "source_hash", "stats"]
