"""The host side of a speculative engine: the assisted loop's carry over the slots, its
admission and chunk programs, and each request's acceptance counts.

`SpeculativeSlots` holds the slots' SpecCarry and a StepRecord of `max_len` new-token
columns per slot (the assisted loop writes each token's log-prob at its new-token number,
jaxgen.speculative.loop.emit_accepted). A chunk is `chunk_size` rounds of the loop
(jaxgen.runtime.compiled.advance with SpeculativeLoop, the chunked driver's entry); each
round every live row verifies its own drafts and accepts its own count. Admission is
jaxgen.serving.spec_admission.SpecAdmitLoop. Drafts, draft lengths and counts are dynamic:
requests coming and going compile nothing new.

Example:
    >>> import numpy as np
    >>> parts = (np.arange(12.0).reshape(2, 6), None, None)
    >>> since_sent(parts, [2, 0])[0].tolist()     # row 0 from its new token 2 on
    [[2.0, 3.0, 4.0, 5.0, 0.0, 0.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.output import StepRecord
from jaxgen.runtime import compiled
from jaxgen.serving.spec_admission import SpecAdmitLoop, carry_axes, row_counts, zeros_like_shapes
from jaxgen.speculative.drafters.draft_model import DraftModelDrafter
from jaxgen.speculative.drafters.mtp_layers import MtpDrafter
from jaxgen.speculative.drafters.prompt_lookup import PromptLookupDrafter
from jaxgen.speculative.loop import SpeculativeLoop

COUNTS = ("drafted", "accepted", "rounds")
SCHEDULED = (PromptLookupDrafter, DraftModelDrafter, MtpDrafter)  # the drafters tested here


def since_sent(parts: tuple, offsets) -> tuple:
    """Record parts ([S, N(, k)] each or None, indexed by new-token number) with row s
    shifted left by offsets[s] (the new tokens it already handed out), zeros after."""
    def shift(part):
        if part is None:
            return None
        part = np.asarray(part)
        out = np.zeros_like(part)
        for row, offset in enumerate(offsets):
            offset = int(offset)
            out[row, :part.shape[1] - offset] = part[row, offset:]
        return out
    return tuple(shift(p) for p in parts)


class SpeculativeSlots:
    """The assisted loop's carry over `slots` rows and the two programs that move it.

    drafter, inputs: jaxgen.api.plan.choose_drafter's (a drafter and its AssistInputs).
    state: the engine's empty slots; cfg_for(rows): the program config of `rows` rows;
    cache_axes: the target cache's batch axes (jaxgen.serving.admission.slot_cache_axes).
    """

    def __init__(self, model, params, cfg: GenerationConfig, state, drafter, inputs,
                 cfg_for, cache_axes: tuple, max_len: int):
        slots = state.batch
        axes, shapes = carry_axes(params, inputs, state, cfg_for, drafter, slots)
        self.drafter, self.inputs = drafter, inputs
        self.carry = zeros_like_shapes(shapes)
        self.record = StepRecord.empty(slots, max_len, model.vocab_size, cfg)
        self.admit_loop = SpecAdmitLoop(drafter=drafter, axes=cache_axes, spec_axes=axes)
        self.loop = SpeculativeLoop(drafter)
        self.slots = slots
        self._retired = dict.fromkeys(COUNTS, 0)  # counts of rows admission overwrote

    def admit(self, params, state, cfg, admission, slots: list, layout: str):
        """The slots' state with the admission's newcomers in (their carry rows too)."""
        real = [slot for slot in slots if slot < self.slots]
        if real:  # their old rows' counts before admission overwrites them
            for name, value in row_counts(self.carry.stats, real).items():
                self._retired[name] += value
        state, (self.carry, self.record) = compiled.start(
            params, state.replace(spec=(self.carry, self.record)), cfg,
            (admission, self.inputs), loop=self.admit_loop, layout=layout)
        return state

    def advance(self, params, state, cfg, rounds: int, layout: str):
        """`rounds` assisted rounds over every slot (fewer once every slot is done)."""
        state, (self.carry, self.record) = compiled.advance(
            params, state, (self.carry, self.record), jnp.int32(0), jnp.int32(rounds), cfg,
            self.inputs, loop=self.loop, layout=layout)
        return state

    def counts(self) -> dict:
        """Drafts proposed / accepted and verify rounds, summed over every request so far."""
        now = row_counts(self.carry.stats, list(range(self.slots)))
        return {name: self._retired[name] + now[name] for name in COUNTS}


def check_speculative(cfg: GenerationConfig, drafter, constraint) -> None:
    """ValueError for a speculative engine this module does not schedule."""
    if cfg.assistant_tree_nodes is not None:
        raise ValueError(f"jaxgen.serving.Engine: `assistant_tree_nodes`="
                         f"{cfg.assistant_tree_nodes} (token trees) is not supported by "
                         f"continuous batching; allowed: None (one draft per row a round)")
    if constraint is not None:
        raise ValueError("jaxgen.serving.Engine: a `constraint` cannot be combined with "
                         "speculative decoding (prompt_lookup_num_tokens / assistant_model); "
                         "build the Engine with one of them")
    if not isinstance(drafter, SCHEDULED):
        raise ValueError(f"jaxgen.serving.Engine: drafting with {type(drafter).__name__} is "
                         f"not supported by continuous batching; allowed: prompt_lookup_num_"
                         f"tokens, assistant_model=(model, params) with the target's "
                         f"vocabulary, use_mtp=True; use jaxgen.generate for the others")


__all__ = ["COUNTS", "SpeculativeSlots", "check_speculative", "since_sent"]
