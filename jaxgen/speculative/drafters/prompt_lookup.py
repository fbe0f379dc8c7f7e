"""Prompt lookup drafting (Hugging Face's `PromptLookupCandidateGenerator`), vectorized.

For each row, over its real tokens (prompt + generated, `tokens[b, :length[b]]`):

    for n = max_matching_ngram_size .. 1 (largest first):
        the row's last n tokens are the query n-gram;
        the earliest window start s with tokens[s:s+n] == query and s + n < length wins
        (the trivial match of the query with itself has nothing after it and never wins);
    drafts = tokens[s+n : min(s+n+K, length)], cut before the first EOS id;
    no match (or an empty continuation) -> no drafts: the round emits one target token.

A larger n always takes precedence over a smaller one, even if the smaller one matches
earlier (HF breaks out of the n loop at the first n with a valid match). Like HF, a
continuation that an EOS cuts to nothing is not replaced by a later match.

Draft count per row: K (HF), or adapted per row by `num_assistant_tokens_schedule`
"heuristic" / "heuristic_transient" (a jaxgen extension; greedy outputs are the same either
way, sampling stays lossless).

Not reproduced: HF's extra pass that runs the logits processors on dummy logits to shorten a
continuation at tokens the processors forbid. It only changes which drafts are proposed;
forbidden drafts are rejected by verification instead, so outputs are the same.

Example:
    >>> import jax.numpy as jnp
    >>> tokens = jnp.array([[5, 6, 7, 8, 5, 6, 0, 0]]); length = jnp.array([6])
    >>> drafts, k = lookup_drafts(tokens, length, num_tokens=3, max_ngram=2, eos_ids=(),
    ...                           k_cap=jnp.array([3]))
    >>> drafts.tolist(), k.tolist()      # "5 6" occurred at 0: propose what followed it
    ([[7, 8, 5]], [3])
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxgen.config.program import eos_array
from jaxgen.core.contracts import DraftRequest, Proposal
from jaxgen.speculative.drafters.prompt_lookup_tree import PromptLookupTreeDrafter

DEFAULT_MAX_NGRAM = 2  # HF: max_matching_ngram_size or 2


def lookup_drafts(tokens: jax.Array, length: jax.Array, *, num_tokens: int, max_ngram: int,
                  eos_ids: tuple[int, ...], k_cap: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Drafts int32 [B, K] and their count k_row int32 [B] (0 = nothing matched).

    tokens int32 [B, T]; length int32 [B]; num_tokens K (static); max_ngram N (static);
    k_cap int32 [B]: most drafts a row may take (its remaining budget - 1).
    """
    batch, width = tokens.shape
    start = jnp.zeros((batch,), jnp.int32)  # [B] index of the first drafted token
    found = jnp.zeros((batch,), bool)  # [B]
    for n in range(int(max_ngram), 0, -1):
        if n >= width:
            continue
        query_index = jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, width - 1)
        query = jnp.take_along_axis(tokens, query_index, axis=1)  # [B, n]
        windows = width - n + 1
        match = (jnp.arange(windows)[None, :] + n) < length[:, None]  # [B, W] something follows
        for j in range(n):
            match &= tokens[:, j:j + windows] == query[:, j:j + 1]  # [B, W]
        has = jnp.any(match, axis=1)  # [B]
        first = jnp.argmax(match, axis=1).astype(jnp.int32)  # [B] earliest window
        start = jnp.where(has & ~found, first + n, start)
        found |= has
    index = start[:, None] + jnp.arange(num_tokens)[None, :]  # [B, K]
    drafts = jnp.take_along_axis(tokens, jnp.clip(index, 0, width - 1), axis=1)  # [B, K]
    count = jnp.clip(length - start, 0, num_tokens)  # [B] continuation stays inside the row
    if eos_ids:
        is_eos = jnp.isin(drafts, eos_array(eos_ids))  # [B, K]
        first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), num_tokens)
        count = jnp.minimum(count, first_eos)
    k_row = jnp.where(found, jnp.minimum(count, k_cap), 0).astype(jnp.int32)  # [B]
    return drafts.astype(jnp.int32), k_row


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
    """Static description of the prompt-lookup drafter (hashable; a static jit argument).

    Drafts start at K every call and no confidence threshold applies (as in HF). Unlike HF,
    num_assistant_tokens_schedule="heuristic" / "heuristic_transient" adapts each row's
    draft count (+2 after a fully accepted round, -1 otherwise): rows whose lookups keep
    failing stop paying for wide verify forwards (see jaxgen.speculative.loop).
    """

    num_tokens: int  # K = prompt_lookup_num_tokens
    max_ngram: int  # max_matching_ngram_size (HF default 2)
    scheduled: ClassVar[bool] = False
    reads: ClassVar[frozenset] = frozenset()

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for a config with `prompt_lookup_num_tokens`, or None."""
        if cfg.prompt_lookup_num_tokens is None:
            return None
        ngram = cfg.max_matching_ngram_size or DEFAULT_MAX_NGRAM
        return cls(num_tokens=int(cfg.prompt_lookup_num_tokens), max_ngram=int(ngram)), None

    def tree_drafter(self, nodes: int, width: int) -> PromptLookupTreeDrafter:
        """This lookup drafting token trees (`assistant_tree_nodes` / `assistant_tree_width`):
        up to `width` matches' continuations merged into a trie of `nodes` nodes, depth
        num_tokens (jaxgen.speculative.drafters.prompt_lookup_tree)."""
        return PromptLookupTreeDrafter.build(depth=self.num_tokens, max_ngram=self.max_ngram,
                                             nodes=nodes, width=width)

    def init(self, draft_params, state, target_params=None):
        return None

    def rollback(self, draft_state, length):
        return draft_state

    def propose(self, draft_params, draft_state, request: DraftRequest):
        state = request.state
        drafts, k_row = lookup_drafts(state.tokens, state.length, num_tokens=self.num_tokens,
                                      max_ngram=self.max_ngram, eos_ids=request.cfg.eos_ids,
                                      k_cap=request.k_want)
        batch = state.tokens.shape[0]
        index = state.length[:, None] + jnp.arange(self.num_tokens)[None, :]  # [B, K]
        rows = jnp.arange(batch)[:, None]
        work = state.tokens.at[rows, index].set(drafts, mode="drop")  # [B, T]
        proposal = Proposal(drafts=drafts, q_scores=None, k_row=k_row, tokens=work,
                            forwards=jnp.int32(0))
        return proposal, draft_state, state.cache
