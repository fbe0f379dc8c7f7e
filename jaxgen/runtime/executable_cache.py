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
    cache and logging settings) and $XLA_FLAGS / $LIBTPU_INIT_ARGS / $JAXGEN_CPU_KERNELS,
  * a hash of jaxgen's own source files, the native kernel's included (the program is the
    code's output); a stored program registers the native kernels before it is loaded.

The static parts are pickled to be hashed. A call whose static parts reference code outside
jaxgen, jax, numpy and the standard library (a user's processor, a tokenizer) could change
without its pickle changing, so it is not cached here (it runs as a plain jit); so are calls
under a trace (jax.vmap, jit) and processes with several devices.

An entry is one file `<entry>-<key>.exe`: a magic line, a SHA-256 of the body, and the body
(the key again, the executable, its argument and output trees). It is written to a temporary
file and renamed, so a reader never sees half an entry; a damaged, truncated or unreadable
entry, or one whose argument check fails, is a miss: the program compiles as usual and the
entry is rewritten. Nothing here ever waits on a lock. The newest MAX_ENTRIES entries are
kept. Entries are pickles: load only a folder you own (as with JAX's own cache).

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

import contextlib
import hashlib
import io
import logging
import os
import pathlib
import pickle
import tempfile

import jax

logger = logging.getLogger(__name__)

MAGIC = b"jaxgen-executable 1\n"
MAX_ENTRIES = 32
SUFFIX = ".exe"
# modules whose classes and functions may appear in a cached call's static parts: their code
# is covered by the key (jaxgen's source hash, the jax / jaxlib versions) or never changes
TRUSTED_MODULES = ("jaxgen", "jax", "jaxlib", "numpy", "ml_dtypes", "builtins", "copyreg",
                   "collections", "functools", "operator", "enum", "_codecs", "types",
                   "dataclasses")
ENVIRONMENT_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAXGEN_CPU_KERNELS")

_STORE: "ExecutableStore | None" = None
_SOURCE_HASH: list[str] = []


class Uncacheable(Exception):
    """This call's program is not cached (it runs as a plain jit)."""


def enable(folder: str) -> None:
    """Keeps and reuses this process's generate programs in `folder` (created if missing)."""
    global _STORE
    os.makedirs(folder, exist_ok=True)
    _STORE = ExecutableStore(folder)


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
    """One folder of serialized executables, and the programs this process read from it."""

    def __init__(self, folder: str):
        self.folder = folder
        self.loaded: dict[str, object] = {}  # key -> jax.stages.Compiled
        self.counts = {"hits": 0, "written": 0, "damaged": 0, "uncached": 0}
        self._environment: bytes | None = None

    def path(self, name: str, key: str) -> str:
        return os.path.join(self.folder, f"{name}-{key}{SUFFIX}")

    def call(self, name: str, jitted, args: tuple, statics: dict):
        try:
            if jax.device_count() != 1:
                raise Uncacheable("several devices")
            if self._environment is None:
                self._environment = _static_bytes(environment())
            key = program_key(name, args, statics, self._environment)
        except Uncacheable as why:
            logger.debug("%s runs as a plain jit: %s", name, why)
            self.counts["uncached"] += 1
            return jitted(*args, **statics)
        program = self.loaded.get(key) or self._read(name, key)
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

    def _read(self, name: str, key: str):
        path = self.path(name, key)
        try:
            with open(path, "rb") as file:
                blob = file.read()
        except OSError:
            return None
        try:
            body = _check_blob(blob)
            entry = pickle.loads(body)
            if entry["key"] != key:
                raise ValueError("the entry holds another key")
            from jax.experimental.serialize_executable import deserialize_and_load

            from jaxgen.runtime.backend import register_native_targets

            register_native_targets()  # a stored program may call a native kernel
            program = deserialize_and_load(entry["executable"], entry["in_tree"],
                                           entry["out_tree"])
        except Exception as error:  # damaged or from another build: a miss, rewritten
            logger.warning("%s: damaged executable cache entry %s (%s); recompiling",
                           name, path, error)
            self.counts["damaged"] += 1
            self._drop(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: pruned last
        self.counts["hits"] += 1
        self.loaded[key] = program
        return program

    def _compile_and_write(self, name: str, jitted, args: tuple, statics: dict, key: str):
        lowered = jitted.lower(*args, **statics)
        with _past_persistent_cache():
            program = lowered.compile()
        self.loaded[key] = program
        try:
            from jax.experimental.serialize_executable import serialize

            executable, in_tree, out_tree = serialize(program)
            body = pickle.dumps({"key": key, "executable": executable, "in_tree": in_tree,
                                 "out_tree": out_tree}, protocol=4)
            self._write(self.path(name, key), body)
        except Exception as error:  # not serializable, disk full, read-only: not kept
            logger.info("%s: executable not kept (%s: %s)", name, type(error).__name__, error)
            return program
        self.counts["written"] += 1
        self._prune()
        return program

    def _write(self, path: str, body: bytes) -> None:
        handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=".writing-")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(temporary, path)
        except BaseException:
            self._drop(temporary)
            raise

    def _drop(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.remove(path)

    def _prune(self) -> None:
        try:
            entries = [entry for entry in os.scandir(self.folder)
                       if entry.name.endswith(SUFFIX)]
            entries.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
        except OSError:
            return
        for entry in entries[MAX_ENTRIES:]:
            self._drop(entry.path)


def _check_blob(blob: bytes) -> bytes:
    """The body of an entry file; ValueError when it is not whole."""
    head = len(MAGIC) + 32
    if len(blob) < head or not blob.startswith(MAGIC):
        raise ValueError("not an executable cache entry")
    body = blob[head:]
    if hashlib.sha256(body).digest() != blob[len(MAGIC):head]:
        raise ValueError("checksum mismatch")
    return body


@contextlib.contextmanager
def _past_persistent_cache():
    """JAX's persistent compilation cache off for one compile (and back on after)."""
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        yield
        return
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        reset_cache()


__all__ = ["ExecutableStore", "call", "disable", "enable", "environment", "program_key",
           "source_hash", "stats"]
