"""Choosing the next token from processed scores: greedy argmax or multinomial sampling.

Each row draws with its own key, folded with the position being written, so a row's
sample depends only on its key, its history and its position (never on its neighbours).

Example:
    >>> scores = jnp.array([[0.0, 2.0, 1.0]])
    >>> select_tokens(scores, jax.random.key(0)[None], jnp.array([3]), do_sample=False)
    Array([1], dtype=int32)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def step_keys(row_keys: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-row step keys: fold_in(row_key, position). row_keys [B], positions int32 [B]."""
    return jax.vmap(jax.random.fold_in)(row_keys, positions)  # [B]


def sample_rows(scores: jax.Array, keys: jax.Array) -> jax.Array:
    """One categorical draw per row. scores float32 [B, V] (may hold -inf); keys [B]."""
    return jax.vmap(lambda k, s: jax.random.categorical(k, s))(keys, scores).astype(jnp.int32)


def select_tokens(scores: jax.Array, row_keys: jax.Array, positions: jax.Array, *,
                  do_sample: bool) -> jax.Array:
    """Next token per row. scores [B, V]; positions int32 [B] (where the token goes).

    Sampling skips the draws when every row has a single candidate left (e.g. top_k=1 rows,
    a server's temperature-0 requests): the draw could only pick it, so the argmax is the
    same token without the [B, V] random numbers.

    >>> one = jnp.array([[-jnp.inf, 0.5, -jnp.inf], [2.0, -jnp.inf, -jnp.inf]])
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> select_tokens(one, keys, jnp.array([3, 3]), do_sample=True).tolist()
    [1, 0]
    """
    greedy = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # [B]
    if not do_sample:
        return greedy
    single = jnp.sum(scores > -jnp.inf, axis=-1) == 1  # [B]: one candidate left
    return jax.lax.cond(jnp.all(single), lambda: greedy,
                        lambda: sample_rows(scores, step_keys(row_keys, positions)))  # [B]


def token_logprobs(scores: jax.Array, tokens: jax.Array) -> jax.Array:
    """log-softmax of the processed scores at the chosen tokens. [B, V], [B] -> [B]."""
    logprobs = jax.nn.log_softmax(scores, axis=-1)  # [B, V]
    return jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]  # [B]
