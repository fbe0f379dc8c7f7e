"""The compiled programs every plan runs: one `jax.jit` per entry, the loop static by name.

    run_donated(params, state, cfg, inputs, loop=)     a whole call; the state is donated
    run_kept(params, state, cfg, inputs, loop=)        the same without donation (beam search,
                                                       and calls under jax.vmap / jit)
    start(params, state, cfg, inputs, loop=)           chunked driver: prefill + first step
    advance(params, state, carry, begin, end, cfg, inputs, loop=)   chunked driver: steps

`loop` is a static, hashable description (jaxgen.decode.DecodeLoop, jaxgen.beam.BeamLoop,
jaxgen.speculative.SpeculativeLoop or a custom_generate wrapper): equal loops share a
compiled program. `inputs` are the loop's dynamic extras (draft params, start lengths) or
None. New prompts of the same bucket, new sampling values and new keys reuse the program.

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

import jax

from jaxgen import executable_cache

_TRACES = {"generate": 0}


def _decoding_rows(state, loop, cfg) -> int | None:
    """How many rows each decode forward of the loop runs (None: it varies or is unknown):
    plain and assisted decoding's batch (assisted rounds: a plain step's rows; verify forwards
    are wider), beam search's batch x beams."""
    from jaxgen.beam import BeamLoop
    from jaxgen.decode import DecodeLoop
    from jaxgen.speculative.loop import SpeculativeLoop

    if type(loop) in (DecodeLoop, SpeculativeLoop):  # they run a DecodeState
        return state.batch
    if type(loop) is BeamLoop:
        return state.batch * int(cfg.num_beams)
    return None


def _decoding_inputs(params, state, loop, cfg):
    """The weights' layout the loop runs and the state it carries (models/layer_split.py:
    weights split per layer on CPU, the projections fused when decode forwards run a few
    rows, the native few-row kernel's layout where it is available; params already laid out
    by `_laid_out` pass as they are; then the KV cache is split per layer too,
    jaxgen.cache.layer_split, for the loops known to carry it as it is: plain, assisted and
    beam decoding)."""
    from jaxgen.beam import BeamLoop
    from jaxgen.cache.layer_split import split_cache
    from jaxgen.decode import DecodeLoop
    from jaxgen.models.layer_split import for_decoding
    from jaxgen.speculative.loop import SpeculativeLoop

    decoded = for_decoding(getattr(state, "model", None), params,
                           rows=_decoding_rows(state, loop, cfg))
    unrolled = isinstance(decoded, dict) and isinstance(decoded.get("layers"), (list, tuple))
    if unrolled and type(loop) in (DecodeLoop, SpeculativeLoop, BeamLoop):
        state = state.replace(cache=split_cache(state.cache))
    return decoded, state


# The last params laid out for decoding, kept while the caller's arrays live: (key, weak
# references to the caller's leaves, the laid-out params).
_LAID_OUT: list = []
_LAID_OUT_LOCK = threading.RLock()  # a finalizer may run on the thread that holds it


def _laid_out(params, state, loop, cfg):
    """params in the layout `for_decoding` gives them, computed by its own compiled call and
    kept for the next call with the same arrays (the same plan), so a generate call does not
    slice, fuse and transpose the weights again (0.3-0.5 s a call for SmolLM2 on a CPU; the
    streaming driver calls once a chunk). Params under a trace, or that stay as they are, are
    returned unchanged. One entry: the laid-out copy lives until other params are laid out or
    the caller's stacked layer arrays are freed.

    Example:
        >>> import jaxgen
        >>> from jaxgen.models import tiny_llama
        >>> model, params = tiny_llama()                 # small: stays stacked
        >>> cfg = jaxgen.GenerationConfig(max_new_tokens=2)
        >>> state = jaxgen.init_state(model, [[1, 2]], cfg)
        >>> _laid_out(params, state, None, cfg) is params
        True
    """
    import weakref

    from jaxgen.models.layer_split import decoding_plan

    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or not all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                             for leaf in leaves):
        return params
    model = getattr(state, "model", None)
    plan = decoding_plan(model, params, _decoding_rows(state, loop, cfg))
    if plan is None:
        return params
    from jaxgen.models.layer_split import with_split_pieces

    key = (tuple(map(id, leaves)), tuple(sorted(plan.items())))
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0][0] == key and all(
                ref() is leaf for ref, leaf in zip(_LAID_OUT[0][1], leaves)):
            return _LAID_OUT[0][2]
        _LAID_OUT.clear()  # the old copy goes before the new one is made
        pieces = _split_pieces_cached(params, **plan)
        laid_out = with_split_pieces(params, pieces, kernel=plan["kernel"])
        _LAID_OUT.append((key, [weakref.ref(leaf) for leaf in leaves], laid_out))
    # a stacked layer array: the laid-out copy holds the caller's other arrays (the embedding),
    # never these, so this one is freed when the caller lets go
    weakref.finalize(jax.tree_util.tree_leaves(params["layers"])[0], _forget, key)
    return laid_out


def _forget(key) -> None:
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0][0] == key:
            _LAID_OUT.clear()


def _split_pieces(params, *, loop):
    """`split_pieces` with its plan passed as `loop` (sorted keyword pairs), the static
    argument name the executable cache keys on."""
    from jaxgen.models.layer_split import split_pieces

    return split_pieces(params, **dict(loop))


_split_pieces_jit = jax.jit(_split_pieces, static_argnames=("loop",))


def _split_pieces_cached(params, **plan):
    """The layout program through the executable cache (a warm CLI process compiles nothing)."""
    return executable_cache.call("split_pieces", _split_pieces_jit, (params,),
                                 tuple(sorted(plan.items())))


def _stacked_cache(state):
    """The state with its cache stacked back (the caller's layout, so donated input buffers
    alias the outputs and every chunk of the chunked driver runs the same program)."""
    from jaxgen.cache.layer_split import stack_cache

    if not hasattr(state, "cache"):  # None, or a loop state without a cache
        return state
    return state.replace(cache=stack_cache(state.cache))


def _run(params, state, cfg, inputs, *, loop):
    _TRACES["generate"] += 1
    output = loop.run(*_decoding_inputs(params, state, loop, cfg), cfg, inputs)
    final = getattr(output, "state", None)
    return output if final is None else dataclasses.replace(output, state=_stacked_cache(final))


def _start(params, state, cfg, inputs, *, loop):
    _TRACES["generate"] += 1
    state, carry = loop.start(*_decoding_inputs(params, state, loop, cfg), cfg, inputs)
    return _stacked_cache(state), carry


def _advance(params, state, carry, begin, end, cfg, inputs, *, loop):
    _TRACES["generate"] += 1
    params, state = _decoding_inputs(params, state, loop, cfg)
    state, carry = loop.advance(params, state, carry, begin, end, cfg, inputs)
    return _stacked_cache(state), carry


_run_donated = jax.jit(_run, donate_argnames=("state",), static_argnames=("loop",))
_run_kept = jax.jit(_run, static_argnames=("loop",))
_start_jit = jax.jit(_start, donate_argnames=("state",), static_argnames=("loop",))
_advance_jit = jax.jit(_advance, donate_argnames=("state", "carry"), static_argnames=("loop",))


# Each entry goes through jaxgen.executable_cache: a plain jit call unless a cache is enabled
# (the CLI enables one: a warm process then runs stored executables without tracing).
def run_donated(params, state, cfg, inputs, *, loop):
    params = _laid_out(params, state, loop, cfg)
    return executable_cache.call("run_donated", _run_donated, (params, state, cfg, inputs),
                                 loop)


def run_kept(params, state, cfg, inputs, *, loop):
    params = _laid_out(params, state, loop, cfg)
    return executable_cache.call("run_kept", _run_kept, (params, state, cfg, inputs), loop)


def start(params, state, cfg, inputs, *, loop):
    params = _laid_out(params, state, loop, cfg)
    return executable_cache.call("start", _start_jit, (params, state, cfg, inputs), loop)


def advance(params, state, carry, begin, end, cfg, inputs, *, loop):
    params = _laid_out(params, state, loop, cfg)
    return executable_cache.call("advance", _advance_jit,
                                 (params, state, carry, begin, end, cfg, inputs), loop)


def trace_count() -> int:
    """How many times a generate program has been traced (compiled) in this process."""
    return _TRACES["generate"]
