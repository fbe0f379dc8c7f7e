"""One autoregressive draft step, shared by the drafters that draft token by token from
logits (a draft model, the target's early exit): process the logits like the target's,
choose a draft per row, record q, and decide which rows keep drafting.

Per step i and row b (active rows only; the others keep pad and stop counting):

    scores_i = the processor chain with the prefix ending at L + i (the target's config), so
               q_i = softmax(scores_i) is exactly the distribution d_i is drawn from
    d_i      = argmax(scores_i) (greedy) or a draw with the row's draft key folded with i
    stop     after k_want drafts, after an EOS id, or (HF's ConfidenceCriteria) after a draft
             whose own probability is below the threshold (the draft is kept)

Example:
    >>> import jax, jax.numpy as jnp
    >>> from types import SimpleNamespace
    >>> from jaxgen.config.generation import GenerationConfig
    >>> from jaxgen.core.extensions import NO_EXTENSIONS
    >>> rows = SimpleNamespace(tokens=jnp.array([[3, 0, 0]]), length=jnp.array([1]),
    ...                        prompt_len=jnp.array([1]), max_new=jnp.array([2]), pad_token_id=0)
    >>> request = SimpleNamespace(state=rows, cfg=GenerationConfig(), ext=NO_EXTENSIONS,
    ...                           k_want=jnp.array([2]), keys=jax.random.split(jax.random.key(0), 1),
    ...                           do_sample=False, keep_q=False, threshold=None)
    >>> buffers = DraftBuffers.empty(request, num_tokens=2, vocab=4)
    >>> buffers = draft_step(request, buffers, 0, jnp.array([[0.0, 0.0, 5.0, 0.0]]))
    >>> buffers.drafts.tolist(), buffers.k_row.tolist(), buffers.tokens.tolist()
    ([[2, 0]], [1], [[3, 2, 0]])
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.core.contracts import Proposal
from jaxgen.core.step import state_context, write_if_live
from jaxgen.logits.chain import process_logits
from jaxgen.logits.sampling import sample_rows


def pad_of(state):
    """The pad id of a DecodeState (`state.pad`: a program's dynamic int32 []) or of any rows
    object with a `pad_token_id`."""
    return getattr(state, "pad", state.pad_token_id)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftBuffers:
    """What a round of drafting builds up (a while-loop carry)."""

    tokens: jax.Array  # int32 [B, T] row tokens with the drafts so far written at L + i
    active: jax.Array  # bool [B] rows still drafting
    drafts: jax.Array  # int32 [B, K]
    q_scores: Optional[jax.Array]  # float32 [B, K, V] processed draft scores (keep_q)
    k_row: jax.Array  # int32 [B] drafts so far

    @classmethod
    def empty(cls, request, num_tokens: int, vocab: int) -> "DraftBuffers":
        state = request.state
        batch = state.tokens.shape[0]
        q = jnp.zeros((batch, num_tokens, vocab), jnp.float32) if request.keep_q else None
        return cls(tokens=state.tokens, active=request.k_want > 0,
                   drafts=jnp.full((batch, num_tokens), pad_of(state), jnp.int32),
                   q_scores=q, k_row=jnp.zeros((batch,), jnp.int32))

    def proposal(self, forwards) -> Proposal:
        return Proposal(drafts=self.drafts, q_scores=self.q_scores, k_row=self.k_row,
                        tokens=self.tokens, forwards=jnp.asarray(forwards, jnp.int32))


def draft_step(request, buffers: DraftBuffers, i, logits: jax.Array) -> DraftBuffers:
    """Chooses draft i (i may be traced; i >= K is a no-op) from raw logits [B, V]."""
    state, cfg = request.state, request.cfg
    length = state.length  # [B]
    here = state_context(state, tokens=buffers.tokens, length=length + i)
    scores = process_logits(cfg, logits, here, extra=request.ext.logits_processor)  # [B, V]
    if request.do_sample:
        d = sample_rows(scores, jax.vmap(lambda k: jax.random.fold_in(k, i))(request.keys))
    else:
        d = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # [B]
    width = buffers.drafts.shape[1]
    active = buffers.active & (i < width)  # [B]
    d = jnp.where(active, d, pad_of(state))  # [B]
    column = jnp.where(i < width, i, width)  # out of range -> dropped
    drafts = buffers.drafts.at[:, column].set(d, mode="drop")  # [B, K]
    q_scores = buffers.q_scores
    if q_scores is not None:
        q_scores = q_scores.at[:, column].set(scores, mode="drop")  # [B, K, V]
    tokens = write_if_live(buffers.tokens, length + i, d, active)  # [B, T]
    stop = stopping.hit_eos(d, cfg.eos_ids) | (i + 1 >= request.k_want)  # [B]
    if request.threshold is not None:
        probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
        stop |= jnp.take_along_axis(probs, d[:, None], axis=1)[:, 0] < request.threshold
    return DraftBuffers(tokens=tokens, active=active & ~stop, drafts=drafts, q_scores=q_scores,
                        k_row=buffers.k_row + active.astype(jnp.int32))
