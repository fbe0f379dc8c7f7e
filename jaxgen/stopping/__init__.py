"""Stopping criteria evaluated on the device after each write.

Stop reasons (int32 per row, `GenerateOutput.stop_reason`):
    0 NOT_STOPPED, 1 EOS, 2 MAX_LENGTH (budget or buffer exhausted), 3 STOP_STRING,
    4 CUSTOM (a user stopping criterion), 5 MAX_TIME (`max_time` ran out; chunked driver),
    6 CANCELLED (a streamer's cancel() or a stop_event; chunked driver),
    7 INVALID_LOGITS (the model produced NaN / inf logits for the row: its output is garbage).
When several fire at the same step the first in the order INVALID_LOGITS, EOS, STOP_STRING,
CUSTOM, MAX_LENGTH is recorded (jaxgen.core.step.reason_of, shared by every loop).

Custom criteria are traceable callables `criterion(ctx, scores) -> bool [B]` (True = stop the
row), evaluated after the new token is written: `ctx` is a `jaxgen.logits.chain.
ProcessorContext` whose `tokens` / `length` include the new token, `scores` are the processed
scores [B, V] the token was chosen from (Hugging Face's `StoppingCriteria(input_ids, scores)`).
Ready-made criteria objects (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria,
ConfidenceCriteria, MaxTimeCriteria, StoppingCriteriaList) live in `jaxgen.stopping.criteria`.

Stop strings: see `jaxgen.stopping.strings` (tables built on the host from the tokenizer,
checked on the device each step).

Example:
    >>> hit_eos(jnp.array([2, 5]), (2,))
    Array([ True, False], dtype=bool)
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxgen.config.program import eos_array

NOT_STOPPED, EOS, MAX_LENGTH, STOP_STRING, CUSTOM, MAX_TIME, CANCELLED = 0, 1, 2, 3, 4, 5, 6
INVALID_LOGITS = 7
STOP_REASONS = {NOT_STOPPED: "not_stopped", EOS: "eos", MAX_LENGTH: "max_length",
                STOP_STRING: "stop_string", CUSTOM: "custom", MAX_TIME: "max_time",
                CANCELLED: "cancelled", INVALID_LOGITS: "invalid_logits"}

StoppingCriterionFn = Callable[..., jax.Array]


def hit_eos(tokens: jax.Array, eos_ids) -> jax.Array:
    """tokens int32 [B] -> bool [B]: the token is one of the EOS ids (a tuple, or a program
    config's dynamic table, jaxgen.config.program.EosTable)."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, eos_array(eos_ids))  # [B]


def out_of_budget(length: jax.Array, prompt_len: jax.Array, max_new: jax.Array,
                  buffer_len: int) -> jax.Array:
    """bool [B]: no room for another token (per-row budget or the static buffer)."""
    return (length - prompt_len >= max_new) | (length >= buffer_len)  # [B]


def custom_stop(criteria: Sequence[StoppingCriterionFn], ctx, scores: jax.Array) -> jax.Array:
    """bool [B]: any user criterion asks to stop the row."""
    batch = ctx.length.shape[0]
    hit = jnp.zeros((batch,), bool)
    for criterion in criteria:
        out = jnp.asarray(criterion(ctx, scores))
        if out.dtype != bool or out.shape not in ((batch,), ()):
            raise ValueError(f"stopping criterion {criterion!r} must return bool [B] "
                             f"(B={batch}), got {out.dtype} {out.shape}")
        hit |= jnp.broadcast_to(out, (batch,))
    return hit  # [B]
