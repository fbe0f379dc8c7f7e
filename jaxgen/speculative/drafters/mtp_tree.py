"""The MTP drafter assistant drafting token trees (`assistant_tree_nodes=N`,
`assistant_tree_width=c`; jaxgen.speculative.tree_loop verifies them).

Per round and row (L = the row's length, t = tokens[L-1], h = the target's hidden state that
predicted t; jaxgen.speculative.drafters.mtp_assistant drafts a chain from the same step):

    depth 1      logits, g = drafter.project(t, h at position L-1)       the root's top-c
    depth d > 1  the c best depth d-1 nodes (by cumulative log q) step at once, each from
                 its own token and its parent's g: one `project` call of c queries per row
    tree         the N best of the c + (D-1) c^2 candidates (jaxgen.speculative.tree_growth)

D = the draft width K (max_assistant_tokens or num_assistant_tokens) is the tree's depth; a
round costs D drafter calls and one verify forward over N + 1 positions. q is the raw draft
distribution: it only ranks candidates, and the nodes are chosen deterministically, so
sampled verification treats each as a point mass (jaxgen.speculative.tree) and needs no q;
both greedy and sampled verification are exact whatever q is.

Example:
    >>> import jax
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.models.mtp_drafter import MtpDrafterModel, MtpDrafterConfig
    >>> target, params = tiny_llama(num_layers=2)
    >>> model = MtpDrafterModel(MtpDrafterConfig.for_target(
    ...     target.config, hidden_size=8, intermediate_size=16, num_layers=1))
    >>> drafter = MtpTreeDrafter.build(model, target, depth=4, nodes=64, width=2)
    >>> drafter.nodes, drafter.num_tokens                 # capped at 2 + 3 * 2 * 2 candidates
    (14, 4)
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxgen.core.contracts import DraftRequest
from jaxgen.speculative.tree import TokenTree
from jaxgen.speculative.tree_growth import candidate_count, grow_tree

__all__ = ["MtpTreeDrafter"]


@dataclasses.dataclass(frozen=True)
class MtpTreeDrafter:
    """Static description of the tree-drafting MTP assistant (hashable; a static jit arg)."""

    model: Any  # jaxgen.models.mtp_drafter.MtpDrafterModel (has `project`)
    target: Any  # the Llama-family target it reads
    num_tokens: int  # D: the tree's depth (the most drafts one round can accept)
    nodes: int  # N: nodes per tree (at most candidate_count(width, depth))
    width: int  # c: children per expanded node, nodes expanded per depth
    scheduled: ClassVar[bool] = False
    fallback: ClassVar[bool] = False  # every round verifies the whole tree
    reads: ClassVar[frozenset] = frozenset({"params", "hidden", "cache"})

    @classmethod
    def build(cls, model, target, *, depth: int, nodes: int, width: int) -> "MtpTreeDrafter":
        return cls(model=model, target=target, num_tokens=int(depth),
                   nodes=min(int(nodes), candidate_count(int(width), int(depth))),
                   width=int(width))

    def init(self, draft_params, state, target_params=None):
        return None

    def rollback(self, draft_state, length):
        return draft_state

    def propose_tree(self, draft_params, request: DraftRequest) -> TokenTree:
        """Every row's tree below its newest token, from the target's hidden state and cache
        (read only; nothing is written)."""
        state = request.state
        position = state.length - 1  # [B] every step of the round queries here
        newest = jnp.take_along_axis(state.tokens, position[:, None], axis=1)[:, 0]  # [B]
        hidden = request.hidden  # [B, Dt]

        def expand(tokens, states):  # tokens [B, F], states [B, F, Dt]
            where = jnp.broadcast_to(position[:, None], tokens.shape)  # [B, F]
            g = self.model.project(draft_params, self.target, request.target_params, tokens,
                                   states, where, state.cache).astype(hidden.dtype)  # [B,F,Dt]
            if self.model.config.draft_vocab:
                logits = self.model.vocab_logits(draft_params, self.target,
                                                 request.target_params, g)  # [B, F, V]
            else:
                logits = self.target.head(request.target_params, g)  # [B, F, V]
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), g

        return grow_tree(expand, newest, hidden[:, None], nodes=self.nodes, width=self.width,
                         depth=self.num_tokens)
