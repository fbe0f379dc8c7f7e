"""The growing cache (`cache_implementation="dynamic"`): a host-side chunked driver.

Every compiled program has fixed shapes, so the cache cannot grow inside one. Instead the
driver runs the decode body (`jaxgen.decode.decode_steps`) `chunk_size` steps per jit call
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
static length (int32, small next to the cache). A later streaming driver reuses
`run_growing`'s loop shape (`on_chunk` sees the state after every chunk).

Example:
    >>> cfg = GenerationConfig(max_new_tokens=512, cache_implementation="dynamic",
    ...                        cache_config={"initial_length": 64, "chunk_size": 32})
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import validate_cache_config
from jaxgen.config import GenerationConfig
from jaxgen.decode import StepRecord, choose_and_write, decode_steps, prefill
from jaxgen.extensions import NO_EXTENSIONS, Extensions
from jaxgen.state import DecodeState, _next_pow2


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """What the driver did before one chunk (host-side log)."""

    step: int  # first decode step of the chunk
    capacity: int  # cache positions allocated for it
    cache_bytes: int  # bytes of the cache it ran with
    max_length: int  # longest row when it started


def _prefill_impl(params, state: DecodeState, cfg: GenerationConfig, ext: Extensions):
    steps = state.buffer_len - state.prompt_bucket
    record = StepRecord.empty(state.batch, max(steps, 1), state.model.vocab_size, cfg)
    state, logits = prefill(params, state)
    return choose_and_write(cfg, state, logits, record, 0, ext)


def _chunk_impl(params, state: DecodeState, record: StepRecord, start, cfg: GenerationConfig,
                ext: Extensions, chunk: int):
    steps = state.buffer_len - state.prompt_bucket
    stop = jnp.minimum(start + chunk, steps)
    return decode_steps(params, state, cfg, record, start, stop, ext)


_prefill_jit = jax.jit(_prefill_impl, donate_argnums=(1,), static_argnums=(3,))
_chunk_jit = jax.jit(_chunk_impl, donate_argnums=(1, 2), static_argnums=(5, 6))


def grow(state: DecodeState, needed: int) -> DecodeState:
    """Re-allocates the state's cache at the next bucket if it holds fewer than `needed`
    positions: max(2 x capacity, pow2(needed)), capped at the token buffer's length."""
    capacity = state.cache.max_len
    if capacity >= needed:
        return state
    new = min(max(2 * capacity, _next_pow2(needed)), state.buffer_len)
    return state.replace(cache=state.cache.resize(new))


def run_growing(params, state: DecodeState, cfg: GenerationConfig,
                ext: Extensions = NO_EXTENSIONS, *, chunk_size: int | None = None,
                on_chunk: Callable[[DecodeState, ChunkInfo], None] | None = None):
    """Decodes `state` to completion, growing its cache between jitted chunks.

    cfg must already be canonical (jaxgen.generate.canonical_config). Consumes `state`.
    Returns (final state, StepRecord, [ChunkInfo, ...]).
    """
    if not hasattr(state.cache, "resize"):
        raise ValueError(f"the {type(state.cache).__name__} cannot grow; build the state with "
                         f"cache_implementation='dynamic'")
    chunk = int(chunk_size or validate_cache_config("dynamic", cfg.cache_config)["chunk_size"])
    steps = state.buffer_len - state.prompt_bucket
    log: list[ChunkInfo] = []
    state = grow(state, state.prompt_bucket)
    log.append(ChunkInfo(step=0, capacity=state.cache.max_len, cache_bytes=state.cache.nbytes(),
                         max_length=int(np.max(jax.device_get(state.prompt_len)))))
    state, record = _prefill_jit(params, state, cfg, ext)
    step = 1
    while step < steps:
        done, length = jax.device_get((state.done, state.length))
        if np.all(done):
            break
        state = grow(state, int(np.max(length)) + chunk - 1)
        info = ChunkInfo(step=step, capacity=state.cache.max_len,
                         cache_bytes=state.cache.nbytes(), max_length=int(np.max(length)))
        log.append(info)
        _, state, record = _chunk_jit(params, state, record, jnp.int32(step), cfg, ext, chunk)
        step += chunk
        if on_chunk is not None:
            on_chunk(state, info)
    return state, record, log


def peak_cache_bytes(log: list[ChunkInfo]) -> int:
    return max((info.cache_bytes for info in log), default=0)
