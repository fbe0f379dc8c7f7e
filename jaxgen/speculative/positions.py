"""Processors at every verify position, each with the prefix that ends there.

Position j of a verify block predicts the token at index `length + j`; its processors see
`tokens[:, :length + j]` (the row's real tokens followed by drafts 0..j-1). All positions
share one token buffer that already holds the drafts: a `ProcessorContext` only differs in
`length`, and the processors read indices `< length` only. The chain is mapped over the
positions with `jax.vmap`, so any processor (built-in or user, per-row parameters included)
runs unchanged.

Example:
    >>> scores = process_positions(cfg, raw [B, K+1, V], work_tokens, length, state)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.processors import ProcessorContext, process_logits


def base_context(tokens: jax.Array, length: jax.Array, state) -> ProcessorContext:
    """The context `jaxgen.decode.choose_and_write` builds, over another token buffer."""
    return ProcessorContext(tokens=tokens, length=length, prompt_len=state.prompt_len,
                            max_new=state.max_new)


def context_at(ctx: ProcessorContext, length: jax.Array) -> ProcessorContext:
    """The same context with another per-row length (int32 [B])."""
    return dataclasses.replace(ctx, length=length.astype(jnp.int32))


def process_positions(cfg, raw: jax.Array, tokens: jax.Array, length: jax.Array, state,
                      extra=()) -> jax.Array:
    """raw float32 [B, S, V] -> processed scores [B, S, V]; position j uses length + j."""
    ctx = base_context(tokens, length, state)
    offsets = jnp.arange(raw.shape[1], dtype=jnp.int32)  # [S]

    def one(logits, offset):  # logits [B, V]
        return process_logits(cfg, logits, context_at(ctx, length + offset), extra=extra)

    return jax.vmap(one, in_axes=(1, 0), out_axes=1)(raw.astype(jnp.float32), offsets)
