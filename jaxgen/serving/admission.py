"""The slots' state and the admission program: newcomers prefilled apart, then scattered in.

The engine holds one fixed-shape `DecodeState` of `slots` rows and a buffer of `max_len`
tokens (`empty_slots`): every slot starts done. Admitting requests is one compiled program
(`AdmitLoop.start`, run through jaxgen.runtime.compiled.start like any loop's start): the
newcomers' right-padded prompts [N, P] are prefilled in a fresh cache of their own and their
first token chosen (jaxgen.loops.decode.decode_start, the plain loop's own start, so every
rule is the solo call's), then their cache rows, tokens, lengths, budgets, keys, done flags
and stop reasons are written into the free slots (jaxgen.cache.row_scatter). N is padded to
a power of two (`admission_rows`) and P to a prompt bucket, so few programs serve every
admission; padded newcomers go to slot `slots` and are dropped.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> state = empty_slots(model, cfg, slots=2, max_len=32)
    >>> state.tokens.shape, state.done.tolist()
    ((2, 32), [True, True])
    >>> [admission_rows(n, 4) for n in (1, 2, 3, 4)]
    [1, 2, 4, 4]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.layout import cache_dtype
from jaxgen.cache.row_scatter import scatter_cache_rows, take_cache_rows
from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.automaton import start_carry
from jaxgen.core.state import (
    MIN_PROMPT_BUCKET,
    DecodeState,
    init_cache_for,
    program_state,
    resolve_pad_id,
    row_keys,
)
from jaxgen.loops.beam import cache_batch_axes
from jaxgen.core.output import StepRecord
from jaxgen.core.step import prefill_tokens
from jaxgen.loops.decode import choose_and_write, decode_start


def admission_rows(count: int, slots: int) -> int:
    """The padded number of newcomers one admission prefills: the next power of two, at most
    `slots`."""
    return min(1 << max(count - 1, 0).bit_length(), slots)


def empty_slots(model, cfg: GenerationConfig, slots: int, max_len: int,
                dtype=jnp.float32, constraint=None) -> DecodeState:
    """The engine's state: `slots` done rows over a buffer of `max_len` tokens, in program
    form (the pad id a dynamic array). constraint: a TokenAutomaton every slot follows
    (jaxgen.constraints.automaton; each newcomer starts at its initial state), or None."""
    pad = resolve_pad_id(cfg, model)
    state = DecodeState(
        tokens=jax.device_put(np.full((slots, max_len), pad, np.int32)),  # [S, T]
        length=jax.device_put(np.ones((slots,), np.int32)),  # [S]
        prompt_len=jax.device_put(np.ones((slots,), np.int32)),  # [S]
        max_new=jax.device_put(np.ones((slots,), np.int32)),  # [S]
        done=jax.device_put(np.ones((slots,), bool)),  # [S]
        stop_reason=jax.device_put(np.zeros((slots,), np.int32)),  # [S]
        cache=init_cache_for(model, cfg, slots, max_len, MIN_PROMPT_BUCKET, dtype),
        key=row_keys(jax.random.key(0), slots),  # [S]
        model=model, prompt_bucket=MIN_PROMPT_BUCKET, pad_token_id=pad,
        constraint=None if constraint is None else start_carry(constraint, slots))
    return program_state(state)


def slot_cache_axes(model, cfg: GenerationConfig, max_len: int) -> tuple:
    """Each cache leaf's batch axis (None: no rows), as the admission program scatters."""
    return cache_batch_axes(model, cfg, max_len, MIN_PROMPT_BUCKET)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """The newcomers of one admission (N rows, padded): the program's dynamic inputs."""

    tokens: jax.Array  # int32 [N, P] right-padded prompts
    prompt_len: jax.Array  # int32 [N]
    max_new: jax.Array  # int32 [N]
    key: jax.Array  # typed PRNG keys [N]: each request's row key
    slot: jax.Array  # int32 [N]: the free slot of each newcomer (S: a padded row, dropped)


def host_admission(prompts: list, budgets: list, keys: list, slots: list, rows: int,
                   bucket: int, pad: int, no_slot: int) -> Admission:
    """An Admission from host values, padded to `rows` newcomers and `bucket` positions."""
    tokens = np.full((rows, bucket), pad, np.int32)  # [N, P]
    lengths = np.ones((rows,), np.int32)  # [N]
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
        lengths[i] = len(prompt)
    max_new = np.ones((rows,), np.int32)  # [N]
    max_new[:len(budgets)] = budgets
    where = np.full((rows,), no_slot, np.int32)  # [N]
    where[:len(slots)] = slots
    padded_keys = list(keys) + [keys[0]] * (rows - len(keys))
    return Admission(tokens=jax.device_put(tokens), prompt_len=jax.device_put(lengths),
                     max_new=jax.device_put(max_new), key=jnp.stack(padded_keys),
                     slot=jax.device_put(where))


def _put_rows(old: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """old [S, ...] with new [N, ...] written at rows slot [N] (out of range: dropped)."""
    return old.at[slot].set(new.astype(old.dtype), mode="drop")


def newcomer_state(state: DecodeState, inputs: Admission) -> DecodeState:
    """The newcomers' own state before their prefill: their prompts in a buffer as wide as
    the slots', a fresh cache, their budgets and keys (traced, inside an admission)."""
    rows, bucket = inputs.tokens.shape
    width = state.buffer_len
    tokens = jnp.full((rows, width), state.pad, jnp.int32)  # [N, T]
    tokens = jax.lax.dynamic_update_slice(tokens, inputs.tokens, (0, 0))  # [N, T]
    fresh = state.model.init_cache(rows, width, cache_dtype(state.cache))
    return state.replace(
        tokens=tokens, length=inputs.prompt_len, prompt_len=inputs.prompt_len,
        max_new=inputs.max_new, done=jnp.zeros((rows,), bool),
        stop_reason=jnp.zeros((rows,), jnp.int32), cache=fresh, key=inputs.key,
        prompt_bucket=bucket, constraint=None if state.constraint is None else
        state.constraint.replace(state=jnp.full(  # [N]: every newcomer at the start
            (rows,), state.constraint.automaton.initial, jnp.int32)))


def scatter_newcomers(state: DecodeState, newcomers: DecodeState, slot: jax.Array,
                      axes: tuple) -> DecodeState:
    """The slots' state with the newcomers' rows written at slot [N] (out of range: dropped);
    axes: the cache leaves' batch axes (slot_cache_axes)."""
    constraint = None if state.constraint is None else state.constraint.replace(
        state=_put_rows(state.constraint.state, newcomers.constraint.state, slot))
    key_data = _put_rows(jax.random.key_data(state.key), jax.random.key_data(newcomers.key),
                         slot)  # [S, 2]
    return state.replace(
        tokens=_put_rows(state.tokens, newcomers.tokens, slot),
        length=_put_rows(state.length, newcomers.length, slot),
        prompt_len=_put_rows(state.prompt_len, newcomers.prompt_len, slot),
        max_new=_put_rows(state.max_new, newcomers.max_new, slot),
        done=_put_rows(state.done, newcomers.done, slot),
        stop_reason=_put_rows(state.stop_reason, newcomers.stop_reason, slot),
        cache=scatter_cache_rows(state.cache, newcomers.cache, slot, axes),
        key=jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(state.key)),
        constraint=constraint)


@dataclasses.dataclass(frozen=True)
class AdmitLoop:
    """A loop whose `start` admits newcomers into the slots (jaxgen.runtime.compiled.start:
    the slots' state is donated). Static and hashable: `axes` are the cache's batch axes."""

    axes: tuple
    takes_layer_tuples = False  # the newcomers' cache and the slots' are scattered stacked

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """The slots' decode rows, so admission and decoding share one weight layout."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs: Admission):
        """(the slots' state with the newcomers in their slots, the newcomers' first-token
        StepRecord [N, 1]). cfg: the newcomers' program config (per-row values [N])."""
        newcomers, record = decode_start(params, newcomer_state(state, inputs), cfg)
        first = jax.tree_util.tree_map(lambda a: a[:, :1], record)  # [N, 1, ...] step 0
        return scatter_newcomers(state, newcomers, inputs.slot, self.axes), first


# ----------------------------------------------------------------------------- chunked prefill
DEFAULT_PREFILL_WIDTH = 64  # positions one prompt chunk prefills


def chunk_starts(prompt_len: int, width: int, buffer_len: int) -> list[int]:
    """The first position of each chunk that prefills a prompt of `prompt_len` tokens, `width`
    positions a chunk, in a slot of `buffer_len`: 0, width, 2 * width, ..., the last moved
    back so it ends inside the buffer (it then recomputes a few cached positions, the same
    keys and values).

    >>> chunk_starts(40, 64, 512), chunk_starts(130, 64, 512), chunk_starts(250, 64, 256)
    ([0], [0, 64, 128], [0, 64, 128, 192])
    >>> chunk_starts(250, 64, 251)
    [0, 64, 128, 187]
    """
    if not 1 <= prompt_len < buffer_len or width > buffer_len:
        raise ValueError(f"chunk_starts: a prompt of {prompt_len} tokens and chunks of {width} "
                         f"positions need a buffer longer than both (got {buffer_len})")
    starts = list(range(0, prompt_len, width))
    starts[-1] = min(starts[-1], buffer_len - width)
    return starts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """One chunk of one newcomer's prompt (a PrefillChunkLoop's dynamic inputs)."""

    block: jax.Array  # int32 [1, W] the prompt at positions start .. start + W - 1, pad past it
    start: jax.Array  # int32 [1] the block's first position
    row: jax.Array  # int32 [1, T] the whole prompt, pad after it (the last chunk writes it)
    prompt_len: jax.Array  # int32 [1]
    max_new: jax.Array  # int32 [1]
    key: jax.Array  # typed PRNG key [1]: the request's row key
    slot: jax.Array  # int32 [1] the newcomer's slot


def host_chunk(prompt: list, start: int, width: int, budget: int, key, slot: int,
               buffer_len: int, pad: int) -> PromptChunk:
    """The PromptChunk of `prompt`'s positions start .. start + width - 1 (host values)."""
    row = np.full((1, buffer_len), pad, np.int32)  # [1, T]
    row[0, :len(prompt)] = prompt
    block = row[:, start:start + width]  # [1, W]
    return PromptChunk(block=jax.device_put(block), start=jax.device_put(np.int32([start])),
                       row=jax.device_put(row), prompt_len=jax.device_put(
                           np.int32([len(prompt)])), max_new=jax.device_put(np.int32([budget])),
                       key=key[None], slot=jax.device_put(np.int32([slot])))


@dataclasses.dataclass(frozen=True)
class PrefillChunkLoop:
    """A loop whose `start` prefills one chunk of a newcomer's prompt straight into its slot
    (jaxgen.runtime.compiled.start, the slots' state donated): the slot's cache row is read,
    extended by the chunk's positions and written back. The last chunk (`last`) also chooses
    the first new token as the plain loop's start does (jaxgen.loops.decode.choose_and_write)
    and writes the newcomer's tokens, length, budget, key and flags into the slot; it returns
    that token's StepRecord [1, 1]. Two programs (last or not) serve every prompt length.
    Static and hashable: `axes` are the cache's batch axes."""

    axes: tuple
    last: bool
    takes_layer_tuples = False  # the slot's row is read and written stacked

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """The slots' decode rows, so admission and decoding share one weight layout."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs: PromptChunk):
        row_cache = take_cache_rows(state.cache, inputs.slot, self.axes)  # the slot's row
        row_cache, logits = prefill_tokens(state.model, params, inputs.block, inputs.prompt_len,
                                           row_cache, cfg.prefill_chunk_size,
                                           start=inputs.start)  # logits [1, V]
        if not self.last:
            return state.replace(cache=scatter_cache_rows(state.cache, row_cache, inputs.slot,
                                                          self.axes)), None
        newcomer = state.replace(
            tokens=inputs.row, length=inputs.prompt_len, prompt_len=inputs.prompt_len,
            max_new=inputs.max_new, done=jnp.zeros((1,), bool),
            stop_reason=jnp.zeros((1,), jnp.int32), cache=row_cache, key=inputs.key,
            constraint=None if state.constraint is None else state.constraint.replace(
                state=jnp.full((1,), state.constraint.automaton.initial, jnp.int32)))
        record = StepRecord.empty(1, 1, state.model.vocab_size, cfg)
        newcomer, record = choose_and_write(cfg, newcomer, logits, record, 0)
        return scatter_newcomers(state, newcomer, inputs.slot, self.axes), record


__all__ = ["Admission", "AdmitLoop", "DEFAULT_PREFILL_WIDTH", "PrefillChunkLoop",
           "PromptChunk", "admission_rows", "chunk_starts", "empty_slots", "host_admission",
           "host_chunk", "newcomer_state", "scatter_newcomers", "slot_cache_axes"]
