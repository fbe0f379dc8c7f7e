"""The compiled programs every plan runs: one `jax.jit` per entry, the loop and the layout
static by name.

    run_donated(params, state, cfg, inputs, loop=, layout=)   a whole call; the state is donated
    run_kept(params, state, cfg, inputs, loop=, layout=)      the same without donation (beam
                                                              search, calls under jax.vmap / jit)
    start(params, state, cfg, inputs, loop=, layout=)         chunked driver: prefill + first step
    advance(params, state, carry, begin, end, cfg, inputs, loop=, layout=)   chunked: steps

`loop` is a static, hashable description (jaxgen.loops.decode.DecodeLoop,
jaxgen.loops.beam.BeamLoop, jaxgen.speculative.loop.SpeculativeLoop or a custom_generate
wrapper): equal loops share a compiled program. A loop may say how many rows its decode
forwards run (`decode_rows(state, cfg)`) and whether it carries a cache held as per-layer
buffers (`takes_layer_tuples`); the backend seam (`jaxgen.runtime.backend`) prepares params and
state from that and `layout`. `inputs` are the loop's dynamic extras (draft params, start
lengths) or None. New prompts of the same bucket, new sampling values and new keys reuse the
program.

Example (a second call with new prompts of the same bucket reuses the program):
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> before = jaxgen.trace_count()
    >>> for prompts in ([[1, 2, 3]], [[4, 5]]):
    ...     _ = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    >>> jaxgen.trace_count() - before
    1
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import jax

from jaxgen.runtime import backend, executable_cache

_TRACES = {"generate": 0}


def _decode_rows(state, loop, cfg) -> int | None:
    """How many rows each decode forward of the loop runs (None: it varies or is unknown)."""
    rows = getattr(loop, "decode_rows", None)
    return None if rows is None else rows(state, cfg)


def _prepared(params, state, loop, cfg, layout):
    """(params, state) as the loop runs them, through the backend seam."""
    return backend.prepare(getattr(state, "model", None), params, state,
                           _decode_rows(state, loop, cfg),
                           bool(getattr(loop, "takes_layer_tuples", False)), layout)


# The last params laid out for decoding, kept while the caller's arrays live: (key, weak
# references to the caller's leaves, the laid-out params).
_LAID_OUT: list = []
_LAID_OUT_LOCK = threading.RLock()  # a finalizer may run on the thread that holds it


def _laid_out(params, state, loop, cfg, layout):
    """params in the layout the backend plans for this program, computed by its own compiled
    call and kept for the next call with the same arrays (the same plan), so a generate call
    does not slice, fuse and transpose the weights again (0.3-0.5 s a call for SmolLM2 on a
    CPU; the streaming driver calls once a chunk). Params under a trace, or that stay as they
    are, are returned unchanged. One entry: the laid-out copy lives until other params are laid
    out or the caller's layer arrays are freed.

    Example:
        >>> import jaxgen
        >>> from jaxgen.models import tiny_llama
        >>> model, params = tiny_llama()                 # small: stays stacked
        >>> cfg = jaxgen.GenerationConfig(max_new_tokens=2)
        >>> state = jaxgen.init_state(model, [[1, 2]], cfg)
        >>> _laid_out(params, state, None, cfg, "auto") is params
        True
    """
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or not all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                             for leaf in leaves):
        return params
    plan = backend.layout_plan(getattr(state, "model", None), params,
                               _decode_rows(state, loop, cfg), layout)
    if plan is None:
        return params
    key = (tuple(map(id, leaves)), plan, layout)
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0][0] == key and all(
                ref() is leaf for ref, leaf in zip(_LAID_OUT[0][1], leaves)):
            return _LAID_OUT[0][2]
        _LAID_OUT.clear()  # the old copy goes before the new one is made
        pieces = executable_cache.call("layout_pieces", _layout_pieces_jit, (params,),
                                       loop=plan, layout=layout)
        laid_out = backend.with_layout(params, pieces, plan, layout)
        _LAID_OUT.append((key, [weakref.ref(leaf) for leaf in leaves], laid_out))
    # a layer array: the laid-out copy holds the caller's other arrays (the embedding), never
    # these, so this one is freed when the caller lets go
    weakref.finalize(jax.tree_util.tree_leaves(params["layers"])[0], _forget, key)
    return laid_out


def _forget(key) -> None:
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0][0] == key:
            _LAID_OUT.clear()


def _layout_pieces(params, *, loop, layout):
    """The backend's layout program; `loop` holds the plan (the static name the executable
    cache keys on beside `layout`)."""
    return backend.layout_pieces(params, loop, layout=layout)


_layout_pieces_jit = jax.jit(_layout_pieces, static_argnames=("loop", "layout"))


def _run(params, state, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    output = loop.run(*_prepared(params, state, loop, cfg, layout), cfg, inputs)
    final = getattr(output, "state", None)
    if final is None:
        return output
    return dataclasses.replace(output, state=backend.finish(final, layout))


def _start(params, state, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    state, carry = loop.start(*_prepared(params, state, loop, cfg, layout), cfg, inputs)
    return backend.finish(state, layout), carry


def _advance(params, state, carry, begin, end, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    params, state = _prepared(params, state, loop, cfg, layout)
    state, carry = loop.advance(params, state, carry, begin, end, cfg, inputs)
    return backend.finish(state, layout), carry


_STATIC = ("loop", "layout")
_run_donated = jax.jit(_run, donate_argnames=("state",), static_argnames=_STATIC)
_run_kept = jax.jit(_run, static_argnames=_STATIC)
_start_jit = jax.jit(_start, donate_argnames=("state",), static_argnames=_STATIC)
_advance_jit = jax.jit(_advance, donate_argnames=("state", "carry"), static_argnames=_STATIC)


# Each entry goes through jaxgen.runtime.executable_cache: a plain jit call unless a cache is
# enabled (the CLI enables one: a warm process then runs stored executables without tracing).
def run_donated(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return executable_cache.call("run_donated", _run_donated, (params, state, cfg, inputs),
                                 loop=loop, layout=layout)


def run_kept(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return executable_cache.call("run_kept", _run_kept, (params, state, cfg, inputs),
                                 loop=loop, layout=layout)


def start(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return executable_cache.call("start", _start_jit, (params, state, cfg, inputs),
                                 loop=loop, layout=layout)


def advance(params, state, carry, begin, end, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return executable_cache.call("advance", _advance_jit,
                                 (params, state, carry, begin, end, cfg, inputs),
                                 loop=loop, layout=layout)


def trace_count() -> int:
    """How many times a generate program has been traced (compiled) in this process."""
    return _TRACES["generate"]
