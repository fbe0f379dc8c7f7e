"""The cache-security tests' processes (tests/test_cache_security.py): each scenario runs in a
fresh process (JAX's persistent cache, the kernel build and the umask are process-wide) and
prints one JSON line.

    python tests/cache_security_script.py caches        # enable the CLI's caches, generate
    python tests/cache_security_script.py xla           # one jit through JAX's persistent cache
    python tests/cache_security_script.py fallback      # generate while the kernel build hangs
    python tests/cache_security_script.py build SOURCE  # build_library(SOURCE) in the foreground
    python tests/cache_security_script.py background SOURCE  # a background build, then sleep
    python tests/cache_security_script.py no-cache SOURCE    # build with use_temporary_folder()

Settings come from the environment the test sets ($JAXGEN_CACHE_DIR, $JAXGEN_KERNEL_DIR, $CXX,
$JAXGEN_KERNEL_BUILD_TIMEOUT, SCRIPT_UMASK).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time
import warnings


def _modes(root: str) -> dict:
    """Every folder and file under root (and root) -> its mode, octal."""
    out = {".": oct(os.stat(root).st_mode & 0o777)}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = oct(os.lstat(path).st_mode & 0o777)
    return out


def caches() -> dict:
    """The CLI's caches enabled under $JAXGEN_CACHE_DIR, a generate call and a plain jit."""
    import jax
    import jax.numpy as jnp

    import jaxgen
    from jaxgen.cli.compile_cache import enable_compile_cache
    from jaxgen.models import tiny_llama
    from jaxgen.runtime import executable_cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_compile_cache()
        model, params = tiny_llama(seed=4, num_layers=1)
        cfg = jaxgen.GenerationConfig(max_new_tokens=3)
        jaxgen.generate(params, jaxgen.init_state(model, [[1, 5, 9]], cfg), cfg)
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)).block_until_ready()
    return {"xla_dir": jax.config.jax_compilation_cache_dir,
            "executables": executable_cache._STORE.folder,
            "stats": executable_cache.stats(),
            "warnings": [str(w.message) for w in caught],
            "modes": _modes(os.environ["JAXGEN_CACHE_DIR"])}


def xla() -> dict:
    """One jit program through JAX's persistent cache in $JAXGEN_CACHE_DIR/xla: the cache's
    hits and misses, and the warnings JAX gave."""
    import jax
    import jax.numpy as jnp

    from jaxgen.cli.compile_cache import enable_compile_cache

    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_compile_cache()
        jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(8.0)).block_until_ready()
    return {"hits": events.count("/jax/compilation_cache/cache_hits"),
            "misses": events.count("/jax/compilation_cache/cache_misses"),
            "warnings": [str(w.message) for w in caught]}


def fallback() -> dict:
    """generate(layout="split") while the kernel build hangs (a background build started
    first, as the CLI does): the tokens, next to the portable program's."""
    import jax

    import jaxgen
    from jaxgen.models import tiny_llama
    from jaxgen.runtime import backend

    model, params = tiny_llama(seed=4, num_layers=1)
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)
    prompts = [[1, 5, 9, 2], [3, 4]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.start_native_build()
        split = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg,
                                layout="split")
    portable = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg,
                               layout="portable")
    return {"split": jax.device_get(split.sequences).tolist(),
            "portable": jax.device_get(portable.sequences).tolist(),
            "warnings": [str(w.message) for w in caught]}


def build(source: str) -> dict:
    from jaxgen.backends.cpu.kernels import build as kernels

    print("building", flush=True)
    return {"path": str(kernels.build_library(pathlib.Path(source)))}


def background(source: str) -> dict:
    from jaxgen.backends.cpu.kernels import build as kernels

    kernels.SOURCE = pathlib.Path(source)  # what start_background_build builds
    kernels.start_background_build()
    print("building", flush=True)
    time.sleep(600)  # the main thread busy elsewhere (a model load) when SIGTERM comes
    return {}


def no_cache(source: str) -> dict:
    from jaxgen.backends.cpu.kernels import build as kernels

    folder = kernels.use_temporary_folder()
    path = kernels.build_library(pathlib.Path(source))
    return {"path": str(path), "folder": str(folder), "mode": oct(folder.stat().st_mode & 0o777)}


SCENARIOS = {"caches": caches, "xla": xla, "fallback": fallback, "build": build,
             "background": background, "no-cache": no_cache}

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if "SCRIPT_UMASK" in os.environ:
        os.umask(int(os.environ["SCRIPT_UMASK"], 8))
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])))
