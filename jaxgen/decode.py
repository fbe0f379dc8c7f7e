"""The greedy / multinomial-sampling loop: prefill, then `lax.while_loop` one token a step.

Body = forward -> processors -> select -> write -> stop checks (DESIGN s.4). Everything
here is traced inside one `jax.jit`; nothing runs in Python per step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.config import GenerationConfig
from jaxgen.extensions import NO_EXTENSIONS, Extensions
from jaxgen.processors import ProcessorContext, process_logits
from jaxgen.sampling import select_tokens, token_logprobs
from jaxgen.state import DecodeState
from jaxgen.stopping_strings import stop_string_hit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Per-step outputs, indexed by step number i (the i-th new token of every row)."""

    token_logprobs: jax.Array  # float32 [B, N]
    scores: jax.Array | None  # float32 [B, N, V] processed scores (output_scores)
    logits: jax.Array | None  # float32 [B, N, V] raw logits (output_logits)

    @classmethod
    def empty(cls, batch: int, steps: int, vocab: int, cfg: GenerationConfig) -> "StepRecord":
        full = lambda on: jnp.zeros((batch, steps, vocab), jnp.float32) if on else None  # noqa: E731
        return cls(token_logprobs=jnp.zeros((batch, steps), jnp.float32),
                   scores=full(cfg.output_scores), logits=full(cfg.output_logits))

    def write(self, step, logprobs, scores, logits) -> "StepRecord":
        put = lambda buf, value: None if buf is None else buf.at[:, step].set(value)  # noqa: E731
        return StepRecord(token_logprobs=self.token_logprobs.at[:, step].set(logprobs),
                          scores=put(self.scores, scores), logits=put(self.logits, logits))


def prefill(params, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    """Runs the prompt bucket through the model; returns the state and the next logits [B, V]."""
    model = state.model
    bucket = state.prompt_bucket
    prompt = state.tokens[:, :bucket]  # [B, P]
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), prompt.shape)  # [B, P]
    last = (state.prompt_len - 1)[:, None]  # [B, 1]
    out = model(params, prompt, positions, state.cache, logits_index=last)
    cache = out.cache.with_length(state.prompt_len)
    return state.replace(cache=cache), out.logits[:, 0].astype(jnp.float32)  # [B, V]


def choose_and_write(cfg: GenerationConfig, state: DecodeState, raw_logits: jax.Array,
                     record: StepRecord, step, ext: Extensions = NO_EXTENSIONS
                     ) -> tuple[DecodeState, StepRecord]:
    """Processes logits [B, V], picks a token per live row, writes it and updates stops."""
    batch = state.batch
    ctx = ProcessorContext(tokens=state.tokens, length=state.length, prompt_len=state.prompt_len,
                           max_new=state.max_new)
    scores = process_logits(cfg, raw_logits, ctx, extra=ext.logits_processor)  # [B, V]
    chosen = select_tokens(scores, state.key, state.length, do_sample=cfg.do_sample)  # [B]
    live = ~state.done  # [B]
    chosen = jnp.where(live, chosen, state.pad_token_id)  # [B]
    rows = jnp.arange(batch)
    tokens = state.tokens.at[rows, state.length].set(
        jnp.where(live, chosen, state.tokens[rows, jnp.minimum(state.length, state.buffer_len - 1)]),
        mode="drop")  # [B, T]
    length = state.length + live.astype(jnp.int32)  # [B]
    newly_eos = live & stopping.hit_eos(chosen, cfg.eos_ids)  # [B]
    newly_full = live & stopping.out_of_budget(length, state.prompt_len, state.max_new,
                                               state.buffer_len)  # [B]
    newly_string = newly_custom = None
    if state.stop_tables is not None:
        newly_string = live & stop_string_hit(state.stop_tables, tokens, length)  # [B]
    if ext.stopping_criteria:
        after = ProcessorContext(tokens=tokens, length=length, prompt_len=state.prompt_len,
                                 max_new=state.max_new)
        newly_custom = live & stopping.custom_stop(ext.stopping_criteria, after, scores)  # [B]
    done, reason = stopping.update_stop(state.done, state.stop_reason, newly_eos, newly_full,
                                        newly_string, newly_custom)
    record = record.write(step, token_logprobs(scores, chosen), scores, raw_logits)
    return state.replace(tokens=tokens, length=length, done=done, stop_reason=reason), record


def decode_start(params, state: DecodeState, cfg: GenerationConfig,
                 ext: Extensions = NO_EXTENSIONS) -> tuple[DecodeState, StepRecord]:
    """Empty step records, the prefill and the first new token (step 0) of every row.

    Every loop starts here: this one, the chunked driver and the assisted loop.
    """
    steps = state.buffer_len - state.prompt_bucket
    record = StepRecord.empty(state.batch, max(steps, 1), state.model.vocab_size, cfg)
    state, logits = prefill(params, state)
    return choose_and_write(cfg, state, logits, record, 0, ext)


def decode_loop(params, state: DecodeState, cfg: GenerationConfig,
                ext: Extensions = NO_EXTENSIONS) -> tuple[DecodeState, StepRecord]:
    """Prefill + while_loop until every row is done. Returns the final state and records."""
    state, record = decode_start(params, state, cfg, ext)
    steps = state.buffer_len - state.prompt_bucket
    _, state, record = decode_steps(params, state, cfg, record, 1, steps, ext)
    return state, record


def decode_step(params, cfg: GenerationConfig, ext: Extensions = NO_EXTENSIONS):
    """The loop body: (step, state, record) -> (step + 1, state, record), one token a row."""
    def body(carry):
        step, st, rec = carry
        position = jnp.maximum(st.length - 1, 0)  # [B] the token not yet in the cache
        last = jnp.take_along_axis(st.tokens, position[:, None], axis=1)  # [B, 1]
        out = st.model(params, last, position[:, None], st.cache)
        st = st.replace(cache=out.cache.with_length(st.length))
        st, rec = choose_and_write(cfg, st, out.logits[:, 0].astype(jnp.float32), rec, step, ext)
        return step + 1, st, rec
    return body


def decode_steps(params, state: DecodeState, cfg: GenerationConfig, record: StepRecord, start,
                 stop, ext: Extensions = NO_EXTENSIONS):
    """Runs `decode_step` for steps start..stop-1 (fewer once every row is done).

    Returns (next step, state, record). Chunked drivers (jaxgen.growing, streaming) call this
    N steps per jit call; `decode_loop` calls it once for the whole budget.
    """
    def cond(carry):
        step, st, _ = carry
        return (step < stop) & ~jnp.all(st.done)

    return jax.lax.while_loop(cond, decode_step(params, cfg, ext),
                              (jnp.asarray(start, jnp.int32), state, record))
