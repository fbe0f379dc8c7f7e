"""Stopping criteria evaluated on the device after each write.

Stop reasons (int32 per row, `GenerateOutput.stop_reason`):
    0 NOT_STOPPED, 1 EOS, 2 MAX_LENGTH (budget or buffer exhausted).

Example:
    >>> hit_eos(jnp.array([2, 5]), (2,))
    Array([ True, False], dtype=bool)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NOT_STOPPED, EOS, MAX_LENGTH = 0, 1, 2
STOP_REASONS = {NOT_STOPPED: "not_stopped", EOS: "eos", MAX_LENGTH: "max_length"}


def hit_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """tokens int32 [B] -> bool [B]: the token is one of the EOS ids."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))  # [B]


def out_of_budget(length: jax.Array, prompt_len: jax.Array, max_new: jax.Array,
                  buffer_len: int) -> jax.Array:
    """bool [B]: no room for another token (per-row budget or the static buffer)."""
    return (length - prompt_len >= max_new) | (length >= buffer_len)  # [B]


def update_stop(done: jax.Array, reason: jax.Array, newly_eos: jax.Array,
                newly_full: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Marks rows done, recording the first reason that stopped them (EOS wins ties)."""
    reason = jnp.where(done, reason,
                       jnp.where(newly_eos, EOS, jnp.where(newly_full, MAX_LENGTH, NOT_STOPPED)))
    return done | newly_eos | newly_full, reason.astype(jnp.int32)
