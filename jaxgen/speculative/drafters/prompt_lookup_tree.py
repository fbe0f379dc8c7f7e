"""Prompt lookup drafting token trees (`prompt_lookup_num_tokens=K` with
`assistant_tree_nodes=N`, `assistant_tree_width=c`; jaxgen.speculative.tree_loop verifies
them): several matches of the row's last n-gram at once, their continuations merged into a
trie. Deterministic: no draft distribution, no drafter forward.

Per round and row (L = the row's length, over its real tokens tokens[:L]):

    match      at every position p < L: the longest n <= max_ngram with tokens[p-n:p] ==
               tokens[L-n:L] (0 = none); a continuation starts at p (the query's match with
               itself, p = L, has nothing after it and never counts)
    continue   tokens[p : min(p+K, L)], cut before the first EOS id; empty ones never count
    rank       longest n first, then the earliest p: HF's own order (the chain drafter,
               jaxgen.speculative.drafters.prompt_lookup, takes the first), so c = 1 is the
               chain's proposal and every tree holds the chain's continuation
    pick       c times: the best-ranked continuation not already in the trie (equal to, or a
               prefix of, one picked before): c distinct continuations, fewer if the row
               has fewer
    trie       continuation i's k-th token is a node below its (k-1)-th; equal prefixes are
               one node (the first picked continuation holding it owns it), so siblings hold
               distinct tokens
    order      breadth first: by depth, then by the owning continuation's rank; the first N
               are kept (parents come before children, so a kept node's parent is kept)

N is capped at c * K (the most nodes c continuations make). Unused nodes are invalid; a row
with no match gets an all-invalid tree (its round emits one target token). The tree loop
further invalidates nodes past the row's budget and the cache.

Example (the last 2-gram "5 6" occurred twice: followed by 7 8, then by 7 9):
    >>> import jax.numpy as jnp
    >>> row = jnp.array([[5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6]])
    >>> tree = lookup_tree(row, jnp.array([12]), num_tokens=2, max_ngram=2, eos_ids=(),
    ...                    nodes=4, width=2)
    >>> tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist(), tree.valid.tolist()
    ([[7, 8, 9, 0]], [[-1, 0, 0, -1]], [[1, 2, 2, 1]], [[True, True, True, False]])
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxgen.config.program import eos_array
from jaxgen.core.contracts import DraftRequest
from jaxgen.speculative.tree import TokenTree

__all__ = [
    "PromptLookupTreeDrafter",
    "continuation_trie",
    "lookup_tree",
    "match_lengths",
    "pick_continuations",
]


def match_lengths(tokens: jax.Array, length: jax.Array, max_ngram: int) -> jax.Array:
    """int32 [B, T]: at every position p, the longest n <= max_ngram with tokens[p-n:p] ==
    the row's last n tokens, where a continuation can start (p < length); 0 = none."""
    batch, size = tokens.shape
    position = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, T]
    run = jnp.broadcast_to(position < length[:, None], (batch, size))  # [B, T]
    longest = jnp.zeros((batch, size), jnp.int32)  # [B, T]
    for back in range(1, int(max_ngram) + 1):
        if back >= size:
            break
        before = jnp.concatenate([jnp.full((batch, back), -1, tokens.dtype),
                                  tokens[:, :size - back]], axis=1)  # [B, T] tokens[p - back]
        query = jnp.take_along_axis(tokens, jnp.clip(length - back, 0, size - 1)[:, None],
                                    axis=1)  # [B, 1] tokens[L - back]
        run = run & (position >= back) & (before == query)  # [B, T]
        longest = longest + run.astype(jnp.int32)
    return longest


def pick_continuations(tokens: jax.Array, length: jax.Array, *, num_tokens: int,
                       max_ngram: int, eos_ids, width: int) -> tuple[jax.Array, jax.Array]:
    """Up to `width` distinct continuations per row, best ranked first (module docs):
    tokens int32 [B, c, K] and their lengths int32 [B, c] (0 = no continuation)."""
    size = tokens.shape[1]
    K = int(num_tokens)
    position = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, T]
    ahead = jnp.clip(position[0, :, None] + jnp.arange(K)[None, :], 0, size - 1)  # [T, K]
    follow = tokens[:, ahead]  # [B, T, K] the K tokens from every position
    count = jnp.clip(length[:, None] - position, 0, K)  # [B, T] inside the row
    if eos_ids:
        is_eos = jnp.isin(follow, eos_array(eos_ids))  # [B, T, K]
        first_eos = jnp.where(jnp.any(is_eos, axis=2), jnp.argmax(is_eos, axis=2), K)
        count = jnp.minimum(count, first_eos)
    longest = match_lengths(tokens, length, max_ngram)  # [B, T]
    rank = longest * size + (size - 1 - position)  # [B, T] longest n, then earliest p
    open_ = (longest > 0) & (count > 0)  # [B, T]
    inside = jnp.arange(K)[None, None, :] < count[:, :, None]  # [B, T, K]
    picked, lengths = [], []
    for _ in range(int(width)):
        score = jnp.where(open_, rank, -1)  # [B, T]
        best = jnp.argmax(score, axis=1)  # [B]
        found = jnp.max(score, axis=1) >= 0  # [B]
        chosen = jnp.take_along_axis(follow, best[:, None, None], axis=1)[:, 0]  # [B, K]
        chosen_len = jnp.where(found, jnp.take_along_axis(count, best[:, None], axis=1)[:, 0],
                               0)  # [B]
        agree = (follow == chosen[:, None, :]) | ~inside  # [B, T, K]
        covered = jnp.all(agree, axis=2) & (count <= chosen_len[:, None])  # [B, T]
        open_ = open_ & ~covered
        picked.append(chosen)
        lengths.append(chosen_len)
    return (jnp.stack(picked, axis=1).astype(jnp.int32),
            jnp.stack(lengths, axis=1).astype(jnp.int32))  # [B, c, K], [B, c]


def continuation_trie(paths: jax.Array, lengths: jax.Array, nodes: int) -> TokenTree:
    """The trie of continuations paths int32 [B, c, K] (lengths [B, c]), its nodes breadth
    first (by depth, then by continuation), the first `nodes` kept (module docs)."""
    batch, width, K = paths.shape
    present = jnp.arange(K)[None, None, :] < lengths[:, :, None]  # [B, c, K]
    agree = paths[:, :, None, :] == paths[:, None, :, :]  # [B, c, c', K]
    same = jnp.cumprod(agree.astype(jnp.int32), axis=3).astype(bool)  # [B, c, c', K]
    same = same & present[:, None, :, :]  # c' holds the same prefix of length k + 1
    owner = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, c, K] first to hold it
    own = present & (owner == jnp.arange(width)[None, :, None])  # [B, c, K] a trie node
    up_owner = jnp.concatenate([jnp.zeros((batch, width, 1), jnp.int32), owner[:, :, :-1]],
                               axis=2)  # [B, c, K] the owner of the parent prefix

    def by_depth(a):  # [B, c, K] -> [B, K*c], depth major
        return jnp.swapaxes(a, 1, 2).reshape(batch, K * width)

    flat_own = by_depth(own)  # [B, K*c]
    slot = jnp.cumsum(flat_own.astype(jnp.int32), axis=1) - 1  # [B, K*c] node index
    level = jnp.arange(K, dtype=jnp.int32)[None, :, None]  # [1, K, 1] depth - 1
    up_flat = ((level - 1) * width + jnp.swapaxes(up_owner, 1, 2)).reshape(batch, K * width)
    up_node = jnp.take_along_axis(slot, jnp.clip(up_flat, 0, K * width - 1), axis=1)  # [B, K*c]
    depth = jnp.broadcast_to(level + 1, (batch, K, width)).reshape(batch, K * width)
    up_node = jnp.where(depth == 1, -1, up_node)  # [B, K*c]
    dest = jnp.where(flat_own & (slot < nodes), slot, nodes)  # [B, K*c] past the end: dropped
    rows = jnp.arange(batch)[:, None]

    def place(values, fill, dtype):
        return jnp.full((batch, nodes), fill, dtype).at[rows, dest].set(
            values.astype(dtype), mode="drop")  # [B, N]

    return TokenTree(tokens=place(by_depth(paths), 0, jnp.int32),
                     parent=place(up_node, -1, jnp.int32), depth=place(depth, 1, jnp.int32),
                     valid=place(flat_own, False, jnp.bool_), forwards=jnp.int32(0))


def lookup_tree(tokens: jax.Array, length: jax.Array, *, num_tokens: int, max_ngram: int,
                eos_ids, nodes: int, width: int) -> TokenTree:
    """Every row's prompt-lookup tree of `nodes` nodes (module docs). tokens int32 [B, T],
    length int32 [B]; nodes <= width * num_tokens."""
    paths, lengths = pick_continuations(tokens, length, num_tokens=num_tokens,
                                        max_ngram=max_ngram, eos_ids=eos_ids, width=width)
    return continuation_trie(paths, lengths, nodes)


@dataclasses.dataclass(frozen=True)
class PromptLookupTreeDrafter:
    """Static description of the tree-drafting prompt lookup (hashable; a static jit arg)."""

    num_tokens: int  # K: the tree's depth (the most drafts one round can accept)
    max_ngram: int  # max_matching_ngram_size
    nodes: int  # N: nodes per tree (at most width * num_tokens)
    width: int  # c: continuations (matches) merged per row
    scheduled: ClassVar[bool] = False
    fallback: ClassVar[bool] = False  # every round verifies the whole tree
    reads: ClassVar[frozenset] = frozenset()

    @classmethod
    def build(cls, *, depth: int, max_ngram: int, nodes: int,
              width: int) -> PromptLookupTreeDrafter:
        return cls(num_tokens=int(depth), max_ngram=int(max_ngram),
                   nodes=min(int(nodes), int(width) * int(depth)), width=int(width))

    def init(self, draft_params, state, target_params=None):
        return None

    def rollback(self, draft_state, length):
        return draft_state

    def propose_tree(self, draft_params, request: DraftRequest) -> TokenTree:
        """Every row's trie of continuations from its own tokens (nothing is read or
        written besides them)."""
        state = request.state
        return lookup_tree(state.tokens, state.length, num_tokens=self.num_tokens,
                           max_ngram=self.max_ngram, eos_ids=request.cfg.eos_ids,
                           nodes=self.nodes, width=self.width)
