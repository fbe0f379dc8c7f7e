"""Admission for a speculative engine: the newcomers' assisted start, their carry rows scattered.

A speculative engine runs the assisted loop (jaxgen.speculative.loop.SpeculativeLoop) over
its slots: besides the DecodeState it carries the loop's `SpecCarry` (the drafter's state,
e.g. a draft model's KV cache, each row's draft length, acceptance statistics and fallback
estimates, the pending drafts) and a StepRecord indexed by each row's new-token number. The
admission program (`SpecAdmitLoop.start`) prefills the newcomers apart and runs the loop's
own start on them (jaxgen.speculative.loop.speculative_start: the first token, the drafter's
init, the first drafts), then writes their state rows, cache rows, carry rows and record rows
into their slots. Each carry leaf's row axis is found once by comparing the carry's shapes
for two newcomer counts (`carry_axes`, no allocation); leaves without rows (call-wide
counters) keep the slots' values.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.api.plan import choose_drafter
    >>> from jaxgen.serving.admission import empty_slots
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3, prompt_lookup_num_tokens=2)
    >>> drafter, inputs = choose_drafter(cfg, model, None, None)
    >>> slots = empty_slots(model, cfg, slots=2, max_len=32)
    >>> axes, shapes = carry_axes(params, inputs, slots, lambda rows: cfg, drafter, 2)
    >>> shapes.k_sched.shape, axes[jax.tree_util.tree_leaves(shapes).index(shapes.k_sched)]
    ((2,), 0)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.output import StepRecord
from jaxgen.core.state import MIN_PROMPT_BUCKET, DecodeState, row_keys
from jaxgen.serving.admission import Admission, newcomer_state, scatter_newcomers
from jaxgen.speculative.loop import speculative_start


def _start_carry(params, inputs, state: DecodeState, cfg: GenerationConfig, drafter,
                 admission: Admission):
    """(newcomers' state, SpecCarry, StepRecord) of the assisted start over `admission`."""
    return speculative_start(params, newcomer_state(state, admission), cfg, drafter, inputs)


def _dummy_admission(rows: int, bucket: int = MIN_PROMPT_BUCKET) -> Admission:
    ones = jnp.ones((rows,), jnp.int32)  # [N]
    return Admission(tokens=jnp.zeros((rows, bucket), jnp.int32), prompt_len=ones,
                     max_new=ones, key=row_keys(jax.random.key(0), rows), slot=ones)


def carry_axes(params, inputs, state: DecodeState, cfg_for, drafter, slots: int):
    """(each SpecCarry leaf's row axis or None, in tree_leaves order; the carry's shapes for
    `slots` rows). cfg_for(rows): the program config of `rows` newcomers."""
    def shapes(rows):
        def build(params, inputs):
            return _start_carry(params, inputs, state, cfg_for(rows), drafter,
                                _dummy_admission(rows))[1]
        return jax.eval_shape(build, params, inputs)

    two, three = (jax.tree_util.tree_leaves(shapes(n)) for n in (2, 3))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return diff[0] if diff else None

    return tuple(axis(a, b) for a, b in zip(two, three)), shapes(slots)


def zeros_like_shapes(shapes):
    """Arrays of zeros shaped as `shapes` (a PyTree of ShapeDtypeStruct): the carry of slots
    nobody was admitted to (done rows; admission overwrites every row leaf)."""
    def zero(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jnp.zeros(leaf.shape + (2,), jnp.uint32))
        return jnp.zeros(leaf.shape, leaf.dtype)
    return jax.tree_util.tree_map(zero, shapes)


def _scatter_tree(tree, rows, slot: jax.Array, axes: tuple):
    """`tree` with row i of `rows` written at slot[i] on each leaf's axis (None: kept)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    new = jax.tree_util.tree_leaves(rows)
    if len(leaves) != len(new) or len(leaves) != len(axes):
        raise ValueError(f"the speculative carry changed structure: {len(leaves)} slot leaves, "
                         f"{len(new)} newcomer leaves, {len(axes)} axes")

    def put(old, row, axis):
        if axis is None:
            return old
        index = (slice(None),) * axis + (slot,)
        return old.at[index].set(row.astype(old.dtype), mode="drop")
    return jax.tree_util.tree_unflatten(treedef, [put(o, r, a) for o, r, a in
                                                  zip(leaves, new, axes)])


def _widened(record: StepRecord, steps: int) -> StepRecord:
    """The newcomers' record padded to `steps` new-token columns, without prompt log-probs."""
    def pad(a):
        if a is None:
            return None
        widths = [(0, 0)] * a.ndim
        widths[1] = (0, steps - a.shape[1])
        return jnp.pad(a, widths)
    return dataclasses.replace(record, token_logprobs=pad(record.token_logprobs),
                               scores=pad(record.scores), logits=pad(record.logits),
                               top_ids=pad(record.top_ids), top_logprobs=pad(record.top_logprobs),
                               prompt_logprobs=None)


@dataclasses.dataclass(frozen=True)
class SpecAdmitLoop:
    """Admits newcomers into a speculative engine's slots (run through
    jaxgen.runtime.compiled.start). The slots' (SpecCarry, StepRecord) ride in `state.spec`,
    so they are donated with the state. Static and hashable."""

    drafter: Any
    axes: tuple  # the cache leaves' batch axes (slot_cache_axes)
    spec_axes: tuple  # the SpecCarry leaves' row axes (carry_axes)
    takes_layer_tuples = False  # the caches are scattered stacked

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """The slots' decode rows, so admission and decoding share one weight layout."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs):
        """inputs: (Admission, AssistInputs). Returns (the slots' state with the newcomers in
        their slots and spec=None, (the slots' SpecCarry, their StepRecord))."""
        admission, assist = inputs
        carry, record = state.spec
        slots = state.replace(spec=None)
        newcomers, new_carry, new_record = _start_carry(params, assist, slots, cfg,
                                                        self.drafter, admission)
        slot = admission.slot
        new_record = _widened(new_record, record.token_logprobs.shape[1])
        record_axes = tuple(0 for _ in jax.tree_util.tree_leaves(record))
        return scatter_newcomers(slots, newcomers, slot, self.axes), (
            _scatter_tree(carry, new_carry, slot, self.spec_axes),
            _scatter_tree(record, new_record, slot, record_axes))


def row_counts(stats, slot_rows: list) -> dict:
    """Host ints: drafts proposed / accepted and verify rounds of the given slots' rows
    (SpeculativeStats on the device)."""
    drafted, accepted, rounds = (np.asarray(a) for a in jax.device_get(
        (stats.drafted, stats.accepted, stats.rounds)))
    return {"drafted": int(drafted[slot_rows].sum()), "accepted": int(accepted[slot_rows].sum()),
            "rounds": int(rounds[slot_rows].sum())}


__all__ = ["SpecAdmitLoop", "carry_axes", "row_counts", "zeros_like_shapes"]
