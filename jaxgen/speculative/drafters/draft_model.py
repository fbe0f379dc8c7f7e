"""A draft model (`assistant_model`) as a drafter: its own KV cache, prefilled with the prompt.

The draft model honours the model contract (jaxgen.core.contracts.Model) and shares the target's vocabulary.
Its cache follows the target's rows; after a round that leaves a row with `length` tokens the
draft cache is valid for positions `< length - 2` (rolled back by setting its length), and the
next round's first draft forward re-feeds the row's last two tokens at `length - 2, length - 1`.
Two tokens are needed because when every draft is accepted the last draft was never fed to the
draft model; re-writing the other one is harmless (same token, same prefix).

Per round and row (K static, k_want[b] <= K dynamic):

    step 0      feed tokens[L-2 : L]   -> scores_0 -> d_0
    step i > 0  feed d_{i-1} at L+i-1  -> scores_i -> d_i        (lax.while_loop, stops when no
                                                                  row is still drafting)
    scores_i = the processor chain with the prefix ending at L+i (same config as the target);
    d_i = argmax(scores_i) (greedy) or a draw from softmax(scores_i) (sampling): q_i is exactly
    softmax(scores_i). A row stops drafting after k_want drafts, after drafting an EOS id, or
    (Hugging Face's `ConfidenceCriteria`) after a draft whose own probability
    softmax(scores_i)[d_i] is below `assistant_confidence_threshold` (the draft is kept).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxgen.cache.layout import cache_dtype
from jaxgen.core.contracts import DraftRequest
from jaxgen.core.step import prefill_tokens
from jaxgen.speculative.drafters.mtp_assistant import target_reading_model
from jaxgen.speculative.drafting import DraftBuffers, draft_step

UAD = ("an assistant with a different tokenizer needs universal assisted decoding: pass the "
       "target's `tokenizer=` and the assistant's `assistant_tokenizer=` (generate_text passes "
       "its own tokenizer)")


def split_assistant(assistant_model) -> tuple[Any, Any]:
    """(model, params) of an `assistant_model=` argument, checked against the model contract."""
    if not isinstance(assistant_model, (tuple, list)) or len(assistant_model) != 2:
        raise ValueError(f"`assistant_model` must be a (model, params) pair, e.g. "
                         f"assistant_model=(draft, draft_params); got "
                         f"{type(assistant_model).__name__}")
    model, params = assistant_model
    for attribute in ("vocab_size", "init_cache"):
        if not hasattr(model, attribute):
            raise ValueError(f"`assistant_model`'s model must honour the model contract "
                             f"(it has no `{attribute}`): got {type(model).__name__}")
    if not callable(model):
        raise ValueError(f"`assistant_model`'s model must be callable, got "
                         f"{type(model).__name__}")
    try:
        hash(model)
    except TypeError:
        raise ValueError("`assistant_model`'s model must be hashable (it is static for the "
                         "jit), e.g. a frozen dataclass") from None
    check_params = getattr(model, "check_params", None)
    if callable(check_params):
        check_params(params)
    return model, params


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """Static description of a draft-model drafter (hashable; a static jit argument)."""

    model: Any
    num_tokens: int  # K: static draft width
    prefill_chunk: int | None = None  # cfg.prefill_chunk_size, for the draft's own prefill
    scheduled: ClassVar[bool] = True  # the schedule's start value and the threshold apply
    reads: ClassVar[frozenset] = frozenset()

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for `assistant_model=(model, params)`, or None without one (or for an
        assistant another kind takes: a UniversalAssistant, an MTP drafter)."""
        if (assistant is None or hasattr(assistant, "bridge")
                or target_reading_model(assistant) is not None):
            return None  # none, a UniversalAssistant (speculative.uad) or an MTP drafter
        model, params = split_assistant(assistant)
        if int(model.vocab_size) != int(target_model.vocab_size):
            raise ValueError(f"the assistant's vocabulary ({model.vocab_size} tokens) differs "
                             f"from the target's ({target_model.vocab_size}): {UAD}")
        width = cfg.max_assistant_tokens or cfg.num_assistant_tokens
        return cls(model=model, num_tokens=int(width),
                   prefill_chunk=cfg.prefill_chunk_size), params

    def init(self, draft_params, state, target_params=None):
        """Prefills the draft cache with the prompt bucket; returns the cache."""
        dtype = cache_dtype(state.cache)
        cache = self.model.init_cache(state.batch, state.buffer_len, dtype)
        prompt = state.tokens[:, :state.prompt_bucket]  # [B, P]
        cache, _ = prefill_tokens(self.model, draft_params, prompt, state.prompt_len, cache,
                                  self.prefill_chunk)
        return cache

    def rollback(self, cache, length: jax.Array):
        """Keeps positions < length - 2 (re-fed by the next round)."""
        return cache.rollback(jnp.maximum(cache.length - jnp.maximum(length - 2, 0), 0))

    def propose(self, draft_params, cache, request: DraftRequest):
        """Drafts up to k_want[b] tokens per row; returns (Proposal, draft cache, the
        target's cache unchanged)."""
        model, state = self.model, request.state
        tokens, length = state.tokens, state.length  # [B, T], [B]
        batch, width = tokens.shape
        # step 0: the row's last two tokens (module docs), the logits of the last one
        pos0 = jnp.clip(length[:, None] - 2 + jnp.arange(2)[None, :], 0, width - 1)  # [B, 2]
        tok0 = jnp.take_along_axis(tokens, pos0, axis=1)  # [B, 2]
        out = model(draft_params, tok0, pos0, cache,
                    logits_index=jnp.ones((batch, 1), jnp.int32))
        buffers = DraftBuffers.empty(request, self.num_tokens, model.vocab_size)
        buffers = draft_step(request, buffers, 0, out.logits[:, 0])

        def cond(carry):
            i, buffers, _, _ = carry
            return (i < self.num_tokens) & jnp.any(buffers.active)

        def body(carry):
            i, buffers, cache, count = carry
            prev = buffers.drafts[:, i - 1][:, None]  # [B, 1]
            pos = (length + i - 1)[:, None]  # [B, 1]
            out = model(draft_params, prev, pos, cache)
            return i + 1, draft_step(request, buffers, i, out.logits[:, 0]), out.cache, count + 1

        carry = (jnp.int32(1), buffers, out.cache, jnp.int32(1))
        _, buffers, cache, count = jax.lax.while_loop(cond, body, carry)
        return buffers.proposal(count), cache, state.cache
