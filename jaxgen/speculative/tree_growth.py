"""Growing a token tree per row from a drafter's step, by cumulative draft probability
(EAGLE-2 style), with static shapes.

`expand(tokens [B, F], states) -> (log-probabilities [B, F, V], next states)` runs the
drafter one step for F nodes per row at once (`states`: a PyTree with leading [B, F] axes,
what each node's step reads; its result is what the node's children's steps read). With
width c, depth D and node budget N:

    depth 1      the root's top-c tokens                          c candidates
    depth d > 1  each of the c best depth d-1 candidates (the frontier) expands to its
                 top-c tokens: score = parent's score + log q     c*c candidates
    tree         the N best candidates by score, parents first

A child never scores above its parent (log q <= 0) and `lax.top_k` breaks ties towards the
lower index (parents are listed before their children), so the N best always hold each
node's parent: every row's tree is connected. D drafter steps build it (1, then c nodes
per step); N is capped at c + (D-1) c^2, the candidates there are.

Example (a drafter whose next token is always (t + 1) % 4 with probability 0.7, else
(t + 2) % 4; the root token is 0):
    >>> import jax.numpy as jnp
    >>> def expand(tokens, states):
    ...     probs = 0.7 * jax.nn.one_hot((tokens + 1) % 4, 4) + 0.3 * jax.nn.one_hot(
    ...         (tokens + 2) % 4, 4)
    ...     return jnp.log(probs), states
    >>> tree = grow_tree(expand, jnp.array([0]), jnp.zeros((1, 1)), nodes=4, width=2, depth=2)
    >>> tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist()  # by score: .7 .49 .3 .21
    ([[1, 2, 2, 3]], [[-1, 0, -1, 0]], [[1, 2, 1, 2]])
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.speculative.tree import TokenTree


def candidate_count(width: int, depth: int) -> int:
    """How many candidates a tree of this width and depth chooses its nodes from."""
    return width + (depth - 1) * width * width


def grow_tree(expand, root_token: jax.Array, root_state, *, nodes: int, width: int,
              depth: int) -> TokenTree:
    """The tree (module docs) below each row's root_token int32 [B]; root_state: the root
    step's states, leading axes [B, 1]. Returns a TokenTree of min(nodes, candidates) nodes
    with `valid` False only where a parent was not found (never, by construction) and
    `forwards` = depth."""
    logp, state = expand(root_token[:, None].astype(jnp.int32), root_state)  # [B, 1, V]
    score, token = jax.lax.top_k(logp[:, 0].astype(jnp.float32), width)  # [B, c] each
    batch = token.shape[0]
    scores, tokens = [score], [token.astype(jnp.int32)]
    parents = [jnp.full((batch, width), -1, jnp.int32)]
    depths = [jnp.ones((batch, width), jnp.int32)]
    frontier_ids = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    frontier_token, frontier_score = token.astype(jnp.int32), score  # [B, c] each
    frontier_state = jax.tree_util.tree_map(
        lambda a: jnp.repeat(a, width, axis=1), state)  # [B, c, ...] the root step's result
    offset = width
    for level in range(2, depth + 1):
        logp, state = expand(frontier_token, frontier_state)  # [B, c, V], [B, c, ...]
        top, child = jax.lax.top_k(logp.astype(jnp.float32), width)  # [B, c, c] each
        score = (frontier_score[:, :, None] + top).reshape(batch, width * width)  # [B, c*c]
        child = child.reshape(batch, width * width).astype(jnp.int32)  # [B, c*c]
        parent = jnp.repeat(frontier_ids, width, axis=1)  # [B, c*c]
        scores.append(score)
        tokens.append(child)
        parents.append(parent)
        depths.append(jnp.full((batch, width * width), level, jnp.int32))
        frontier_score, pick = jax.lax.top_k(score, width)  # [B, c] the next frontier
        frontier_ids = offset + pick.astype(jnp.int32)  # [B, c]
        frontier_token = jnp.take_along_axis(child, pick, axis=1)  # [B, c]
        frontier_state = jax.tree_util.tree_map(
            lambda a, p=pick: jnp.take_along_axis(
                a, (p // width).reshape(p.shape + (1,) * (a.ndim - 2)), axis=1),
            state)  # [B, c, ...] the step result of each new frontier node's parent
        offset += width * width
    all_scores = jnp.concatenate(scores, axis=1)  # [B, C]
    count = min(nodes, all_scores.shape[1])
    _, chosen = jax.lax.top_k(all_scores, count)  # [B, N] best first: parents first

    def pick(parts):  # per-depth candidate arrays -> the chosen nodes' entries [B, N]
        return jnp.take_along_axis(jnp.concatenate(parts, axis=1), chosen, axis=1)

    parent_candidate = pick(parents)  # [B, N] a candidate id, -1 = the root
    same = chosen[:, None, :] == parent_candidate[:, :, None]  # [B, N, N]
    found = jnp.any(same, axis=2)  # [B, N]
    parent = jnp.where(parent_candidate < 0, -1,
                       jnp.where(found, jnp.argmax(same, axis=2), -1)).astype(jnp.int32)
    return TokenTree(tokens=pick(tokens), parent=parent, depth=pick(depths),
                     valid=(parent_candidate < 0) | found, forwards=jnp.int32(depth))
