"""The growing cache (`cache_implementation="dynamic"`): a host-side chunked driver.

Every compiled program has fixed shapes, so the cache cannot grow inside one. Instead the
driver runs the decode body (`jaxgen.loops.decode.decode_steps`) `chunk_size` steps per jit call
and, between calls, re-allocates the cache at the next power-of-two bucket when the next
chunk would not fit:

    prefill (jit)                        cache capacity C0 = pow2 >= max(initial_length,
                                                             prompt bucket + chunk_size)
    while rows are live:
        if max(length) + chunk_size - 1 > C:  C = max(2C, pow2(needed)), cache.resize(C)
        decode_steps(chunk_size) (jit)   one compile per capacity bucket (log2 many)

The outputs are identical to the single-call static path (same body, same processors, same
keys; masked keys beyond a row's length contribute exactly zero), while the cache's bytes
follow the real length: at most max(2 x needed, C0). The token buffer [B, T] keeps its full
static length (int32, small next to the cache). The loop is the streaming driver's
(jaxgen.drivers.chunked.run_chunked); `on_chunk` sees the state before every decode chunk.

Example (illustration; `jaxgen.generate` runs this driver for the "dynamic" kind):
    >>> cfg = GenerationConfig(max_new_tokens=512, cache_implementation="dynamic",  # doctest: +SKIP
    ...                        cache_config={"initial_length": 64, "chunk_size": 32})
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jaxgen.cache import validate_cache_config
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.core.state import DecodeState, next_pow2
from jaxgen.drivers.chunked import run_chunked
from jaxgen.loops.decode import DecodeLoop


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """What the driver did before one chunk (host-side log)."""

    step: int  # first decode step of the chunk
    capacity: int  # cache positions allocated for it
    cache_bytes: int  # bytes of the cache it ran with
    max_length: int  # longest row when it started


def grow(state: DecodeState, needed: int) -> DecodeState:
    """Re-allocates the state's cache at the next bucket if it holds fewer than `needed`
    positions: max(2 x capacity, pow2(needed)), capped at the token buffer's length."""
    capacity = state.cache.max_len
    if capacity >= needed:
        return state
    new = min(max(2 * capacity, next_pow2(needed)), state.buffer_len)
    return state.replace(cache=state.cache.resize(new))


def grow_before_chunks(log: list,
                       on_chunk: Callable[[DecodeState, ChunkInfo], None] | None = None):
    """The chunked driver's `prepare_chunk` hook for the growing cache: re-allocates the
    cache before a chunk that would not fit and logs a ChunkInfo per chunk into `log`."""
    def prepare(st: DecodeState, step: int, steps: int) -> DecodeState:
        if step == 0:  # the prefill writes the whole prompt bucket
            longest = int(np.max(jax.device_get(st.prompt_len)))
            st = grow(st, st.prompt_bucket)
        else:
            longest = int(np.max(jax.device_get(st.length)))
            # no row writes past its prompt plus its budget (the buffer may be a bucket longer)
            last = int(np.max(jax.device_get(st.prompt_len + st.max_new)))
            st = grow(st, min(longest + steps - 1, last))
        info = ChunkInfo(step=step, capacity=st.cache.max_len, cache_bytes=st.cache.nbytes(),
                         max_length=longest)
        log.append(info)
        if on_chunk is not None and step > 0:
            on_chunk(st, info)
        return st
    return prepare


def growing_chunk_size(cfg: GenerationConfig, chunk_size: int | None = None) -> int:
    """Steps per jit call: chunk_size, else cache_config["chunk_size"] (default 64)."""
    return int(chunk_size or validate_cache_config("dynamic", cfg.cache_config)["chunk_size"])


def run_growing(params, state: DecodeState, cfg: GenerationConfig,
                ext: Extensions = NO_EXTENSIONS, *, chunk_size: int | None = None,
                on_chunk: Callable[[DecodeState, ChunkInfo], None] | None = None,
                **chunked_options):
    """Decodes `state` to completion (greedy / sampling), growing its cache between jitted
    chunks. cfg must already be canonical (jaxgen.api.plan.canonical_config). Consumes `state`.

    chunked_options: streamer / max_time / stop_event / timings for the chunked driver.
    Returns (final state, GenerateOutput, [ChunkInfo, ...]).
    """
    if not hasattr(state.cache, "resize"):
        raise ValueError(f"the {type(state.cache).__name__} cannot grow; build the state with "
                         f"cache_implementation='dynamic'")
    log: list[ChunkInfo] = []
    out = run_chunked(DecodeLoop(ext), params, state, cfg, None,
                      chunk_size=growing_chunk_size(cfg, chunk_size),
                      prepare_chunk=grow_before_chunks(log, on_chunk), **chunked_options)
    return out.state, out, log
