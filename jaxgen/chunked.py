"""The chunked driver: the decode body N steps per jit call, host work between chunks.

A jitted `while_loop` cannot print, read a clock or see a cancel button. The chunked driver
runs the *same* body as the single-call path (`jaxgen.decode.decode_steps`, same processors,
same per-row keys), so its tokens are identical; between chunks it

  * hands each row's new tokens to that row's streamer (one `put` per token, as HF does),
  * checks `max_time` (HF's MaxTimeCriteria: all rows stop once the time is up) and adapts
    the next chunk's length to the measured step time so the overshoot stays about one step,
  * checks cancellation (a streamer's `cancel()` or a `stop_event`), ending within one chunk.

The first chunk holds only the prefill and the first token, so the time to first token is
one prefill. Chunk lengths are dynamic arguments: changing them never recompiles.

Example:
    >>> out = jaxgen.generate(params, state, cfg, streamer=TextStreamer(tokenizer))
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import stopping
from jaxgen.config import GenerationConfig
from jaxgen.decode import StepRecord, decode_start, decode_steps
from jaxgen.extensions import NO_EXTENSIONS, Extensions
from jaxgen.speculative.loop import speculative_rounds, speculative_start
from jaxgen.state import DecodeState

DEFAULT_CHUNK = 8


@dataclasses.dataclass
class ChunkTimings:
    """Host-side log of one chunked run (seconds)."""

    first_token_s: float = 0.0  # from the call to the first token being on the host
    total_s: float = 0.0
    chunks: int = 0
    steps: int = 0
    chunk_s: list = dataclasses.field(default_factory=list)  # wall time of each decode chunk


def _chunk_impl(params, state: DecodeState, record: StepRecord, start, stop,
                cfg: GenerationConfig, ext: Extensions):
    return decode_steps(params, state, cfg, record, start, stop, ext)


def _spec_start_impl(params, state: DecodeState, cfg: GenerationConfig, draft_params,
                     start_tokens, ext: Extensions, drafter):
    return speculative_start(params, state, cfg, drafter, draft_params, start_tokens, ext)


def _spec_chunk_impl(params, state: DecodeState, carry, record: StepRecord, start, stop,
                     cfg: GenerationConfig, draft_params, ext: Extensions, drafter):
    _, state, carry, record = speculative_rounds(params, state, carry, record, cfg, drafter,
                                                 draft_params, ext, start=start, stop=stop)
    return state, carry, record


_start_jit = jax.jit(decode_start, donate_argnums=(1,), static_argnums=(3,))
_chunk_jit = jax.jit(_chunk_impl, donate_argnums=(1, 2), static_argnums=(6,))
_spec_start_jit = jax.jit(_spec_start_impl, donate_argnums=(1,), static_argnums=(5, 6))
_spec_chunk_jit = jax.jit(_spec_chunk_impl, donate_argnums=(1, 2, 3), static_argnums=(8, 9))


@dataclasses.dataclass(frozen=True)
class Assisted:
    """What the chunked driver needs to run the assisted (speculative) loop in chunks."""

    drafter: object
    draft_params: object = None
    start_tokens: object = None


class _Plain:
    """One token per step: the greedy / sampling body."""

    def __init__(self, params, cfg, ext):
        self.params, self.cfg, self.ext = params, cfg, ext

    def start(self, state):
        state, record = _start_jit(self.params, state, self.cfg, self.ext)
        return state, record

    def advance(self, state, record, start, stop):
        _, state, record = _chunk_jit(self.params, state, record, start, stop, self.cfg,
                                      self.ext)
        return state, record

    @staticmethod
    def finish(state, record):
        return state, record, None


class _Speculative:
    """One speculative round per step (each round emits 1..K+1 tokens per row)."""

    def __init__(self, params, cfg, ext, assisted: Assisted):
        self.params, self.cfg, self.ext, self.assisted = params, cfg, ext, assisted

    def start(self, state):
        a = self.assisted
        state, carry, record = _spec_start_jit(self.params, state, self.cfg, a.draft_params,
                                               a.start_tokens, self.ext, a.drafter)
        return state, (carry, record)

    def advance(self, state, extra, start, stop):
        a = self.assisted
        state, carry, record = _spec_chunk_jit(self.params, state, extra[0], extra[1], start,
                                               stop, self.cfg, a.draft_params, self.ext,
                                               a.drafter)
        return state, (carry, record)

    @staticmethod
    def finish(state, extra):
        carry, record = extra
        return state.replace(spec=carry), record, carry.stats


def as_streamers(streamer, batch: int) -> list | None:
    """None, one streamer (batch 1 only, as HF) or one per row -> a list of B streamers."""
    if streamer is None:
        return None
    if isinstance(streamer, (list, tuple)):
        if len(streamer) != batch:
            raise ValueError(f"`streamer`: got {len(streamer)} streamers for {batch} rows; pass "
                             f"one per row")
        return list(streamer)
    if batch != 1:
        raise ValueError(f"`streamer`: one streamer cannot take a batch of {batch} rows; pass a "
                         f"list with one streamer per row")
    return [streamer]


class _Emitter:
    """Feeds every row's streamer the tokens it has not seen yet."""

    def __init__(self, streamers: list | None, state: DecodeState):
        self.streamers = streamers
        prompt_len = np.asarray(jax.device_get(state.prompt_len))
        self.sent = prompt_len.copy()
        if streamers:
            tokens = np.asarray(jax.device_get(state.tokens))
            for b, streamer in enumerate(streamers):
                streamer.put(tokens[b, :prompt_len[b]][None])

    def emit(self, state: DecodeState) -> None:
        if not self.streamers:
            return
        tokens, length = jax.device_get((state.tokens, state.length))
        for b, streamer in enumerate(self.streamers):
            for token in np.asarray(tokens)[b, self.sent[b]:length[b]]:
                streamer.put(np.asarray([token]))
            self.sent[b] = max(self.sent[b], int(length[b]))

    def end(self) -> None:
        for streamer in self.streamers or ():
            streamer.end()

    def cancelled(self) -> bool:
        return any(getattr(s, "cancelled", False) for s in self.streamers or ())


def stop_all(state: DecodeState, reason: int) -> DecodeState:
    """Marks every live row done with `reason` (host-side, between chunks)."""
    reason_now = jnp.where(state.done, state.stop_reason, reason).astype(jnp.int32)  # [B]
    return state.replace(done=jnp.ones_like(state.done), stop_reason=reason_now)


def run_chunked(params, state: DecodeState, cfg: GenerationConfig,
                ext: Extensions = NO_EXTENSIONS, *, streamer=None,
                chunk_size: int = DEFAULT_CHUNK, max_time: float | None = None,
                stop_event: threading.Event | None = None,
                prepare_chunk: Callable[[DecodeState, int, int], DecodeState] | None = None,
                timings: ChunkTimings | None = None, assisted: Assisted | None = None):
    """Decodes `state` to completion in chunks. `cfg` must be canonical. Consumes `state`.

    max_time: seconds (HF's max_time; pass it here, not in the jitted cfg). streamer: None, a streamer (batch 1) or one per row. prepare_chunk(state, step, n):
    optional host hook run before each chunk of n steps (e.g. growing the cache).
    assisted: run the speculative loop (a step is then one round).
    Returns (final state, StepRecord, SpeculativeStats or None).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    start_time = time.perf_counter()
    deadline = None if max_time is None else start_time + float(max_time)
    timings = timings if timings is not None else ChunkTimings()
    streamers = as_streamers(streamer, state.batch)
    emitter = _Emitter(streamers, state)
    total_steps = state.buffer_len - state.prompt_bucket
    if prepare_chunk is not None:
        state = prepare_chunk(state, 0, 1)
    program = _Plain(params, cfg, ext) if assisted is None else _Speculative(params, cfg, ext,
                                                                              assisted)
    state, extra = program.start(state)
    emitter.emit(state)
    timings.first_token_s = time.perf_counter() - start_time
    step, step_time = 1, None
    while step < total_steps:
        done = np.asarray(jax.device_get(state.done))
        if done.all():
            break
        if emitter.cancelled() or (stop_event is not None and stop_event.is_set()):
            state = stop_all(state, stopping.CANCELLED)
            break
        chunk = chunk_size
        if deadline is not None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                state = stop_all(state, stopping.MAX_TIME)
                break
            if step_time is not None:  # keep the overshoot to about one step
                chunk = int(np.clip(remaining // step_time + 1, 1, chunk_size))
        chunk = min(chunk, total_steps - step)
        if prepare_chunk is not None:
            state = prepare_chunk(state, step, chunk)
        began = time.perf_counter()
        state, extra = program.advance(state, extra, jnp.int32(step), jnp.int32(step + chunk))
        state.length.block_until_ready()
        timings.chunk_s.append(time.perf_counter() - began)
        measured = timings.chunk_s[-1] / chunk
        step_time = measured if step_time is None else 0.5 * (step_time + measured)
        step += chunk
        timings.chunks += 1
        emitter.emit(state)
    if deadline is not None and time.perf_counter() > deadline:
        state = stop_all(state, stopping.MAX_TIME)
    emitter.end()
    timings.total_s = time.perf_counter() - start_time
    timings.steps = step
    return program.finish(state, extra)


def needs_chunked(cfg: GenerationConfig, streamer, stop_event) -> bool:
    """Streaming, max_time and cancellation need the host between chunks."""
    return streamer is not None or cfg.max_time is not None or stop_event is not None


__all__: Sequence[str] = ("run_chunked", "needs_chunked", "as_streamers", "ChunkTimings", "Assisted",
                          "stop_all", "DEFAULT_CHUNK")
