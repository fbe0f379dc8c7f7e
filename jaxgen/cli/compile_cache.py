"""What makes a second `jaxgen` run fast: a per-user cache, on by default, off with --no-cache.

    <root>/xla/      JAX's persistent compilation cache: every compiled program, also the small
                     ones (min compile time 0), so a warm run compiles nothing
    <root>/executables/  the generate programs (jaxgen.runtime.compiled's entries) as serialized
                     executables (jaxgen.runtime.executable_cache): a warm run neither traces nor
                     lowers them, which JAX's cache above still does to find a program
    <root>/models/   GGUF models converted once (weights as float32, tokenizer, config;
                     jaxgen.models.gguf_cache): a warm run reads one file instead of parsing
                     and dequantizing the GGUF

<root> is $JAXGEN_CACHE_DIR, else $XDG_CACHE_HOME/jaxgen, else ~/.cache/jaxgen. A
JAX_COMPILATION_CACHE_DIR the user set wins for compiled programs. A damaged entry is
detected and rebuilt (JAX recompiles a program it cannot read; the model cache checks sizes
and checksums); a cache that cannot be written only costs the time it would have saved.

`CacheStats` counts what a run took from the caches (the --verbose line; the tests).

Example:
    >>> os.environ["JAXGEN_CACHE_DIR"] = "/tmp/jaxgen-cache-example"
    >>> compile_cache_dir(), model_cache_dir()
    ('/tmp/jaxgen-cache-example/xla', '/tmp/jaxgen-cache-example/models')
    >>> del os.environ["JAXGEN_CACHE_DIR"]
"""
from __future__ import annotations

import logging
import os

MODEL_CACHE_LOGGER = "jaxgen.models.gguf_cache"


def cache_root() -> str:
    """$JAXGEN_CACHE_DIR, else $XDG_CACHE_HOME/jaxgen, else ~/.cache/jaxgen."""
    explicit = os.environ.get("JAXGEN_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxgen")


def compile_cache_dir() -> str:
    """Where the CLI keeps compiled programs."""
    return os.path.join(cache_root(), "xla")


def executable_cache_dir() -> str:
    """Where the CLI keeps its generate programs as serialized executables."""
    return os.path.join(cache_root(), "executables")


def model_cache_dir() -> str:
    """Where the CLI keeps converted GGUF models."""
    return os.path.join(cache_root(), "models")


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache in compile_cache_dir(), for every program (the small
    eager ones too: each costs tens of ms to compile, far less to read back), and the
    executable cache in executable_cache_dir(). A JAX_COMPILATION_CACHE_DIR the user set wins;
    a cache that cannot be used is skipped."""
    import jax

    try:
        if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            path = compile_cache_dir()
            os.makedirs(path, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except (OSError, AttributeError, ValueError):
        pass
    try:
        from jaxgen.runtime import executable_cache

        executable_cache.enable(executable_cache_dir())
    except OSError:
        pass


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
