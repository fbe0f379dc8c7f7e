"""The step pieces every loop shares: prefill, the one-token forward, the processor
context, write-if-live, per-row choice and the stop flags.

The plain loop (`jaxgen.loops.decode`), beam search (`jaxgen.loops.beam`) and the assisted loop
(`jaxgen.speculative`) are built from these, so a rule (what a processor sees, which stop
wins, when a row counts as full) is written once.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.config.generation import GenerationConfig
    >>> tokens = jnp.array([[5, 6, 0, 0]]); length = jnp.array([2])
    >>> write_if_live(tokens, length, jnp.array([9]), jnp.array([True])).tolist()
    [[5, 6, 9, 0]]
    >>> flags = stop_flags(GenerationConfig(eos_token_id=9), tokens=jnp.array([[5, 6, 9, 0]]),
    ...                    new_length=jnp.array([3]), token=jnp.array([9]),
    ...                    prompt_len=jnp.array([2]), max_new=jnp.array([4]), buffer_len=4)
    >>> reason_of(flags).tolist()        # 1 = EOS (jaxgen.stopping)
    [1]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.logits.chain import ProcessorContext, process_logits
from jaxgen.logits.sampling import select_tokens
from jaxgen.stopping.strings import stop_string_hit


# ------------------------------------------------------------------------- context
def processor_context(tokens: jax.Array, length: jax.Array, prompt_len: jax.Array,
                      max_new: jax.Array | None) -> ProcessorContext:
    """What a processor or a stopping criterion sees: tokens [N, T], length / prompt_len /
    max_new int32 [N] (N = rows, beams or candidates)."""
    return ProcessorContext(tokens=tokens, length=length.astype(jnp.int32),
                            prompt_len=prompt_len, max_new=max_new)


def state_context(state, tokens: jax.Array | None = None,
                  length: jax.Array | None = None) -> ProcessorContext:
    """The context of a DecodeState's rows, optionally over another token buffer / length."""
    return processor_context(state.tokens if tokens is None else tokens,
                             state.length if length is None else length,
                             state.prompt_len, state.max_new)


# ------------------------------------------------------------------------- forwards
def prefill_tokens(model, params, tokens: jax.Array, prompt_len: jax.Array, cache,
                   chunk: int | None = None, with_hidden: bool = False,
                   all_hidden: bool = False, prompt_logprobs: bool = False, start=None):
    """Runs a right-padded prompt block tokens [B, P] through `model`; returns (cache with
    length = prompt_len, logits [B, V] of each row's last prompt token), plus that token's
    hidden state [B, D] when `with_hidden` (every position's, [B, P, D], with `all_hidden`),
    plus, last, with `prompt_logprobs`, float32 [B, P]: log_softmax(logits at p - 1) at
    tokens[:, p] (0 at p = 0 and past prompt_len; each chunk's [B, c, V] logits are reduced
    to [B, c] before the next chunk runs).

    chunk: `prefill_chunk_size`: the block runs in pieces of `chunk` positions (bounded
    activation memory for long prompts; a `lax.fori_loop` over the equal pieces, so the
    program does not grow with the prompt), with the same result.
    start: None, or int32 [B]: the block's first position per row (a continued state: the
    cache already holds positions < start; the block is positions start .. start + P - 1).
    """
    batch, bucket = tokens.shape
    offset = 0 if start is None else start[:, None]  # [B, 1] the block's first position
    last = (prompt_len - 1)[:, None] - offset  # [B, 1] index of the last prompt token
    chunk = bucket if chunk is None else min(int(chunk), bucket)

    def piece(begin, size, cache, logits, hidden, lp_sink=None):
        """Positions begin .. begin+size-1 (begin may be traced, size is static)."""
        block = jax.lax.dynamic_slice_in_dim(tokens, begin, size, axis=1)  # [B, c]
        positions = begin + offset + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32),
                                                      (batch, size))  # [B, c]
        index = jnp.clip(last - begin, 0, size - 1)  # [B, 1]
        if prompt_logprobs:  # every position's logits: [B, c, V] for this chunk only
            out = model(params, block, positions, cache)
            every = out.logits.astype(jnp.float32)  # [B, c, V]
            lp_sink = _next_token_logprobs(every, padded, begin, size, lp_sink)  # [B, P+1]
            picked = jnp.take_along_axis(every, index[:, :, None], axis=1)[:, 0]  # [B, V]
        else:
            out = model(params, block, positions, cache, logits_index=index)
            picked = out.logits[:, 0].astype(jnp.float32)  # [B, V]
        here = (last >= begin) & (last < begin + size)  # [B, 1]
        logits = jnp.where(here, picked, logits)  # [B, V]
        if with_hidden and all_hidden:
            hidden = jax.lax.dynamic_update_slice_in_dim(
                hidden, out.hidden.astype(hidden.dtype), begin, axis=1)  # [B, P, D]
        elif with_hidden:
            h = jnp.take_along_axis(out.hidden, index[:, :, None], axis=1)[:, 0]  # [B, D]
            hidden = jnp.where(here, h.astype(hidden.dtype), hidden)
        return out.cache, logits, hidden, lp_sink

    vocab = model.vocab_size
    logits = jnp.zeros((batch, vocab), jnp.float32)  # [B, V]
    hidden = None
    if with_hidden:
        shape = jax.eval_shape(lambda: model(params, tokens[:, :1], jnp.zeros((batch, 1),
                                             jnp.int32), cache).hidden)
        width = (bucket,) if all_hidden else ()
        hidden = jnp.zeros((batch, *width, shape.shape[-1]), shape.dtype)  # [B, (P,) D]
    lp_sink = padded = None
    if prompt_logprobs:
        padded = jnp.pad(tokens, ((0, 0), (0, 1)))  # [B, P+1] the next token of every position
        lp_sink = jnp.zeros((batch, bucket + 1), jnp.float32)  # [B, P+1] entry p+1: position p's
    carry = (cache, logits, hidden, lp_sink)
    full = bucket // chunk  # equal pieces; the remainder runs once after them
    if full == 1:
        carry = piece(0, chunk, *carry)
    elif full > 1:
        def body(i, carry):
            return piece(i * chunk, chunk, *carry)
        carry = jax.lax.fori_loop(0, full, body, carry)
    if bucket % chunk:
        carry = piece(full * chunk, bucket % chunk, *carry)
    cache, logits, hidden, lp_sink = carry
    cache = cache.with_length(prompt_len)
    result = (cache, logits, hidden) if with_hidden else (cache, logits)
    if prompt_logprobs:
        valid = jnp.arange(bucket)[None, :] < prompt_len[:, None] - offset  # [B, P]
        result += (jnp.where(valid, lp_sink[:, :bucket], 0.0),)  # [B, P]
    return result


def _next_token_logprobs(logits: jax.Array, padded: jax.Array, begin, size: int,
                         sink: jax.Array) -> jax.Array:
    """sink [B, P+1] with entries begin+1 .. begin+size set to log_softmax(logits [B, c, V])
    at the prompt's next tokens padded[:, begin+1 ..] (padded: the prompt [B, P] + 1 column)."""
    following = jax.lax.dynamic_slice_in_dim(padded, begin + 1, size, axis=1)  # [B, c]
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, c, V]
    chosen = jnp.take_along_axis(logprobs, following[:, :, None], axis=-1)[:, :, 0]  # [B, c]
    return jax.lax.dynamic_update_slice_in_dim(sink, chosen, begin + 1, axis=1)  # [B, P+1]


def prefill(params, state, chunk: int | None = None, with_hidden: bool = False,
            all_hidden: bool = False, prompt_logprobs: bool = False):
    """The state's prompt bucket through its model: (state with the cache filled, logits
    [B, V] of each row's last prompt token[, its hidden state [B, D] when with_hidden, every
    prompt position's [B, P, D] with all_hidden too][, the prompt tokens' log-probs [B, P]
    with prompt_logprobs, last])."""
    if state.cached is None:
        prompt = state.tokens[:, :state.prompt_bucket]  # [B, P]
    else:  # a continued state: only the tokens after each row's cached ones
        prompt = continued_block(state, prompt_logprobs)  # [B, W]
    cache, *rest = prefill_tokens(state.model, params, prompt, state.prompt_len, state.cache,
                                  chunk, with_hidden, all_hidden, prompt_logprobs, state.cached)
    return (state.replace(cache=cache), *rest)


def continued_block(state, prompt_logprobs: bool = False) -> jax.Array:
    """A continued state's prefill block int32 [B, W] (W = state.prefill_width): each row's
    tokens at positions cached .. cached + W - 1, the pad id past its prompt
    (jaxgen.core.cached_prefix)."""
    if prompt_logprobs:
        raise ValueError("prompt log-probs need the whole prompt's logits, but a continued "
                         "state (init_state(prefix=...), jaxgen.continue_state) prefills only "
                         "the tokens after its cached ones")
    index = state.cached[:, None] + jnp.arange(state.prefill_width, dtype=jnp.int32)  # [B, W]
    block = jnp.take_along_axis(state.tokens, jnp.minimum(index, state.buffer_len - 1),
                                axis=1)  # [B, W]
    return jnp.where(index < state.prompt_len[:, None], block, state.pad)  # [B, W]


def forward_last(model, params, tokens: jax.Array, length: jax.Array, cache):
    """The one-token forward: feeds each row's last token tokens[b, length[b] - 1] at its
    position. tokens [N, T]; length int32 [N]. Returns (logits [N, V] float32, cache with
    length = `length`)."""
    position = jnp.maximum(length - 1, 0)  # [N]
    last = jnp.take_along_axis(tokens, position[:, None], axis=1)  # [N, 1]
    out = model(params, last, position[:, None], cache)
    return out.logits[:, -1].astype(jnp.float32), out.cache.with_length(length)


# ------------------------------------------------------------------------- choose, write
def choose(cfg: GenerationConfig, raw_logits: jax.Array, ctx: ProcessorContext, keys,
           ext: Extensions = NO_EXTENSIONS) -> tuple[jax.Array, jax.Array]:
    """Processed scores [N, V] and the chosen token per row [N] (argmax, or a draw with the
    row's key folded with the position being written, ctx.length)."""
    scores = process_logits(cfg, raw_logits, ctx, extra=ext.logits_processor)  # [N, V]
    return scores, select_tokens(scores, keys, ctx.length, do_sample=cfg.do_sample)


def write_if_live(tokens: jax.Array, index: jax.Array, values: jax.Array,
                  live: jax.Array) -> jax.Array:
    """tokens [N, T] with values[n] written at index[n] for live rows only (others and
    indices past T untouched)."""
    width = tokens.shape[1]
    rows = jnp.arange(tokens.shape[0])
    return tokens.at[rows, jnp.where(live, index, width)].set(values, mode="drop")  # [N, T]


def invalid_logits(raw_logits: jax.Array) -> jax.Array:
    """bool [...]: raw logits [..., V] hold a NaN or +inf, or are all -inf (the model's output
    is garbage for that row: every choice from it would be arbitrary)."""
    bad = jnp.any(jnp.isnan(raw_logits) | (raw_logits == jnp.inf), axis=-1)
    return bad | jnp.all(raw_logits == -jnp.inf, axis=-1)


# ------------------------------------------------------------------------- stops
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopFlags:
    """Which stop conditions fire, per row (bool arrays of one shape; None = not checked)."""

    eos: jax.Array
    full: jax.Array
    string: jax.Array | None = None
    custom: jax.Array | None = None
    invalid: jax.Array | None = None

    def any(self) -> jax.Array:
        hit = self.eos | self.full
        for flag in (self.string, self.custom, self.invalid):
            if flag is not None:
                hit = hit | flag
        return hit

    def map(self, fn) -> "StopFlags":
        """The same flags with `fn` applied to each checked array."""
        return jax.tree_util.tree_map(fn, self)


def stop_flags(cfg: GenerationConfig, *, tokens: jax.Array, new_length: jax.Array,
               token: jax.Array, prompt_len: jax.Array, max_new: jax.Array, buffer_len: int,
               stop_tables=None, ext: Extensions = NO_EXTENSIONS, scores=None,
               raw_logits=None) -> StopFlags:
    """Every stop condition after a token was written: EOS, budget, stop strings, user
    criteria and invalid logits. tokens [N, T] include the token; new_length, token,
    prompt_len, max_new [N]; scores [N, V] the processed scores it came from (for user
    criteria); raw_logits [N, V] (for the invalid-logits check, skipped when the config asks
    for `remove_invalid_values`: HF then cleans the scores and generation goes on)."""
    flags = StopFlags(
        eos=stopping.hit_eos(token, cfg.eos_ids),
        full=stopping.out_of_budget(new_length, prompt_len, max_new, buffer_len))
    if stop_tables is not None:
        flags = dataclasses.replace(flags, string=stop_string_hit(stop_tables, tokens,
                                                                  new_length))
    if ext.stopping_criteria:
        ctx = processor_context(tokens, new_length, prompt_len, max_new)
        flags = dataclasses.replace(flags, custom=stopping.custom_stop(ext.stopping_criteria,
                                                                       ctx, scores))
    if raw_logits is not None and not cfg.remove_invalid_values:
        flags = dataclasses.replace(flags, invalid=invalid_logits(raw_logits))
    return flags


def reason_of(flags: StopFlags) -> jax.Array:
    """int32 stop reason per row; priority INVALID_LOGITS, EOS, STOP_STRING, CUSTOM,
    MAX_LENGTH (NOT_STOPPED when none fires)."""
    reason = jnp.where(flags.full, stopping.MAX_LENGTH, stopping.NOT_STOPPED)
    if flags.custom is not None:
        reason = jnp.where(flags.custom, stopping.CUSTOM, reason)
    if flags.string is not None:
        reason = jnp.where(flags.string, stopping.STOP_STRING, reason)
    reason = jnp.where(flags.eos, stopping.EOS, reason)
    if flags.invalid is not None:
        reason = jnp.where(flags.invalid, stopping.INVALID_LOGITS, reason)
    return reason.astype(jnp.int32)


def mark_done(done: jax.Array, reason: jax.Array, flags: StopFlags,
              live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows that are live and hit a stop become done with the first reason; rows already done
    keep theirs. done, reason, live [B]; flags of shape [B]."""
    hit = flags.any() & live  # [B]
    return done | hit, jnp.where(hit, reason_of(flags), reason).astype(jnp.int32)
