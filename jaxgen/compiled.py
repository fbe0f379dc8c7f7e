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

import jax

from jaxgen import executable_cache

_TRACES = {"generate": 0}


def _decoding_inputs(params, state, loop, cfg):
    """The weights' layout the loop runs and the state it carries (models/layer_split.py:
    weights split per layer on CPU, the projections fused when decode forwards run a few
    rows: plain and assisted decoding's batch, beam search's batch x beams; then the KV
    cache is split per layer too, jaxgen.cache.layer_split, for the loops known to carry it
    as it is: plain, assisted and beam decoding)."""
    from jaxgen.beam import BeamLoop
    from jaxgen.cache.layer_split import split_cache
    from jaxgen.decode import DecodeLoop
    from jaxgen.models.layer_split import for_decoding
    from jaxgen.speculative.loop import SpeculativeLoop

    rows = None  # other loops: unknown
    if type(loop) in (DecodeLoop, SpeculativeLoop):  # they run a DecodeState
        rows = state.batch  # assisted rounds: a plain step's rows (verify forwards are wider)
    elif type(loop) is BeamLoop:
        rows = state.batch * int(cfg.num_beams)
    decoded = for_decoding(getattr(state, "model", None), params, rows=rows)
    unrolled = isinstance(decoded, dict) and isinstance(decoded.get("layers"), (list, tuple))
    if unrolled and type(loop) in (DecodeLoop, SpeculativeLoop, BeamLoop):
        state = state.replace(cache=split_cache(state.cache))
    return decoded, state


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
    return executable_cache.call("run_donated", _run_donated, (params, state, cfg, inputs),
                                 loop)


def run_kept(params, state, cfg, inputs, *, loop):
    return executable_cache.call("run_kept", _run_kept, (params, state, cfg, inputs), loop)


def start(params, state, cfg, inputs, *, loop):
    return executable_cache.call("start", _start_jit, (params, state, cfg, inputs), loop)


def advance(params, state, carry, begin, end, cfg, inputs, *, loop):
    return executable_cache.call("advance", _advance_jit,
                                 (params, state, carry, begin, end, cfg, inputs), loop)


def trace_count() -> int:
    """How many times a generate program has been traced (compiled) in this process."""
    return _TRACES["generate"]
