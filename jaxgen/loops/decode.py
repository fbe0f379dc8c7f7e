"""The greedy / multinomial-sampling loop: prefill, then `lax.while_loop` one token a step.

Body = one-token forward -> processors -> choose -> write if live -> stop flags, built from
the shared step pieces (jaxgen.core.step). Everything here is traced inside one `jax.jit`;
nothing runs in Python per step.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> state = jaxgen.init_state(model, [[1, 2, 3]], cfg)
    >>> final, record = DecodeLoop().run_loop(params, state, cfg)
    >>> int(final.length[0]), record.token_logprobs.shape   # slots: the bucket of 3 new tokens
    (6, (1, 64))
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.automaton import constrain, step_carry
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.core.output import GenerateOutput, StepRecord
from jaxgen.core.state import DecodeState
from jaxgen.core.step import (
    choose,
    forward_last,
    mark_done,
    prefill,
    state_context,
    stop_flags,
    write_if_live,
)
from jaxgen.logits.sampling import token_logprobs


def choose_and_write(cfg: GenerationConfig, state: DecodeState, raw_logits: jax.Array,
                     record: StepRecord, step, ext: Extensions = NO_EXTENSIONS,
                     guided: jax.Array | None = None) -> tuple[DecodeState, StepRecord]:
    """Processes logits [B, V], picks a token per live row, writes it and updates stops.
    A constraint (state.constraint) masks the logits first and moves along the token.
    guided: classifier-free guidance's scores [B, V] (jaxgen.loops.guidance): the chain starts
    from them instead of raw_logits (HF runs the guidance processor first)."""
    start = raw_logits if guided is None else guided  # [B, V]
    allowed = constrain(state.constraint, start, cfg.eos_ids)  # [B, V]
    scores, chosen = choose(cfg, allowed, state_context(state), state.key, ext)  # [B, V], [B]
    live = ~state.done  # [B]
    chosen = jnp.where(live, chosen, state.pad)  # [B]
    tokens = write_if_live(state.tokens, state.length, chosen, live)  # [B, T]
    length = state.length + live.astype(jnp.int32)  # [B]
    flags = stop_flags(cfg, tokens=tokens, new_length=length, token=chosen,
                       prompt_len=state.prompt_len, max_new=state.max_new,
                       buffer_len=state.buffer_len, stop_tables=state.stop_tables, ext=ext,
                       scores=scores, raw_logits=raw_logits)
    done, reason = mark_done(state.done, state.stop_reason, flags, live)
    record = record.write(step, token_logprobs(scores, chosen), scores, raw_logits)
    return state.replace(tokens=tokens, length=length, done=done, stop_reason=reason,
                         constraint=step_carry(state.constraint, chosen, live)), record


def prefill_with_record(params, state: DecodeState, cfg: GenerationConfig,
                        with_hidden: bool = False, all_hidden: bool = False):
    """Empty step records for `state` and its prefill: (state, record, logits [B, V][, hidden]).
    With cfg.prompt_logprobs the prefill also scores every prompt token (record.prompt_logprobs
    [B, P]); every loop that fills a StepRecord starts here."""
    record = StepRecord.for_state(state, cfg)
    wanted = bool(cfg.prompt_logprobs)
    state, logits, *rest = prefill(params, state, cfg.prefill_chunk_size, with_hidden,
                                   all_hidden, prompt_logprobs=wanted)
    if wanted:
        record = dataclasses.replace(record, prompt_logprobs=rest.pop())  # [B, P]
    return (state, record, logits, *rest)


def decode_start(params, state: DecodeState, cfg: GenerationConfig,
                 ext: Extensions = NO_EXTENSIONS) -> tuple[DecodeState, StepRecord]:
    """Empty step records, the prefill and the first new token (step 0) of every row.

    The plain loop and its chunked form start here; the assisted loop runs the same
    prefill and `choose_and_write` (also asking for the prompt's hidden state), and beam
    search the same prefill before it expands the rows to beams.
    """
    state, record, logits = prefill_with_record(params, state, cfg)
    return choose_and_write(cfg, state, logits, record, 0, ext)


def decode_step(params, cfg: GenerationConfig, ext: Extensions = NO_EXTENSIONS):
    """The loop body: (step, state, record) -> (step + 1, state, record), one token a row."""
    def body(carry):
        step, st, rec = carry
        logits, cache = forward_last(st.model, params, st.tokens, st.length, st.cache)
        st, rec = choose_and_write(cfg, st.replace(cache=cache), logits, rec, step, ext)
        return step + 1, st, rec
    return body


def decode_steps(params, state: DecodeState, cfg: GenerationConfig, record: StepRecord, start,
                 stop, ext: Extensions = NO_EXTENSIONS):
    """Runs `decode_step` for steps start..stop-1 (fewer once every row is done).

    Returns (next step, state, record).
    """
    def cond(carry):
        step, st, _ = carry
        return (step < stop) & ~jnp.all(st.done)

    return jax.lax.while_loop(cond, decode_step(params, cfg, ext),
                              (jnp.asarray(start, jnp.int32), state, record))


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Greedy / sampling as a loop the plan can run in one call or in chunks (static).

    start(params, state, cfg, inputs)                 -> (state, record)   prefill + step 0
    advance(params, state, record, begin, end, cfg, inputs) -> (state, record) steps begin..end-1
    output(state, record)                             -> GenerateOutput
    """

    ext: Extensions = NO_EXTENSIONS
    chunkable = True
    takes_layer_tuples = True  # runs a cache held as per-layer buffers (cache.layer_forms)

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """Rows each decode forward runs (a backend lays weights out for it)."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        return decode_start(params, state, cfg, self.ext)

    def advance(self, params, state: DecodeState, record: StepRecord, begin, end,
                cfg: GenerationConfig, inputs=None):
        _, state, record = decode_steps(params, state, cfg, record, begin, end, self.ext)
        return state, record

    def run_loop(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        """Prefill + every step until each row is done: (final state, records)."""
        state, record = self.start(params, state, cfg, inputs)
        return self.advance(params, state, record, 1, state.buffer_len - state.prompt_bucket,
                            cfg, inputs)

    def output(self, state: DecodeState, record: StepRecord) -> GenerateOutput:
        return GenerateOutput.from_state(state, record)

    def run(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        return self.output(*self.run_loop(params, state, cfg, inputs))
