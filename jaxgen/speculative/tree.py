"""Token trees as arrays: the ancestor mask a tree verify forward attends with, each node's
path, and greedy and sampled path acceptance.

A round's tree holds N draft nodes per row below the root (the row's newest verified token,
tokens[L-1]); nodes come in an order where every parent precedes its children:

    tokens  int32 [B, N]   node i's token
    parent  int32 [B, N]   its parent node, -1 = the root
    depth   int32 [B, N]   1 + its parent's depth (the root's depth is 0)
    valid   bool  [B, N]   whether it may be accepted (inside the row's budget and cache)

The verify forward runs the root and the nodes at the contiguous slots L-1 + s (slot 0 = the
root, slot i + 1 = node i) with the ancestor mask [B, N+1, N+1] (slot s sees slot t iff t is s
or an ancestor of s) and RoPE positions L-1 + depth. Greedy acceptance (one path per row:
siblings hold distinct tokens, so at most one node per depth matches):

    target[s]   = argmax of the processed scores at slot s        [B, N+1]
    match_i     = valid_i and tokens_i == target[parent slot of i]
    accepted_i  = match_i and accepted(parent of i)                (the root is accepted)
    n           = the deepest accepted depth;  path[d] = the accepted slot at depth d
    fix         = target[path[n]]           (the target's next token after the path)

The emitted tokens (path tokens, then fix) are exactly plain greedy's, as for a chain.

Sampled acceptance (`accept_sampled_path`; each node is a point mass, no draft q is needed):
walk down from the root; at slot s with r = p_s (the processed target distribution there)
test s's valid children in node order: accept child c with probability r(c) / sum(r) (then
move to c's slot with a fresh r = p there); a rejected child's token is zeroed in r. When
every child is rejected (or there is none) the fix is drawn from r. Lossless: testing
candidates one by one ("is the draw c? else is it c'? ...") against the renormalised
remainder is a categorical draw from p_s split into sequential checks, so the token emitted
at every depth follows p given its prefix exactly, whatever the tree holds (its nodes depend
only on the row's past; each check uses its own uniform). One pass over the nodes in order
does the walk, since a node's children come after it.

Example (one row: the root's children 5 and 7, node 2 = 9 below node 1 = 7):
    >>> import jax.numpy as jnp
    >>> tree = TokenTree(tokens=jnp.array([[5, 7, 9]]), parent=jnp.array([[-1, -1, 1]]),
    ...                  depth=jnp.array([[1, 1, 2]]), valid=jnp.ones((1, 3), bool))
    >>> ancestor_mask(tree.parent)[0].astype(int).tolist()   # slots: root, 5, 7, 9
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    >>> target = jnp.array([[7, 0, 9, 4]])                   # argmax at root, 5, 7, 9
    >>> n, path, fix = accept_greedy_path(tree, target, max_depth=2)
    >>> int(n[0]), path[0].tolist(), int(fix[0])              # 7 then 9 accepted, then 4
    (2, [0, 2, 3], 4)
    >>> scores = jnp.log(jax.nn.one_hot(target, 10))         # p one-hot at the same argmax
    >>> n, path, fix = accept_sampled_path(tree, scores, jnp.full((1, 3), 0.5),
    ...                                    jax.random.split(jax.random.key(0), 1), max_depth=2)
    >>> int(n[0]), path[0].tolist(), int(fix[0])
    (2, [0, 2, 3], 4)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.logits.sampling import sample_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTree:
    """One round's draft tree per row (module docs); a PyTree carried between rounds."""

    tokens: jax.Array  # int32 [B, N]
    parent: jax.Array  # int32 [B, N], -1 = the root
    depth: jax.Array  # int32 [B, N], >= 1
    valid: jax.Array  # bool [B, N]
    forwards: jax.Array = None  # int32 []: drafter forwards spent building it

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def parent_slots(parent: jax.Array) -> jax.Array:
    """int32 [B, N+1]: each slot's parent slot (node i sits at slot i + 1; the root's is 0)."""
    batch = parent.shape[0]
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32),
                            parent.astype(jnp.int32) + 1], axis=1)  # [B, N+1]


def ancestor_mask(parent: jax.Array) -> jax.Array:
    """bool [B, N+1, N+1]: slot s sees slot t iff t is s or one of its ancestors (the root is
    everyone's). parent int32 [B, N] (-1 = the root), parents before their children."""
    up = parent_slots(parent)  # [B, N+1]
    batch, slots = up.shape
    here = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))  # [B, N+1]
    mask = jax.nn.one_hot(here, slots, dtype=jnp.bool_)  # [B, N+1, N+1]
    for _ in range(slots - 1):  # walk up one level per step; the root is its own parent
        here = jnp.take_along_axis(up, here, axis=1)  # [B, N+1]
        mask |= jax.nn.one_hot(here, slots, dtype=jnp.bool_)
    return mask


def path_tokens(tree: TokenTree, max_depth: int) -> jax.Array:
    """int32 [B, N+1, max_depth]: at slot s, the tokens of its path below the root by depth
    (entry d - 1 holds depth d's; entries past the slot's depth are 0). A slot's processors
    see the row's tokens followed by these."""
    mask = ancestor_mask(tree.parent)[:, :, 1:]  # [B, N+1, N] ancestors among the nodes
    levels = jnp.arange(1, max_depth + 1, dtype=jnp.int32)  # [D]
    at_level = tree.depth[:, :, None] == levels[None, None, :]  # [B, N, D]
    picked = mask[:, :, :, None] & at_level[:, None, :, :]  # [B, N+1, N, D]
    return jnp.sum(jnp.where(picked, tree.tokens[:, None, :, None], 0), axis=2
                   ).astype(jnp.int32)  # [B, N+1, D]


def slot_depths(tree: TokenTree) -> jax.Array:
    """int32 [B, N+1]: the depth of every slot (the root's is 0)."""
    batch = tree.depth.shape[0]
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.depth.astype(jnp.int32)],
                           axis=1)


def accept_greedy_path(tree: TokenTree, target: jax.Array, max_depth: int
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance over a tree (module docs). target int32 [B, N+1]: the argmax at every
    slot. Returns (n int32 [B] accepted depth, path int32 [B, max_depth+1] the accepted slot
    at each depth (0 = the root; entries past n are 0), fix int32 [B])."""
    up = parent_slots(tree.parent)[:, 1:]  # [B, N] each node's parent slot
    expected = jnp.take_along_axis(target, up, axis=1)  # [B, N] what the target says there
    match = tree.valid & (tree.tokens == expected)  # [B, N]
    batch = match.shape[0]
    root = jnp.ones((batch, 1), jnp.bool_)  # [B, 1]
    accepted = match  # [B, N]; exact after max_depth steps (one level of ancestors each)
    for _ in range(max_depth):
        parent_ok = jnp.take_along_axis(jnp.concatenate([root, accepted], axis=1), up,
                                        axis=1)  # [B, N]
        accepted = match & parent_ok
    levels = jnp.arange(1, max_depth + 1, dtype=jnp.int32)  # [D]
    at_level = accepted[:, None, :] & (tree.depth[:, None, :] == levels[None, :, None])
    found = jnp.any(at_level, axis=2)  # [B, D]
    slot = jnp.argmax(at_level, axis=2).astype(jnp.int32) + 1  # [B, D]
    n = jnp.sum(jnp.cumprod(found.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [B]
    inside = levels[None, :] <= n[:, None]  # [B, D]
    path = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32),
                            jnp.where(inside, slot, 0)], axis=1)  # [B, D+1]
    end = jnp.take_along_axis(path, n[:, None], axis=1)  # [B, 1]
    fix = jnp.take_along_axis(target, end, axis=1)[:, 0].astype(jnp.int32)  # [B]
    return n, path, fix


def accept_sampled_path(tree: TokenTree, scores: jax.Array, uniforms: jax.Array,
                        fix_keys: jax.Array, max_depth: int
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sampled acceptance over a tree (module docs): lossless multi-draft verification.

    scores float32 [B, N+1, V]: the processed target scores at every slot (may hold -inf);
    uniforms float32 [B, N] in [0, 1): node i's acceptance draw; fix_keys [B]: one key per
    row for the fix draw. Returns (n, path, fix) as `accept_greedy_path` does."""
    batch = scores.shape[0]
    probs = jax.nn.softmax(scores, axis=-1)  # [B, N+1, V]
    up = parent_slots(tree.parent)[:, 1:]  # [B, N] each node's parent slot
    tokens = tree.tokens.astype(jnp.int32)  # [B, N]
    at_parent = jnp.take_along_axis(probs, up[:, :, None], axis=1)  # [B, N, V]
    p_node = jnp.take_along_axis(at_parent, tokens[:, :, None], axis=2)[:, :, 0]  # [B, N]
    order = jnp.arange(tree.num_nodes)  # [N]
    earlier = order[None, :, None] > order[None, None, :]  # [1, N, N] j before i
    twin = (earlier & (up[:, :, None] == up[:, None, :])
            & (tokens[:, :, None] == tokens[:, None, :]) & tree.valid[:, None, :])  # [B, N, N]
    testable = tree.valid & ~jnp.any(twin, axis=2)  # [B, N] a repeated sibling: zeroed already
    levels = jnp.arange(max_depth + 1, dtype=jnp.int32)  # [D+1]

    def test(carry, node):  # one node: is it a child of the walk's current slot, accepted?
        here, rejected_mass, path = carry  # [B], [B], [B, D+1]
        parent, p, ok, u, depth, slot = node  # each [B]
        tried = ok & (parent == here)  # [B]
        accept = tried & (u * jnp.maximum(1.0 - rejected_mass, 0.0) < p)  # [B]
        reject = tried & ~accept  # [B]
        here = jnp.where(accept, slot, here)
        rejected_mass = jnp.where(accept, 0.0, rejected_mass + jnp.where(reject, p, 0.0))
        path = jnp.where(accept[:, None] & (levels[None, :] == depth[:, None]), slot[:, None],
                         path)  # [B, D+1]
        return (here, rejected_mass, path), reject

    slot_of = jnp.broadcast_to(order + 1, (batch, tree.num_nodes)).astype(jnp.int32)  # [B, N]
    nodes = tuple(a.T for a in (up, p_node, testable, uniforms.astype(jnp.float32),
                                tree.depth.astype(jnp.int32), slot_of))  # each [N, B]
    start = (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32),
             jnp.zeros((batch, max_depth + 1), jnp.int32))
    (end, _, path), rejected = jax.lax.scan(test, start, nodes)  # rejected [N, B]
    n = jnp.take_along_axis(slot_depths(tree), end[:, None], axis=1)[:, 0]  # [B]
    zeroed = rejected.T & (up == end[:, None])  # [B, N] the end slot's rejected children
    here = jnp.take_along_axis(scores, end[:, None, None], axis=1)[:, 0]  # [B, V]
    rows = jnp.arange(batch)[:, None]
    vocab = here.shape[-1]
    residual = here.at[rows, jnp.where(zeroed, tokens, vocab)].set(-jnp.inf, mode="drop")
    empty = ~jnp.any(residual > -jnp.inf, axis=-1, keepdims=True)  # [B, 1] rounding only
    fix = sample_rows(jnp.where(empty, here, residual), fix_keys)  # [B]
    return n.astype(jnp.int32), path, fix


def along_path(values: jax.Array, path: jax.Array) -> jax.Array:
    """values [B, N+1, ...] at each row's path slots [B, D+1] -> [B, D+1, ...]."""
    index = path.reshape(path.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, index, axis=1)
