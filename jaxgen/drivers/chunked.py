"""The chunked driver: the decode body N steps per jit call, host work between chunks.

A jitted `while_loop` cannot print, read a clock or see a cancel button. The chunked driver
runs the *same* loop as the single-call path (the plan's loop object: its `start` and
`advance`, same processors, same per-row keys), so its tokens are identical; between chunks it

  * hands each row's new tokens to that row's streamer (one `put` per token, as HF does),
  * checks `max_time` (HF's MaxTimeCriteria: all rows stop once the time is up) and adapts
    the next chunk's length to the measured step time so the overshoot stays about one step,
  * checks cancellation (a streamer's `cancel()` or a `stop_event`), ending within one chunk.

The first chunk holds only the prefill and the first token, so the time to first token is
one prefill. Chunk lengths are dynamic arguments: changing them never recompiles.

Streamers are ended on every exit path: `end()` when generation finishes (or stops early),
`fail(error)` (or `end()` for streamers without it) when it raises, so a consumer waiting on
an iterator streamer never hangs.

Example (illustration; `jaxgen.generate` runs the driver when a streamer is given):
    >>> out = jaxgen.generate(params, state, cfg, streamer=TextStreamer(tokenizer))  # doctest: +SKIP
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
from jaxgen.cache.layer_forms import holds_layer_tuples
from jaxgen.config.fields import check_int
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.output import GenerateOutput
from jaxgen.core.state import DecodeState
from jaxgen.drivers.host_arguments import as_streamers
from jaxgen.runtime import compiled

DEFAULT_CHUNK = 8


@dataclasses.dataclass
class ChunkTimings:
    """Host-side log of one chunked run (seconds)."""

    first_token_s: float = 0.0  # from the call to the first token being on the host
    total_s: float = 0.0
    chunks: int = 0
    steps: int = 0
    chunk_s: list = dataclasses.field(default_factory=list)  # wall time of each decode chunk
    host_s: float = 0.0  # host work between compiled calls (jaxgen.drivers.uad: tokenizers)


def end_streamers(streamer, error: BaseException | None = None) -> None:
    """Ends every streamer in `streamer` (one, a list, or None): `end()`, or `fail(error)`
    where the streamer has it and generation raised.

    Every streamer is ended even if one of them raises. After a generation error a
    streamer's own error is dropped (the generation error is the one the caller sees);
    after a success the first streamer error is raised once all are ended.
    """
    if streamer is None:
        return
    first = None
    for each in streamer if isinstance(streamer, (list, tuple)) else [streamer]:
        try:
            fail = getattr(each, "fail", None)
            if error is not None and callable(fail):
                fail(error)
            elif callable(getattr(each, "end", None)):
                each.end()
        except Exception as streamer_error:
            first = first or streamer_error
    if first is not None and error is None:
        raise first


class Emitter:
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

    def cancelled(self) -> bool:
        return any(getattr(s, "cancelled", False) for s in self.streamers or ())


def finish_run(loop, state: DecodeState, extra, deadline, timings: ChunkTimings,
               start_time: float, step: int):
    """The end of a host-driven run: rows still live past `deadline` stop with MAX_TIME, the
    timings get their totals, and the loop builds its output."""
    if deadline is not None and time.perf_counter() > deadline:
        state = stop_all(state, stopping.MAX_TIME)
    timings.total_s = time.perf_counter() - start_time
    timings.steps = step
    return loop.output(state, extra)


def stop_all(state: DecodeState, reason: int) -> DecodeState:
    """Marks every live row done with `reason` (host-side, between chunks)."""
    reason_now = jnp.where(state.done, state.stop_reason, reason).astype(jnp.int32)  # [B]
    return state.replace(done=jnp.ones_like(state.done), stop_reason=reason_now)


def run_chunked(loop, params, state: DecodeState, cfg: GenerationConfig, inputs=None, *,
                streamer=None, chunk_size: int = DEFAULT_CHUNK, max_time: float | None = None,
                stop_event: threading.Event | None = None,
                prepare_chunk: Callable[[DecodeState, int, int], DecodeState] | None = None,
                timings: ChunkTimings | None = None, layout: str = "auto") -> GenerateOutput:
    """Decodes `state` to completion in chunks of `loop` steps. Consumes `state`.

    loop: a chunkable loop (`start` / `advance` / `output`, e.g. jaxgen.loops.decode.DecodeLoop);
    cfg must be canonical and without max_time (pass it here). streamer: None, a streamer
    (batch 1) or one per row. prepare_chunk(state, step, n): optional host hook run before
    each chunk of n steps (e.g. growing the cache). layout: the programs' layout
    (jaxgen.runtime.backend.LAYOUTS). Every streamer is ended on every path.
    """
    try:
        out = _drive(loop, params, state, cfg, inputs, streamer=streamer,
                     chunk_size=chunk_size, max_time=max_time, stop_event=stop_event,
                     prepare_chunk=prepare_chunk, timings=timings, layout=layout)
    except BaseException as error:
        end_streamers(streamer, error)
        raise
    end_streamers(streamer)
    return out


def _drive(loop, params, state, cfg, inputs, *, streamer, chunk_size, max_time, stop_event,
           prepare_chunk, timings, layout) -> GenerateOutput:
    check_int("chunk_size", chunk_size, low=1)
    start_time = time.perf_counter()
    deadline = None if max_time is None else start_time + float(max_time)
    timings = timings if timings is not None else ChunkTimings()
    emitter = Emitter(as_streamers(streamer, state.batch), state)
    total_steps = state.buffer_len - state.prompt_bucket
    if prepare_chunk is not None:
        state = prepare_chunk(state, 0, 1)
    # held one buffer per layer between the chunks' programs (a host hook may reshape the
    # cache, so not then): no split and stack copies of the whole cache a chunk
    apart = (prepare_chunk is None and getattr(loop, "takes_layer_tuples", False)
             and not holds_layer_tuples(state.cache)
             and compiled.runs_layers_apart(params, state, loop, cfg, layout))
    if apart:
        state = state.replace(cache=_layers_apart(state.cache))
    state, extra = compiled.start(params, state, cfg, inputs, loop=loop, layout=layout)
    emitter.emit(state)
    timings.first_token_s = time.perf_counter() - start_time
    step, step_time = 1, None
    while step < total_steps:
        if np.asarray(jax.device_get(state.done)).all():
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
        state, extra = compiled.advance(params, state, extra, jnp.int32(step),
                                        jnp.int32(step + chunk), cfg, inputs, loop=loop,
                                        layout=layout)
        state.length.block_until_ready()
        timings.chunk_s.append(time.perf_counter() - began)
        measured = timings.chunk_s[-1] / chunk
        step_time = measured if step_time is None else 0.5 * (step_time + measured)
        step += chunk
        timings.chunks += 1
        emitter.emit(state)
    if apart:
        state = state.replace(cache=compiled.cache_stacked(state.cache))
    return finish_run(loop, state, extra, deadline, timings, start_time, step)


def _layers_apart(cache):
    """The cache one buffer per layer; the stacked buffers are freed (the driver consumes its
    state, as the programs' donation would)."""
    apart = jax.block_until_ready(compiled.cache_apart(cache))
    for name in (field.name for field in dataclasses.fields(cache)):
        before, after = getattr(cache, name), getattr(apart, name)
        if isinstance(after, tuple) and isinstance(before, jax.Array):
            before.delete()  # [L, ...], copied into after
    return apart


__all__: Sequence[str] = ("run_chunked", "as_streamers", "end_streamers", "ChunkTimings",
                          "Emitter", "stop_all", "DEFAULT_CHUNK")
