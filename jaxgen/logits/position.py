"""Processors that depend on the row's position, plus the value clean-ups.

Positions are per row (rows are ragged): `ctx.length[b]` is the number of real tokens of row
b, i.e. what `input_ids.shape[-1]` is for Hugging Face running that row alone, and
`ctx.prompt_len[b]` is HF's `input_ids_seq_length` for it. The row's `max_length` is
`prompt_len + max_new` (HF sets max_length = max_new_tokens + prompt length).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.zeros((1, 8), jnp.int32), length=jnp.array([3]),
    ...                        prompt_len=jnp.array([3]))
    >>> min_length_mask(jnp.zeros((1, 4)), ctx, (2,), min_new_tokens=1)
    Array([[  0.,   0., -inf,   0.]], dtype=float32)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.logits.warpers import per_row


def _column_mask(vocab: int, ids) -> jax.Array:
    """bool [V]: True at the given ids (static ints, or a program config's dynamic EOS table,
    jaxgen.config.program.EosTable); ids >= vocab are ignored."""
    table = getattr(ids, "ids", None)
    if table is not None:  # dynamic ids int32 [E]
        return jnp.zeros((vocab,), bool).at[table].set(True, mode="drop")  # [V]
    mask = np.zeros((vocab,), bool)
    ids = [i for i in ids if 0 <= i < vocab]
    mask[ids] = True
    return jnp.asarray(mask)


def min_length_mask(scores: jax.Array, ctx, eos_ids, *, min_length=None,
                    min_new_tokens=None) -> jax.Array:
    """HF MinLengthLogitsProcessor + MinNewTokensLengthLogitsProcessor: EOS gets -inf while
    length < min_length or (length - prompt_len) < min_new_tokens."""
    batch, vocab = scores.shape
    short = jnp.zeros((batch, 1), bool)
    if min_length is not None:
        short |= ctx.length[:, None] < per_row(min_length, batch, jnp.int32)
    if min_new_tokens is not None:
        short |= (ctx.length - ctx.prompt_len)[:, None] < per_row(min_new_tokens, batch, jnp.int32)
    return jnp.where(short & _column_mask(vocab, eos_ids)[None, :], -jnp.inf, scores)  # [B, V]


def _force(scores: jax.Array, rows: jax.Array, ids) -> jax.Array:
    """Rows where `rows` [B, 1] holds: every score -inf except `ids`, which get 0."""
    forced = jnp.where(_column_mask(scores.shape[1], ids)[None, :], 0.0, -jnp.inf)  # [1, V]
    return jnp.where(rows, forced, scores)  # [B, V]


def forced_bos(scores: jax.Array, ctx, bos_id: int) -> jax.Array:
    """HF ForcedBOSTokenLogitsProcessor: when the row holds exactly one token, force BOS."""
    return _force(scores, (ctx.length == 1)[:, None], (bos_id,))


def row_max_length(ctx) -> jax.Array:
    """int32 [B]: HF's max_length for the row (prompt + budget; the buffer if unknown)."""
    if ctx.max_new is None:
        return jnp.full_like(ctx.length, ctx.tokens.shape[1])
    return jnp.minimum(ctx.prompt_len + ctx.max_new, ctx.tokens.shape[1])


def forced_eos(scores: jax.Array, ctx, eos_ids) -> jax.Array:
    """HF ForcedEOSTokenLogitsProcessor: the row's last allowed token must be EOS."""
    return _force(scores, (ctx.length == row_max_length(ctx) - 1)[:, None], eos_ids)


def remove_invalid_values(scores: jax.Array) -> jax.Array:
    """HF InfNanRemoveLogitsProcessor: nan -> 0, +-inf -> the largest finite float32."""
    big = jnp.finfo(scores.dtype).max
    out = jnp.where(jnp.isnan(scores), 0.0, scores)
    out = jnp.where(scores == jnp.inf, big, out)
    return jnp.where(scores == -jnp.inf, -big, out)  # [B, V]


def exponential_decay_length_penalty(scores: jax.Array, ctx, start: int, factor: float,
                                     eos_ids) -> jax.Array:
    """HF ExponentialDecayLengthPenalty: after `start` new tokens, EOS scores grow by
    |s| * (factor ** (length - prompt_len - start) - 1)."""
    vocab = scores.shape[1]
    steps = ctx.length - (ctx.prompt_len + int(start))  # [B]
    growth = jnp.power(jnp.float32(factor), steps.astype(jnp.float32)) - 1.0  # [B]
    penalty = jnp.abs(scores) * growth[:, None]  # [B, V]
    penalty = jnp.where(jnp.isfinite(scores), penalty, 0.0)
    apply = (steps > 0)[:, None] & _column_mask(vocab, eos_ids)[None, :]  # [B, V]
    return scores + jnp.where(apply, penalty, 0.0)  # [B, V]


def suppress_tokens(scores: jax.Array, ids) -> jax.Array:
    """HF SuppressTokensLogitsProcessor: the ids always get -inf."""
    return jnp.where(_column_mask(scores.shape[1], ids)[None, :], -jnp.inf, scores)


def begin_index(ctx, forced_bos_token_id) -> jax.Array:
    """int32 [B]: HF's begin index for one row: the prompt length, +1 when a 1-token prompt
    is followed by a forced BOS."""
    if forced_bos_token_id is None:
        return ctx.prompt_len
    return ctx.prompt_len + (ctx.prompt_len <= 1).astype(ctx.prompt_len.dtype)


def begin_suppress_tokens(scores: jax.Array, ctx, ids, forced_bos_token_id=None) -> jax.Array:
    """HF SuppressTokensAtBeginLogitsProcessor: the ids get -inf at the first generated slot."""
    at_begin = (ctx.length == begin_index(ctx, forced_bos_token_id))[:, None]  # [B, 1]
    return jnp.where(at_begin & _column_mask(scores.shape[1], ids)[None, :], -jnp.inf, scores)


def renormalize(scores: jax.Array) -> jax.Array:
    """HF LogitNormalization: log-softmax."""
    return jax.nn.log_softmax(scores, axis=-1)
