"""What makes a second `jaxgen` run fast: a per-user cache, on by default, off with --no-cache.

    <root>/key       the user's secret (32 random bytes, 0600) that signs executable entries
    <root>/xla/      JAX's persistent compilation cache: every compiled program, also the small
                     ones (min compile time 0), so a warm run compiles nothing
    <root>/executables/  the generate programs (jaxgen.runtime.compiled's entries) as serialized
                     executables (jaxgen.runtime.executable_cache): a warm run neither traces nor
                     lowers them, which JAX's cache above still does to find a program
    <root>/models/   GGUF models converted once (weights as float32, tokenizer, config;
                     jaxgen.models.gguf_cache): a warm run reads one file instead of parsing
                     and dequantizing the GGUF

<root> is $JAXGEN_CACHE_DIR, else $XDG_CACHE_HOME/jaxgen, else ~/.cache/jaxgen. Every folder
is private (jaxgen.storage.private): created 0700 whatever the umask, and it and the folders
above it checked (the user's or root's, not writable by others) before anything is read; a
folder that fails is replaced, with a one-line warning, by a private folder for this run.
Files jaxgen writes are 0600; JAX's own entries in xla/ are narrowed to 0600 as they are
written (jaxgen.cli.persistent_cache), and even before that nobody else can reach them
through the 0700 folder. A JAX_COMPILATION_CACHE_DIR the user set wins for compiled programs.
A damaged entry is detected and rebuilt (an xla/ entry JAX cannot read is removed and
written again; executables carry a keyed tag; the model cache checks sizes and checksums);
a cache that cannot be written only costs the time it would have saved. The native kernels
live in a cache of their own (jaxgen.backends.cpu.kernels.build, reached through
jaxgen.runtime.backend): `prepare_kernels` checks $JAXGEN_CPU_KERNELS and starts their build
in the background before the model loads.

`CacheStats` counts what a run took from the caches (the --verbose line; the tests).

Example:
    >>> import tempfile
    >>> os.environ["JAXGEN_CACHE_DIR"] = root = tempfile.mkdtemp()
    >>> compile_cache_dir() == os.path.join(root, "xla"), model_cache_dir() == root + "/models"
    (True, True)
    >>> oct(os.stat(model_cache_dir()).st_mode & 0o777)
    '0o700'
    >>> del os.environ["JAXGEN_CACHE_DIR"]
"""
from __future__ import annotations

import logging
import os

from jaxgen.storage.private import private_folder_or_fallback

MODEL_CACHE_LOGGER = "jaxgen.models.gguf_cache"


def cache_root() -> str:
    """$JAXGEN_CACHE_DIR, else $XDG_CACHE_HOME/jaxgen, else ~/.cache/jaxgen (as configured;
    private_root() is the folder in use)."""
    explicit = os.environ.get("JAXGEN_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxgen")


def private_root() -> str:
    """cache_root() as a private folder (created 0700 and checked), or this run's private
    fallback folder, with a one-line warning, when it is not private."""
    return str(private_folder_or_fallback(cache_root(), "jaxgen cache"))


def _private_sub(name: str, what: str) -> str:
    return str(private_folder_or_fallback(os.path.join(private_root(), name), what))


def compile_cache_dir() -> str:
    """Where the CLI keeps compiled programs (a private folder)."""
    return _private_sub("xla", "compilation cache")


def executable_cache_dir() -> str:
    """Where the CLI keeps its generate programs as serialized executables (a private folder)."""
    return _private_sub("executables", "executable cache")


def model_cache_dir() -> str:
    """Where the CLI keeps converted GGUF models (a private folder)."""
    return _private_sub("models", "model cache")


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache in compile_cache_dir(), for every program (the small
    eager ones too: each costs tens of ms to compile, far less to read back), and the
    executable cache in executable_cache_dir(), signed with the key in private_root(). A
    JAX_COMPILATION_CACHE_DIR the user set wins; a cache that cannot be used is skipped."""
    import jax

    from jaxgen.cli import persistent_cache

    try:
        if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            path = compile_cache_dir()
            persistent_cache.mark_private(path)
            jax.config.update("jax_compilation_cache_dir", path)
        persistent_cache.guard()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except (OSError, AttributeError, ValueError):
        pass
    try:
        from jaxgen.runtime import executable_cache

        executable_cache.enable(executable_cache_dir(), key_folder=private_root())
    except OSError:
        pass


def prepare_kernels(no_cache: bool) -> None:
    """Before the model loads: $JAXGEN_CPU_KERNELS and $JAXGEN_KERNEL_ARCH checked (a
    ValueError naming the variable and the values it takes), and the native kernels' build
    started in the background where they are on.
    no_cache: nothing is written to the user's kernel cache (a kernel missing there is built
    in a private folder removed at exit)."""
    from jaxgen.runtime import backend

    backend.kernel_setting()
    backend.kernel_arch()
    backend.start_native_build(temporary=no_cache)


class CacheStats(logging.Handler):
    """Counts, while the process runs: compile seconds, programs read from the compilation
    cache (`hits`) and compiled (`misses`, only counted while the cache is on), and the
    model cache's outcome ("hit", "built", "rebuilt" or None when it was not used)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        import jax

        self.compile_s = 0.0
        self.hits = 0
        self.misses = 0
        self.model_cache: str | None = None

        def on_duration(event, duration, **_):
            if event.endswith("backend_compile_duration"):
                self.compile_s += duration

        def on_event(event, **_):
            if event == "/jax/compilation_cache/cache_hits":
                self.hits += 1
            elif event == "/jax/compilation_cache/cache_misses":
                self.misses += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        logger = logging.getLogger(MODEL_CACHE_LOGGER)
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def emit(self, record):
        outcome = record.getMessage().split(" ", 1)[0]
        if outcome in ("hit", "built", "rebuilt"):
            self.model_cache = outcome
        elif record.levelno >= logging.WARNING:
            self.model_cache = "not written"

    def summary(self) -> str:
        from jaxgen.runtime import executable_cache

        model = f"model cache {self.model_cache}" if self.model_cache else "no model cache"
        stored = executable_cache.stats()
        executables = (f", {stored['hits']} executables read back, {stored['written']} written"
                       if stored else "")
        return (f"{model}, {self.hits} programs from the compile cache, {self.misses} "
                f"compiled{executables}")
