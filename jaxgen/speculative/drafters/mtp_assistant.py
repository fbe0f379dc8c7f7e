"""An MTP drafter as the assistant (`assistant_model=(drafter, drafter_params)`): a light model
that drafts from the target's own state (its last hidden state, input embeddings, LM head and
KV cache) and keeps no cache of its own. Gemma 4's assistant, for any Llama-family target.

Per round and row (L = the row's length; t = tokens[L-1] is its newest token, not yet in the
target's cache; h = the target's last hidden state that predicted t, which the loop hands over):

    step 0       logits_0, g_0 = drafter.step(t, h, position L-1)              -> d_0
    step i > 0   logits_i, g_i = drafter.step(d_{i-1}, g_{i-1}, position L-1)  -> d_i
    stop         as for a draft model (jaxgen.speculative.drafting): k_want drafts, an EOS
                 draft, or a draft below `assistant_confidence_threshold`

Each step attends to the target's cached K/V at positions < L-1 (exactly the verified ones)
and writes nothing, so there is no draft cache to prefill or roll back, and the verify forward
is the target's plain one. q_i is the processed distribution d_i was drawn from (draft_step),
so sampling stays lossless. A round of k drafts costs k drafter steps (its few layers on one
position plus the target's LM head) and one verify forward over k + 1 positions.

The drafter model (jaxgen.models.mtp_drafter.MtpDrafterModel) is recognised by its
`drafts_from_target` marker and provides:

    model.check_target(target_model)     ValueError naming both when the dimensions differ
    model.check_params(params)           ValueError naming the first mismatching parameter
    model.step(params, target, target_params, token [B], hidden [B, D], position [B], cache)
        -> (logits [B, V] float32, next hidden [B, D])

and optionally (Gemma 4's assistant, jaxgen/models/gemma4_assistant.py):

    model.init_draft_state(state) -> draft_state          after the prefill
    model.round_inputs(params, target, target_params, hidden, state, draft_state)
        -> (hidden for step 0, what `step` gets as its cache argument)   once per round
    model.after_propose(draft_state, state, k_row) -> draft_state       after the drafts

Example (generate with `assistant_model=assistant` drafts this way; tests/test_mtp_assistant.py):
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.models.mtp_drafter import MtpDrafterModel, MtpDrafterConfig
    >>> target, params = tiny_llama(num_layers=2)
    >>> config = MtpDrafterConfig.for_target(target.config, hidden_size=8,
    ...                                      intermediate_size=16, num_layers=1)
    >>> drafter = MtpDrafterModel(config)
    >>> assistant = (drafter, drafter.init_params(jax.random.key(1)))
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=8, num_assistant_tokens=3)
    >>> kind, draft_params = MtpAssistantDrafter.from_request(cfg, target, assistant)
    >>> kind.num_tokens, sorted(kind.reads), draft_params is assistant[1]
    (3, ['cache', 'hidden', 'params'], True)
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxgen.core.contracts import DraftRequest
from jaxgen.speculative.drafters.mtp_tree import MtpTreeDrafter
from jaxgen.speculative.drafting import DraftBuffers, draft_step

__all__ = ["MtpAssistantDrafter", "target_reading_model"]


def target_reading_model(assistant_model) -> Any:
    """The model of an `assistant_model=(model, params)` pair when it drafts from the target
    (`model.drafts_from_target`), else None (no assistant, or a stand-alone draft model)."""
    if not isinstance(assistant_model, (tuple, list)) or len(assistant_model) != 2:
        return None
    model = assistant_model[0]
    return model if getattr(model, "drafts_from_target", False) else None


def _other_ways_of_drafting(cfg) -> list[str]:
    """The config fields that ask for another drafter."""
    asked = [("prompt_lookup_num_tokens", cfg.prompt_lookup_num_tokens is not None),
             ("assistant_early_exit", cfg.assistant_early_exit is not None),
             ("use_mtp", bool(getattr(cfg, "use_mtp", False)))]
    return [f"`{name}`" for name, on in asked if on]


@dataclasses.dataclass(frozen=True)
class MtpAssistantDrafter:
    """Static description of the MTP-drafter assistant (hashable; a static jit argument)."""

    model: Any  # the drafter model (jaxgen.models.mtp_drafter.MtpDrafterModel)
    target: Any  # the target model it reads (jaxgen.models.Llama)
    num_tokens: int  # K: static draft width
    scheduled: ClassVar[bool] = True  # as a draft model: the schedule and threshold apply
    reads: ClassVar[frozenset] = frozenset({"params", "hidden", "cache"})

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for `assistant_model=(drafter, params)` with an MTP drafter model, or
        None for anything else. Checks the drafter against the target before compiling."""
        model = target_reading_model(assistant)
        if model is None:
            return None
        others = _other_ways_of_drafting(cfg)
        if others:
            raise ValueError(f"an MTP drafter `assistant_model` cannot be combined with "
                             f"{', '.join(others)}: pass only one way of drafting")
        if cfg.num_beams > 1:
            raise ValueError(f"an MTP drafter `assistant_model` does not support beam search "
                             f"(num_beams={cfg.num_beams}); use greedy or sampling (allowed: "
                             f"num_beams=1)")
        model.check_target(target_model)
        model.check_params(assistant[1])
        width = cfg.max_assistant_tokens or cfg.num_assistant_tokens
        return cls(model=model, target=target_model, num_tokens=int(width)), assistant[1]

    def tree_drafter(self, nodes: int, width: int) -> MtpTreeDrafter:
        """This assistant drafting token trees of `nodes` nodes, `width` children per expanded
        node and depth num_tokens (`assistant_tree_nodes` / `assistant_tree_width`); a
        ValueError for a model that drafts one query at a time with a round state of its own
        (Gemma 4's assistant)."""
        if not callable(getattr(self.model, "project", None)) or hasattr(self.model,
                                                                          "round_inputs"):
            raise ValueError(f"`assistant_tree_nodes` needs an MTP drafter that steps several "
                             f"nodes at once (jaxgen.models.mtp_drafter.MtpDrafterModel); "
                             f"{type(self.model).__name__} drafts chains only (allowed: "
                             f"assistant_tree_nodes=None)")
        return MtpTreeDrafter.build(self.model, self.target, depth=self.num_tokens,
                                    nodes=nodes, width=width)

    def init(self, draft_params, state, target_params=None):
        """No state of its own (everything it reads is the target's), unless the model keeps
        one (`model.init_draft_state(state)`: Gemma 4's assistant tracks which target keys
        transformers shows it)."""
        init = getattr(self.model, "init_draft_state", None)
        return None if init is None else init(state)

    def rollback(self, draft_state, length):
        return draft_state

    def propose(self, draft_params, draft_state, request: DraftRequest):
        """Drafts up to k_want[b] tokens per row from the target's hidden state and cache;
        returns (Proposal, None, the target's cache unchanged)."""
        state, K = request.state, self.num_tokens
        hidden, context = request.hidden, state.cache
        round_inputs = getattr(self.model, "round_inputs", None)
        if round_inputs is not None:  # the model's own view of the round (Gemma 4's assistant)
            hidden, context = round_inputs(draft_params, self.target, request.target_params,
                                           hidden, state, draft_state)
        length = state.length  # [B]
        position = length - 1  # [B] every step of the round queries here
        newest = jnp.take_along_axis(state.tokens, position[:, None], axis=1)[:, 0]  # [B]
        buffers = DraftBuffers.empty(request, K, self.target.vocab_size)

        def cond(carry):
            i, buffers, _, _ = carry
            return (i < K) & jnp.any(buffers.active)

        def body(carry):
            i, buffers, token, hidden = carry
            logits, hidden = self.model.step(draft_params, self.target, request.target_params,
                                             token, hidden, position, context)  # [B, V]
            buffers = draft_step(request, buffers, i, logits)
            return i + 1, buffers, buffers.drafts[:, i], hidden  # token [B], hidden [B, D]

        carry = (jnp.int32(0), buffers, newest, hidden)
        steps, buffers, _, _ = jax.lax.while_loop(cond, body, carry)
        proposal = buffers.proposal(steps)
        after = getattr(self.model, "after_propose", None)
        if after is not None:
            draft_state = after(draft_state, state,
                                jnp.minimum(proposal.k_row, request.k_want))
        return proposal, draft_state, state.cache
