"""The UAD host driver: tokenizer work between compiled rounds (the chunked driver's pattern).

Universal assisted decoding needs text between the draft and the verify: the assistant's
drafts are re-encoded with the target's tokenizer and aligned (jaxgen.speculative.uad.align), which no
compiled program can do. This driver runs the speculative loop's `start` (prefill, first
token) once, then per round

    host     every live row's assistant input (its own alignment state; the conversions of
             all rows go through the tokenizers' batch calls), the assistant cache's keep point
    draft    the assistant feeds its new ids and drafts            (UadPhase "draft", compiled)
    host     greedy: the drafts' text re-encoded and aligned -> target drafts per row
    verify   one speculative round on those drafts                 (UadPhase "verify")

and for sampling across vocabularies, where each assistant draft maps to one target token on
the device, one call per round (UadPhase "round": draft, map, verify). Every row keeps its
own state and advances by its own accepted count each round; no row waits for another more
than one round. The programs are compiled once per target prompt bucket (the assistant's
prefill is BUFFER_RATIO x that bucket wide; longer assistant prompts are fed on by the draft
phase); round arrays have static shapes. Streamers, max_time and stop_event work as in the
chunked driver, between rounds.

A row whose assistant ids would overflow the assistant's buffer (BUFFER_RATIO x the
target's) stops drafting and continues with one target token per round (same output).

Example (illustration; `jaxgen.generate` runs the driver for an assistant with another
tokenizer):
    >>> jaxgen.generate_ids(model, params, prompts, assistant_model=(draft, draft_params),
    ...                     tokenizer=tok, assistant_tokenizer=draft_tok)  # doctest: +SKIP
"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import stopping
from jaxgen.core.output import GenerateOutput
from jaxgen.core.state import DecodeState
from jaxgen.drivers.chunked import (
    ChunkTimings,
    Emitter,
    as_streamers,
    end_streamers,
    finish_run,
    stop_all,
)
from jaxgen.runtime import compiled
from jaxgen.speculative.uad.align import GreedyRow, SampleRow, common_prefix
from jaxgen.speculative.uad.bridge import TokenBridge
from jaxgen.speculative.uad.drafter import HostRound, UadInputs, UadPhase


class UadRows:
    """Every row's host state: alignment (GreedyRow / SampleRow), what the assistant cache
    holds, and whether the row still drafts."""

    def __init__(self, drafter, bridge: TokenBridge, cfg, batch: int, capacity: int):
        self.drafter, self.bridge, self.batch, self.capacity = drafter, bridge, batch, capacity
        self.target_lookbehind = int(cfg.target_lookbehind)
        self.assistant_lookbehind = int(cfg.assistant_lookbehind)
        kind = SampleRow if drafter.sample else GreedyRow
        self.rows = [kind() for _ in range(batch)]
        self.cached: list[list[int]] = [[] for _ in range(batch)]  # valid assistant cache
        self.drafting = np.ones((batch,), bool)  # False once a row's ids outgrow the buffer
        self.room = drafter.num_tokens + drafter.feed_width  # positions a round may write
        self.full: list = [None] * batch  # greedy: whether the last window was the full text
        self.keep = np.zeros((batch,), np.int32)  # the last round's keep points

    # ------------------------------------------------------------ assistant inputs
    def assistant_inputs(self, target: list[list[int]], active: np.ndarray) -> dict[int, list]:
        """Row -> assistant ids to draft from, for the active rows (batched conversions)."""
        rows = [b for b in range(self.batch) if active[b]]
        if self.drafter.sample:
            return self._sample_inputs(target, rows)
        windows = {}
        for b in rows:
            windows[b], self.full[b] = self.rows[b].target_window(target[b],
                                                                  self.target_lookbehind)
        converted = self.bridge.to_assistant([windows[b] for b in rows], True) if rows else []
        return {b: self.rows[b].assistant_input(target[b], ids, self.full[b])
                for b, ids in zip(rows, converted)}

    def _sample_inputs(self, target, rows) -> dict[int, list]:
        new, by_text = {}, []
        for b in rows:
            ids = self.rows[b].new_target(target[b])
            direct = (self.bridge.target_to_assistant.get(ids[0])
                      if self.rows[b].prev_assistant is not None else None)
            if direct is not None:
                new[b] = [direct]
            else:
                by_text.append(b)
        converted = self.bridge.to_assistant([self.rows[b].new_target(target[b])
                                              for b in by_text], False) if by_text else []
        new.update(zip(by_text, converted))
        return {b: self.rows[b].assistant_input(target[b], new[b]) for b in rows}

    # ------------------------------------------------------------ device arrays
    def host_round(self, inputs: dict[int, list], t_drafts=None, t_count=None) -> HostRound:
        """The round's HostRound (keep points from what each assistant cache holds)."""
        K = self.drafter.num_tokens
        ids = np.zeros((self.batch, self.capacity), np.int32)
        length = np.ones((self.batch,), np.int32)
        keep = np.zeros((self.batch,), np.int32)
        allow = np.zeros((self.batch,), bool)
        for b, row in inputs.items():
            if len(row) + self.room > self.capacity or not row:
                self.drafting[b] = False
                continue
            ids[b, :len(row)] = row
            length[b] = len(row)
            keep[b] = min(common_prefix(self.cached[b], row), len(row) - 1)
            allow[b] = True
        self.keep = keep
        return HostRound(ids=jnp.asarray(ids), length=jnp.asarray(length),
                         keep=jnp.asarray(keep), allow=jnp.asarray(allow),
                         t_drafts=jnp.asarray(np.zeros((self.batch, K), np.int32)
                                              if t_drafts is None else t_drafts),
                         t_count=jnp.asarray(np.zeros((self.batch,), np.int32)
                                             if t_count is None else t_count))

    def prefill_round(self, inputs: dict[int, list], width: int) -> HostRound:
        """The assistant prompts: each row's first input but its last id (which the draft
        phase feeds), cut at `width` (static: BUFFER_RATIO x the target's prompt bucket, so
        the prefill compiles once per target bucket; the draft phase feeds the rest)."""
        prompts = {b: row[:-1][:width] for b, row in inputs.items()
                   if row and len(row) + self.room <= self.capacity}
        ids = np.zeros((self.batch, self.capacity), np.int32)
        length = np.zeros((self.batch,), np.int32)
        for b, prompt in prompts.items():
            ids[b, :len(prompt)] = prompt
            length[b] = len(prompt)
            self.cached[b] = list(prompt)
        zeros = np.zeros((self.batch,), np.int32)
        return HostRound(ids=jnp.asarray(ids), length=jnp.asarray(length),
                         keep=jnp.asarray(zeros), allow=jnp.asarray(length > 0),
                         t_drafts=jnp.zeros((self.batch, self.drafter.num_tokens), jnp.int32),
                         t_count=jnp.asarray(zeros))

    # ------------------------------------------------------------ after the draft phase
    def record_drafts(self, inputs: dict[int, list], allowed: np.ndarray, drafts: np.ndarray,
                      k_row: np.ndarray, target: list[list[int]]):
        """Updates the cache contents and the rows; greedy: returns the target drafts
        (int32 [B, K], counts [B])."""
        K = self.drafter.num_tokens
        t_drafts = np.zeros((self.batch, K), np.int32)
        t_count = np.zeros((self.batch,), np.int32)
        greedy = []
        for b, row in inputs.items():
            k = int(k_row[b]) if allowed[b] else 0
            mine = drafts[b, :k].tolist()
            if k > 0:  # the phase fed row[keep:] and the drafts but the last
                self.cached[b] = row + mine[:k - 1]
            else:  # nothing fed: what the cache held up to keep is all that is valid
                self.cached[b] = self.cached[b][:int(self.keep[b])]
            if self.drafter.sample:
                self.rows[b].record(row, mine, len(target[b]))
            else:
                greedy.append((b, mine))
        if greedy:
            windows = [self.rows[b].assistant_window(mine, self.assistant_lookbehind)
                       for b, mine in greedy]
            converted = self.bridge.to_target_ids(windows, True)
            for (b, mine), ids in zip(greedy, converted):
                found = self.rows[b].target_drafts(target[b], mine, ids)
                found = found[:K] if mine else []
                t_drafts[b, :len(found)] = found
                t_count[b] = len(found)
        return t_drafts, t_count


def run_uad(loop, params, state: DecodeState, cfg, inputs, bridge: TokenBridge, *,
            streamer=None, max_time: float | None = None,
            stop_event: threading.Event | None = None,
            timings: ChunkTimings | None = None, layout: str = "auto") -> GenerateOutput:
    """Decodes `state` to completion with UAD (module docs). Consumes `state`.

    loop: a SpeculativeLoop over a UadDrafter; inputs: its AssistInputs (draft params =
    UadParams); cfg canonical, without max_time (pass it here). Every streamer is ended on
    every path."""
    try:
        out = _drive(loop, params, state, cfg, inputs, bridge, streamer=streamer,
                     max_time=max_time, stop_event=stop_event, timings=timings,
                     layout=layout)
    except BaseException as error:
        end_streamers(streamer, error)
        raise
    end_streamers(streamer)
    return out


def _rows_of(tokens: np.ndarray, length: np.ndarray) -> list[list[int]]:
    return [tokens[b, :length[b]].tolist() for b in range(tokens.shape[0])]


def _drive(loop, params, state, cfg, inputs, bridge, *, streamer, max_time, stop_event,
           timings, layout) -> GenerateOutput:
    start_time = time.perf_counter()
    deadline = None if max_time is None else start_time + float(max_time)
    timings = timings if timings is not None else ChunkTimings()
    emitter = Emitter(as_streamers(streamer, state.batch), state)
    drafter = loop.drafter
    state, extra = compiled.start(params, state, cfg, inputs, loop=loop, layout=layout)
    emitter.emit(state)
    timings.first_token_s = time.perf_counter() - start_time
    capacity = extra[0].draft_state.cache.max_len
    rows = UadRows(drafter, bridge, cfg, state.batch, capacity)
    phase = {name: UadPhase(drafter, loop.ext, name) for name in ("draft", "verify", "round")}
    round_inputs = lambda host: UadInputs(draft_params=inputs.draft_params,  # noqa: E731
                                          start_tokens=inputs.start_tokens, host=host)
    total_steps = state.buffer_len - state.prompt_bucket
    step, first = 1, True
    tokens, length, done = map(np.asarray, jax.device_get((state.tokens, state.length,
                                                           state.done)))
    while step < total_steps and not done.all():
        if emitter.cancelled() or (stop_event is not None and stop_event.is_set()):
            state = stop_all(state, stopping.CANCELLED)
            break
        if deadline is not None and time.perf_counter() >= deadline:
            state = stop_all(state, stopping.MAX_TIME)
            break
        round_began = began = time.perf_counter()
        target = _rows_of(tokens, length)
        assistant_in = rows.assistant_inputs(target, ~done & rows.drafting)
        if first:
            width = min(capacity, drafter.buffer_ratio * state.prompt_bucket)
            host = rows.prefill_round(assistant_in, width)
            timings.host_s += time.perf_counter() - began
            state, extra = compiled.advance(params, state, extra, jnp.int32(step),
                                            jnp.int32(step), cfg, round_inputs(host),
                                            loop=UadPhase(drafter, loop.ext, "prefill", width),
                                            layout=layout)
            began, first = time.perf_counter(), False
        host = rows.host_round(assistant_in)
        allowed = np.asarray(host.allow)
        timings.host_s += time.perf_counter() - began
        at = (jnp.int32(step), jnp.int32(step + 1))
        name = "round" if drafter.sample else "draft"
        state, extra = compiled.advance(params, state, extra, *at, cfg, round_inputs(host),
                                        loop=phase[name], layout=layout)
        drafts, k_row = map(np.asarray, jax.device_get((extra[0].draft_state.drafts,
                                                        extra[0].draft_state.k_row)))
        began = time.perf_counter()
        t_drafts, t_count = rows.record_drafts(assistant_in, allowed, drafts, k_row, target)
        if not drafter.sample:  # the target drafts the host found: one speculative round
            host = HostRound(ids=host.ids, length=host.length, keep=host.keep,
                             allow=host.allow, t_drafts=jnp.asarray(t_drafts),
                             t_count=jnp.asarray(t_count))
            timings.host_s += time.perf_counter() - began
            state, extra = compiled.advance(params, state, extra, *at, cfg, round_inputs(host),
                                            loop=phase["verify"], layout=layout)
            state.length.block_until_ready()
            began = time.perf_counter()
        tokens, length, done = map(np.asarray, jax.device_get((state.tokens, state.length,
                                                               state.done)))
        timings.host_s += time.perf_counter() - began
        timings.chunk_s.append(time.perf_counter() - round_began)
        timings.chunks += 1
        step += 1
        emitter.emit(state)
    return finish_run(loop, state, extra, deadline, timings, start_time, step)


__all__ = ["UadRows", "run_uad"]
