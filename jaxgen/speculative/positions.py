"""Processors at every verify position, each with the prefix that ends there.

Position j of a verify block predicts the token at index `length + j`; its processors see
`tokens[:, :length + j]` (the row's real tokens followed by drafts 0..j-1). All positions
share one token buffer that already holds the drafts: a `ProcessorContext` only differs in
`length`, and the processors read indices `< length` only. The chain is mapped over the
positions with `jax.vmap`, so any processor (built-in or user, per-row parameters included)
runs unchanged.

Example:
    >>> import jax.numpy as jnp
    >>> from types import SimpleNamespace
    >>> from jaxgen.config.generation import GenerationConfig
    >>> rows = SimpleNamespace(prompt_len=jnp.array([1]), max_new=jnp.array([8]))
    >>> tokens = jnp.array([[3, 1, 0, 0]])        # 3 is the prompt, 1 a draft
    >>> raw = jnp.zeros((1, 2, 4))                # two verify positions, vocabulary 4
    >>> cfg = GenerationConfig(repetition_penalty=2.0)
    >>> process_positions(cfg, raw, tokens, jnp.array([1]), rows)[0].tolist()  # 0 * 2 = 0
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    >>> raw = jnp.ones((1, 2, 4))
    >>> process_positions(cfg, raw, tokens, jnp.array([1]), rows)[0].tolist()
    [[1.0, 1.0, 1.0, 0.5], [1.0, 0.5, 1.0, 0.5]]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.core.step import processor_context
from jaxgen.logits.chain import process_logits


def process_positions(cfg, raw: jax.Array, tokens: jax.Array, length: jax.Array, rows,
                      extra=()) -> jax.Array:
    """raw float32 [B, S, V] -> processed scores [B, S, V]; position j uses length + j.

    rows: what holds prompt_len / max_new [B] (the DecodeState).
    """
    offsets = jnp.arange(raw.shape[1], dtype=jnp.int32)  # [S]

    def one(logits, offset):  # logits [B, V]
        ctx = processor_context(tokens, length + offset, rows.prompt_len, rows.max_new)
        return process_logits(cfg, logits, ctx, extra=extra)

    return jax.vmap(one, in_axes=(1, 0), out_axes=1)(raw.astype(jnp.float32), offsets)
