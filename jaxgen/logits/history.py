"""Processors that read the token history: repetition / presence / frequency penalties,
no-repeat-ngram blocking, sequence bias and bad words.

Rows are ragged and right-padded: `tokens[b, j]` is real iff `j < length[b]`. Padding is
never counted. "Input" follows Hugging Face for one row alone: repetition penalty,
no-repeat-ngram, sequence bias and bad words read the whole prompt + generated sequence;
presence and frequency penalties (OpenAI / vLLM semantics) read the generated part only.

Example:
    >>> tokens = jnp.array([[3, 1, 3, 0]]); length = jnp.array([3])
    >>> token_counts(tokens, valid_positions(tokens, length), 4)
    Array([[0., 1., 0., 2.]], dtype=float32)
"""
from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.logits.warpers import per_row


def valid_positions(tokens: jax.Array, length: jax.Array, start: jax.Array | None = None
                    ) -> jax.Array:
    """bool [B, T]: index j holds a real token (start <= j < length)."""
    index = jnp.arange(tokens.shape[1])[None, :]  # [1, T]
    valid = index < length[:, None]  # [B, T]
    if start is not None:
        valid &= index >= start[:, None]
    return valid


def token_counts(tokens: jax.Array, valid: jax.Array, vocab: int) -> jax.Array:
    """float32 [B, V]: occurrences of each id among the valid positions.

    Ids >= vocab (an embedding larger than the head) fall into a spare column and are dropped.
    """
    batch = tokens.shape[0]
    ids = jnp.where(valid, jnp.minimum(tokens, vocab), vocab)  # [B, T]
    rows = jnp.arange(batch)[:, None]  # [B, 1]
    counts = jnp.zeros((batch, vocab + 1), jnp.float32).at[rows, ids].add(1.0)  # [B, V+1]
    return counts[:, :vocab]  # [B, V]


def token_presence(tokens: jax.Array, valid: jax.Array, vocab: int) -> jax.Array:
    """bool [B, V]: the id occurs among the valid positions."""
    batch = tokens.shape[0]
    ids = jnp.where(valid, jnp.minimum(tokens, vocab), vocab)  # [B, T]
    rows = jnp.arange(batch)[:, None]  # [B, 1]
    seen = jnp.zeros((batch, vocab + 1), bool).at[rows, ids].set(True)  # [B, V+1]
    return seen[:, :vocab]  # [B, V]


# ----------------------------------------------------------------------- penalties
def repetition_penalty(scores: jax.Array, ctx, penalty, prompt_ignore_length=None
                       ) -> jax.Array:
    """HF RepetitionPenaltyLogitsProcessor over the row's whole sequence (prompt + generated).

    A seen token's score s becomes s * penalty if s < 0 else s / penalty.
    prompt_ignore_length: int or per-row [B]: each row's first N tokens are not counted
    (HF's argument of the same name; None counts them all).

    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.array([[0, 1, 2]]), length=jnp.array([3]),
    ...                        prompt_len=jnp.array([2]))
    >>> repetition_penalty(jnp.array([[2.0, 2.0, 2.0, 2.0]]), ctx, 2.0, 2).tolist()
    [[2.0, 2.0, 1.0, 2.0]]
    """
    batch, vocab = scores.shape
    p = per_row(penalty, batch)  # [B, 1]
    start = (None if prompt_ignore_length is None
             else per_row(prompt_ignore_length, batch, jnp.int32)[:, 0])  # [B]
    valid = valid_positions(ctx.tokens, ctx.length, start=start)  # [B, T]
    seen = token_presence(ctx.tokens, valid, vocab)  # [B, V]
    penalised = jnp.where(scores < 0, scores * p, scores / p)  # [B, V]
    return jnp.where(seen, penalised, scores)  # [B, V]


def presence_frequency_penalty(scores: jax.Array, ctx, presence, frequency) -> jax.Array:
    """OpenAI / vLLM presence and frequency penalties over the generated tokens only.

    s -= frequency * count + presence * (count > 0), count = occurrences among generated ids.
    """
    batch, vocab = scores.shape
    generated = valid_positions(ctx.tokens, ctx.length, start=ctx.prompt_len)  # [B, T]
    counts = token_counts(ctx.tokens, generated, vocab)  # [B, V]
    penalty = (per_row(frequency, batch) * counts
               + per_row(presence, batch) * (counts > 0).astype(jnp.float32))  # [B, V]
    return scores - penalty  # [B, V]


# ------------------------------------------------------------------ no-repeat-ngram
def no_repeat_ngram(scores: jax.Array, ctx, ngram_size: int) -> jax.Array:
    """HF NoRepeatNGramLogitsProcessor, per row over its real tokens.

    The next token t is banned if (last n-1 tokens, t) already occurs as an n-gram.
    """
    batch, vocab = scores.shape
    tokens, length = ctx.tokens, ctx.length  # [B, T], [B]
    width = tokens.shape[1]
    n = int(ngram_size)
    if n > width:
        return scores
    prefix_index = jnp.clip(length[:, None] - (n - 1) + jnp.arange(n - 1)[None, :], 0, width - 1)
    prefix = jnp.take_along_axis(tokens, prefix_index, axis=1)  # [B, n-1]
    starts = width - n + 1  # number of complete windows in the buffer
    match = jnp.arange(starts)[None, :] <= length[:, None] - n  # [B, W]: window lies in the row
    for k in range(n - 1):
        match &= tokens[:, k:k + starts] == prefix[:, k:k + 1]  # [B, W]
    last = tokens[:, n - 1:n - 1 + starts]  # [B, W] the token each window would repeat
    ids = jnp.where(match, jnp.minimum(last, vocab), vocab)  # [B, W]
    rows = jnp.arange(batch)[:, None]
    banned = jnp.zeros((batch, vocab + 1), bool).at[rows, ids].set(True)[:, :vocab]  # [B, V]
    return jnp.where(banned, -jnp.inf, scores)  # [B, V]


# ----------------------------------------------------------- sequence bias, bad words
def normalize_sequence_bias(sequence_bias) -> tuple[tuple[tuple[int, ...], float], ...]:
    """HF's accepted forms (list of [ids, bias] pairs, or {tuple(ids): bias}) -> a tuple of
    (ids, bias) pairs; a repeated sequence keeps its last bias (HF builds a dict)."""
    pairs = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
    merged: dict[tuple[int, ...], float] = {}
    for pair in pairs:
        ids, bias = pair
        merged[tuple(int(t) for t in ids)] = float(bias)
    return tuple(merged.items())


def bad_words_as_bias(bad_words_ids, eos_ids: tuple[int, ...]
                      ) -> tuple[tuple[tuple[int, ...], float], ...]:
    """HF NoBadWordsLogitsProcessor: each sequence gets bias -inf, except single EOS ids."""
    kept = [tuple(seq) for seq in bad_words_ids if not (len(seq) == 1 and seq[0] in eos_ids)]
    return tuple((seq, float("-inf")) for seq in dict.fromkeys(kept))


def sequence_bias(scores: jax.Array, ctx, table: tuple[tuple[tuple[int, ...], float], ...]
                  ) -> jax.Array:
    """HF SequenceBiasLogitsProcessor with a static table of (ids, bias) pairs.

    A length-1 sequence always biases its token; a longer one biases its last token when the
    row's last len-1 real tokens equal its prefix (rows shorter than the prefix never match).
    """
    batch, vocab = scores.shape
    bias = jnp.zeros_like(scores)  # [B, V]
    singles = [(ids[0], b) for ids, b in table if len(ids) == 1]
    if singles:
        ids, values = zip(*singles)
        bias = bias.at[:, np.asarray(ids)].add(jnp.asarray(values, jnp.float32))
    groups = defaultdict(list)
    for ids, b in table:
        if len(ids) > 1:
            groups[len(ids) - 1].append((ids, b))
    width = ctx.tokens.shape[1]
    for plen, group in groups.items():
        prefixes = jnp.asarray(np.array([ids[:-1] for ids, _ in group], np.int32))  # [G, p]
        lasts = np.array([ids[-1] for ids, _ in group], np.int32)  # [G]
        values = jnp.asarray(np.array([b for _, b in group], np.float32))  # [G]
        index = jnp.clip(ctx.length[:, None] - plen + jnp.arange(plen)[None, :], 0, width - 1)
        tail = jnp.take_along_axis(ctx.tokens, index, axis=1)  # [B, p]
        match = jnp.all(tail[:, None, :] == prefixes[None], axis=-1)  # [B, G]
        match &= (ctx.length >= plen)[:, None]
        bias = bias.at[:, lasts].add(jnp.where(match, values[None, :], 0.0))  # [B, V]
    return scores + bias  # [B, V]
