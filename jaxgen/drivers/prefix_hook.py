"""Hugging Face's `prefix_allowed_tokens_fn` on the chunked driver, one step per chunk.

HF calls `fn(batch_id, input_ids) -> allowed token ids` for every row before every token.
A Python function cannot run inside the compiled loop, so the chunked driver
(jaxgen.drivers.chunked) runs the plain loop one step per call and, before each step, this hook
calls `fn` for every live row (batch_id = the row, input_ids = the row's prompt + generated
ids as a 1-D numpy int array, without padding) and writes the allowed lists into the
state's constraint as a one-step automaton (jaxgen.constraints.automaton.host_automaton):
row b sits in state b, whose bit-packed mask is the row's list. The compiled step masks
exactly as for a compiled pattern, so the same program serves every step and new lists
never recompile. The compiled form (regex= / json_schema= / choices=, or a prebuilt
TokenAutomaton) runs in any mode without leaving the device.

An empty list is an error, as in HF (the row would have no token to choose).

Example (illustration: jaxgen.generate runs it when the function is given):
    >>> only_digits = lambda batch_id, ids: list(range(48, 58))
    >>> out = jaxgen.generate(params, state, cfg, prefix_allowed_tokens_fn=only_digits)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.constraints.automaton import ConstraintCarry, host_automaton, pack_mask
from jaxgen.core.state import DecodeState

PrefixFn = Callable[[int, np.ndarray], "list[int]"]


def allowed_masks(fn: PrefixFn, tokens: np.ndarray, length: np.ndarray, done: np.ndarray,
                  vocab_size: int) -> np.ndarray:
    """bool [B, V]: fn's allowed ids for every live row (finished rows allow everything:
    they only write padding)."""
    batch = tokens.shape[0]
    masks = np.zeros((batch, vocab_size), bool)  # [B, V]
    for b in range(batch):
        if done[b]:
            masks[b] = True
            continue
        allowed = fn(b, tokens[b, :length[b]].copy())
        ids = np.asarray(list(allowed) if not isinstance(allowed, np.ndarray) else allowed)
        if ids.size == 0:
            raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for batch ID "
                             f"{b}: every step needs at least one allowed token")
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"`prefix_allowed_tokens_fn` returned {ids.tolist()[:8]} for batch "
                             f"ID {b}: allowed ids are ints in 0..{vocab_size - 1}")
        masks[b, ids] = True
    return masks


def prefix_fn_hook(fn: PrefixFn, then: Callable | None = None):
    """A chunked-driver `prepare_chunk(state, step, n)` hook that writes fn's allowed lists
    into the state before each one-step chunk; `then` (e.g. the growing cache's hook) runs
    first."""
    def prepare(state: DecodeState, step: int, steps: int) -> DecodeState:
        if then is not None:
            state = then(state, step, steps)
        tokens, length, done = (np.asarray(a) for a in jax.device_get(
            (state.tokens, state.length, state.done)))
        masks = allowed_masks(fn, tokens, length, done, state.model.vocab_size)  # [B, V]
        carry = state.constraint
        if carry is None:
            automaton = host_automaton(masks)
            carry = ConstraintCarry(automaton=automaton,
                                    state=jnp.arange(state.batch, dtype=jnp.int32))  # [B]
        else:  # same shapes: only the masks change, the compiled step is reused
            allowed = np.zeros(carry.automaton.allowed.shape, np.uint32)  # [S, W]
            allowed[:state.batch] = pack_mask(masks)
            carry = carry.replace(automaton=carry.automaton.replace(
                allowed=jnp.asarray(allowed)))
        return state.replace(constraint=carry)
    return prepare


__all__ = ["allowed_masks", "prefix_fn_hook"]
