"""A draft model (`assistant_model`) as a drafter: its own KV cache, prefilled with the prompt.

The draft model honours the model contract (DESIGN s.2) and shares the target's vocabulary.
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
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.speculative.positions import base_context, context_at
from jaxgen.processors import process_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """One round of drafts: drafts int32 [B, K], q scores [B, K, V] or None, k_row int32 [B]."""

    drafts: jax.Array
    q_scores: jax.Array | None
    k_row: jax.Array
    tokens: jax.Array  # int32 [B, T] the row tokens with the drafts written at L..L+K-1
    forwards: jax.Array  # int32 scalar: draft forwards run this round


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """Static description of a draft-model drafter (hashable; a static jit argument)."""

    model: Any
    num_tokens: int  # K: static draft width
    scheduled = True  # num_assistant_tokens_schedule and the confidence threshold apply

    def init(self, draft_params, state):
        """Prefills the draft cache with the prompt bucket; returns the cache."""
        model = self.model
        dtype = getattr(getattr(state.cache, "k", None), "dtype", jnp.float32)
        cache = model.init_cache(state.batch, state.buffer_len, dtype)
        bucket = state.prompt_bucket
        prompt = state.tokens[:, :bucket]  # [B, P]
        positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), prompt.shape)
        out = model(draft_params, prompt, positions, cache,
                    logits_index=(state.prompt_len - 1)[:, None])
        return out.cache.with_length(state.prompt_len)

    def rollback(self, cache, length: jax.Array):
        """Keeps positions < length - 2 (re-fed by the next round)."""
        return cache.rollback(jnp.maximum(cache.length - jnp.maximum(length - 2, 0), 0))

    def propose(self, draft_params, cache, cfg, ext, state, k_want: jax.Array, keys,
                *, do_sample: bool, keep_q: bool, threshold) -> tuple[Proposal, Any]:
        """Drafts up to k_want[b] tokens per row. keys: per-row PRNG keys [B] for this round."""
        model = self.model
        K = self.num_tokens
        tokens, length = state.tokens, state.length  # [B, T], [B]
        batch, width = tokens.shape
        rows = jnp.arange(batch)
        vocab = model.vocab_size
        eos = cfg.eos_ids
        ctx = base_context(tokens, length, state)

        def choose(i, logits, work, active, drafts, q_all, k_row):
            here = context_at(dataclasses.replace(ctx, tokens=work), length + i)
            scores = process_logits(cfg, logits, here, extra=ext.logits_processor)  # [B, V]
            if do_sample:
                step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)  # [B]
                d = jax.vmap(jax.random.categorical)(step_keys, scores).astype(jnp.int32)
            else:
                d = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # [B]
            d = jnp.where(active, d, state.pad_token_id)
            drafts = drafts.at[:, i].set(d)
            if q_all is not None:
                q_all = q_all.at[:, i].set(scores)
            work = work.at[rows, length + i].set(
                jnp.where(active, d, work[rows, jnp.minimum(length + i, width - 1)]), mode="drop")
            k_row = k_row + active.astype(jnp.int32)
            stop = stopping.hit_eos(d, eos) | (i + 1 >= k_want)  # [B]
            if threshold is not None:
                probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
                conf = jnp.take_along_axis(probs, d[:, None], axis=1)[:, 0]  # [B]
                stop |= conf < threshold
            return work, active & ~stop, drafts, q_all, k_row

        # step 0: two tokens, the logits of the last one
        pos0 = jnp.clip(length[:, None] - 2 + jnp.arange(2)[None, :], 0, width - 1)  # [B, 2]
        tok0 = jnp.take_along_axis(tokens, pos0, axis=1)  # [B, 2]
        out = model(draft_params, tok0, pos0, cache,
                    logits_index=jnp.ones((batch, 1), jnp.int32))
        drafts = jnp.full((batch, K), state.pad_token_id, jnp.int32)  # [B, K]
        q_all = jnp.zeros((batch, K, vocab), jnp.float32) if keep_q else None  # [B, K, V]
        active = k_want > 0  # [B]
        k_row = jnp.zeros((batch,), jnp.int32)
        work, active, drafts, q_all, k_row = choose(0, out.logits[:, 0], tokens, active, drafts,
                                                    q_all, k_row)

        def cond(carry):
            i, _, active, *_ = carry
            return (i < K) & jnp.any(active)

        def body(carry):
            i, work, active, drafts, q_all, k_row, cache, count = carry
            prev = drafts[:, i - 1][:, None]  # [B, 1]
            pos = (length + i - 1)[:, None]  # [B, 1]
            out = model(draft_params, prev, pos, cache)
            work, active, drafts, q_all, k_row = choose(i, out.logits[:, 0], work, active,
                                                        drafts, q_all, k_row)
            return i + 1, work, active, drafts, q_all, k_row, out.cache, count + 1

        carry = (jnp.int32(1), work, active, drafts, q_all, k_row, out.cache, jnp.int32(1))
        _, work, _, drafts, q_all, k_row, cache, count = jax.lax.while_loop(cond, body, carry)
        proposal = Proposal(drafts=drafts, q_scores=q_all, k_row=k_row, tokens=work,
                            forwards=count)
        return proposal, cache
