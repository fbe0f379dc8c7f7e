"""The slots' state and how newcomers enter it: their prompts prefilled in chunks, in place.

The engine holds one fixed-shape `DecodeState` of `slots` rows and a buffer of `max_len`
tokens (`empty_slots`): every slot starts done. `PrefillChunkLoop` (run through
jaxgen.runtime.compiled.start like any loop's start) prefills one chunk of each newcomer's
prompt straight into its slot (the call's width: the narrowest of `prefill_widths` that
holds the longest rest of a prompt, at most the engine's `prefill_width`); a prompt's last
chunk also chooses its first token with the plain loop's `choose_and_write` (so every rule
is the solo call's) and writes its tokens, length, budget, key and flags into the slot
(`scatter_newcomers`). The newcomer count N is
padded to a power of two (`admission_rows`); padded newcomers go to slot `slots` and are
dropped. A speculative engine admits through `newcomer_state` / `scatter_newcomers` with
its own start (jaxgen.serving.spec_admission).

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
from jaxgen.core.context import model_positions
from jaxgen.core.state import (
    MIN_PROMPT_BUCKET,
    DecodeState,
    init_cache_for,
    memory_shortfall,
    new_token_bucket,
    program_state,
    prompt_bucket,
    resolve_pad_id,
    row_keys,
)
from jaxgen.loops.beam import cache_batch_axes
from jaxgen.core.output import StepRecord
from jaxgen.core.step import prefill_tokens
from jaxgen.loops.decode import choose_and_write


def admission_rows(count: int, slots: int) -> int:
    """The padded number of newcomers one admission prefills: the next power of two, at most
    `slots`."""
    return min(1 << max(count - 1, 0).bit_length(), slots)


def check_slots_fit(model, cfg: GenerationConfig, slots: int, max_len: int,
                    dtype=jnp.float32) -> None:
    """ValueError, before anything is allocated, for a `max_len` past the model's positions
    (jaxgen.core.context.model_positions: no bound for a model that extrapolates them), or
    for slots x max_len whose KV cache and token buffer exceed the device's memory."""
    positions = model_positions(model)
    if positions is not None and max_len > positions:
        raise ValueError(f"jaxgen.serving.Engine: `max_len`={max_len} is past the model's "
                         f"{positions} positions (max_position_embeddings); allowed: "
                         f"2..{positions}")
    shortfall = memory_shortfall(model, cfg, slots, max_len, MIN_PROMPT_BUCKET, dtype)
    if shortfall is not None:
        raise ValueError(f"jaxgen.serving.Engine: `slots`={slots} x `max_len`={max_len} do "
                         f"not fit: {shortfall}; lower slots or max_len")


def slot_length(model, longest_prompt: int, max_new_tokens: int) -> int:
    """A slot buffer for prompts of up to `longest_prompt` tokens and budgets of up to
    `max_new_tokens`: the prompt's bucket plus the budget's (what a fixed batch holding that
    prompt would have), at most the model's positions (each request is checked against
    them) and at least 2."""
    length = prompt_bucket(max(longest_prompt, 1)) + new_token_bucket(max_new_tokens)
    positions = model_positions(model)  # the buckets' padding never passes them
    return length if positions is None else max(min(length, positions), 2)


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


def slot_cache_axes(model, cfg: GenerationConfig, max_len: int,
                    layer_tuples: bool = False) -> tuple:
    """Each cache leaf's batch axis (None: no rows), as the admission program scatters;
    layer_tuples: the slots' cache is held as one buffer per layer."""
    return cache_batch_axes(model, cfg, max_len, MIN_PROMPT_BUCKET, layer_tuples)


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
                      axes: tuple, with_cache: bool = True) -> DecodeState:
    """The slots' state with the newcomers' rows written at slot [N] (out of range: dropped);
    axes: the cache leaves' batch axes (slot_cache_axes); with_cache=False leaves the
    slots' cache as it is (rows already written)."""
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
        cache=scatter_cache_rows(state.cache, newcomers.cache, slot, axes) if with_cache
        else state.cache,
        key=jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(state.key)),
        constraint=constraint)


# ----------------------------------------------------------------------------- chunked prefill
DEFAULT_PREFILL_WIDTH = 64  # positions one prompt chunk prefills (at most)


def prefill_widths(width: int) -> tuple[int, ...]:
    """The chunk widths an admission call may run: a quarter, a half, three quarters and all
    of `width`, so a short prompt's chunk is not padded to the longest (a 36-token prompt
    runs 48 positions of 64; a call costs about its positions).

    >>> prefill_widths(64), prefill_widths(10), prefill_widths(2)
    ((16, 32, 48, 64), (2, 5, 7, 10), (1, 2))
    """
    return tuple(sorted({max(width * quarter // 4, 1) for quarter in range(1, 5)}))


def next_chunk(done: int, prompt_len: int, width: int, buffer_len: int) -> tuple[int, bool]:
    """(first position, last) of the `width`-position chunk that goes on prefilling a prompt
    of `prompt_len` tokens whose first `done` are in the cache, in a slot of `buffer_len`: it
    starts at `done`, moved back so it ends inside the buffer (it then recomputes a few
    cached positions, the same keys and values); `last` when it reaches the prompt's end.

    >>> next_chunk(0, 40, 48, 512), next_chunk(64, 130, 64, 512), next_chunk(192, 250, 64, 251)
    ((0, True), (64, False), (187, True))
    """
    if not 0 <= done < prompt_len < buffer_len or width > buffer_len:
        raise ValueError(f"next_chunk: a prompt of {prompt_len} tokens ({done} prefilled) and "
                         f"chunks of {width} positions need a buffer longer than both (got "
                         f"{buffer_len})")
    start = min(done, buffer_len - width)
    return start, start + width >= prompt_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptChunks:
    """One chunk of each of N newcomers' prompts (a PrefillChunkLoop's dynamic inputs)."""

    block: jax.Array  # int32 [N, W] each prompt at positions start .. start + W - 1, pad past it
    start: jax.Array  # int32 [N] each block's first position
    row: jax.Array  # int32 [N, T] each whole prompt, pad after it (its last chunk writes it)
    prompt_len: jax.Array  # int32 [N]
    max_new: jax.Array  # int32 [N]
    key: jax.Array  # typed PRNG keys [N]: each request's row key
    slot: jax.Array  # int32 [N] each newcomer's slot (S: a padded row, dropped)
    last: jax.Array  # bool [N] the prompt's last chunk: the row starts decoding


def host_chunks(pieces: list, rows: int, width: int, buffer_len: int, pad: int,
                no_slot: int) -> PromptChunks:
    """PromptChunks from host values, padded to `rows`. pieces: (prompt, start, budget, key,
    slot, last) per newcomer."""
    tokens = np.full((rows, buffer_len), pad, np.int32)  # [N, T]
    block = np.full((rows, width), pad, np.int32)  # [N, W]
    start, lengths, budgets = (np.zeros((rows,), np.int32) for _ in range(3))  # [N] each
    lengths[:] = 1
    slots = np.full((rows,), no_slot, np.int32)  # [N]
    last = np.zeros((rows,), bool)  # [N]
    for i, (prompt, first, budget, _, slot, final) in enumerate(pieces):
        tokens[i, :len(prompt)] = prompt
        block[i] = tokens[i, first:first + width]
        start[i], lengths[i], budgets[i], slots[i], last[i] = (first, len(prompt), budget,
                                                               slot, final)
    keys = [piece[3] for piece in pieces]
    keys += [keys[0]] * (rows - len(keys))
    return PromptChunks(block=jax.device_put(block), start=jax.device_put(start),
                        row=jax.device_put(tokens), prompt_len=jax.device_put(lengths),
                        max_new=jax.device_put(budgets), key=jnp.stack(keys),
                        slot=jax.device_put(slots), last=jax.device_put(last))


@dataclasses.dataclass(frozen=True)
class PrefillChunkLoop:
    """A loop whose `start` prefills one chunk of each of N newcomers' prompts straight into
    their slots (jaxgen.runtime.compiled.start, the slots' state donated): their cache rows
    are read, extended by the chunk's positions and written back. A row whose chunk is its
    prompt's last (`last`) also gets its first new token, chosen as the plain loop's start
    does (jaxgen.loops.decode.choose_and_write), and its tokens, length, budget, key and
    flags written into its slot; the program returns the rows' first-token StepRecord
    [N, 1]. One program per (power-of-two) N and chunk width (`prefill_widths`) serves
    every prompt length.
    Static and hashable: `axes` are the cache's batch axes."""

    axes: tuple
    takes_layer_tuples = False  # the slots' rows are read and written in the engine's form

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """The slots' decode rows, so admission and decoding share one weight layout."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs: PromptChunks):
        rows = inputs.slot.shape[0]
        rows_cache = take_cache_rows(state.cache, inputs.slot, self.axes)  # the slots' rows
        rows_cache, logits = prefill_tokens(state.model, params, inputs.block, inputs.prompt_len,
                                            rows_cache, cfg.prefill_chunk_size,
                                            start=inputs.start)  # logits [N, V]
        state = state.replace(cache=scatter_cache_rows(state.cache, rows_cache, inputs.slot,
                                                       self.axes))
        newcomers = state.replace(
            tokens=inputs.row, length=inputs.prompt_len, prompt_len=inputs.prompt_len,
            max_new=inputs.max_new, done=jnp.zeros((rows,), bool),
            stop_reason=jnp.zeros((rows,), jnp.int32), cache=rows_cache, key=inputs.key,
            constraint=None if state.constraint is None else state.constraint.replace(
                state=jnp.full((rows,), state.constraint.automaton.initial, jnp.int32)))
        record = StepRecord.empty(rows, 1, state.model.vocab_size, cfg)
        newcomers, record = choose_and_write(cfg, newcomers, logits, record, 0)
        starting = jnp.where(inputs.last, inputs.slot, state.batch)  # [N]: others dropped
        return scatter_newcomers(state, newcomers, starting, self.axes,
                                 with_cache=False), record


__all__ = ["Admission", "DEFAULT_PREFILL_WIDTH", "PrefillChunkLoop",
           "PromptChunks", "admission_rows", "empty_slots", "host_admission", "host_chunks",
           "newcomer_state", "next_chunk", "prefill_widths", "scatter_newcomers",
           "slot_cache_axes"]
