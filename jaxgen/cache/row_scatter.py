"""Writing some rows of a cache into chosen rows of another cache of the same kind.

Continuous batching (jaxgen.serving) prefills newcomers in a cache of their own and moves
their rows into free slots of the running cache. A cache is a PyTree whose leaves carry the
batch on a known axis (beam search finds them with jaxgen.loops.beam.cache_batch_axes);
`scatter_cache_rows` writes row i of `rows` into row slots[i] of `cache` along those axes. A
slot out of range (e.g. the cache's batch) drops that row: padded newcomers write nothing.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import KVCache
    >>> shape = dict(num_layers=1, max_len=4, num_kv_heads=1, head_dim=2)
    >>> running = KVCache.init(batch=3, **shape)
    >>> fresh = KVCache.init(batch=2, **shape)
    >>> fresh = KVCache(k=fresh.k + 1, v=fresh.v + 2, length=jnp.array([4, 2]))
    >>> out = scatter_cache_rows(running, fresh, jnp.array([2, 3]), axes=(1, 1, 0))
    >>> out.length.tolist(), out.k[0, :, 0, 0, 0].tolist()   # row 2 written, slot 3 dropped
    ([0, 0, 4], [0.0, 0.0, 1.0])
"""
from __future__ import annotations

import jax


def _scatter_leaf(leaf: jax.Array, rows: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
    """leaf [.., B, ..] with rows [.., N, ..] written at slots int32 [N] on `axis`."""
    index = (slice(None),) * axis + (slots,)
    return leaf.at[index].set(rows.astype(leaf.dtype), mode="drop")


def scatter_cache_rows(cache, rows, slots: jax.Array, axes: tuple):
    """`cache` with row i of `rows` (a cache of the same kind and length, N rows) written at
    row slots[i] (int32 [N]; out of range: dropped). axes: each leaf's batch axis in
    `jax.tree_util.tree_leaves` order (None: a leaf without rows, kept as it is)."""
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    new_leaves = jax.tree_util.tree_leaves(rows)
    if len(leaves) != len(axes) or len(new_leaves) != len(leaves):
        raise ValueError(f"scatter_cache_rows: the caches have {len(leaves)} and "
                         f"{len(new_leaves)} leaves and `axes` names {len(axes)}; pass two "
                         f"caches of one kind and their batch axes")
    return jax.tree_util.tree_unflatten(treedef, [
        old if axis is None else _scatter_leaf(old, new, slots, axis)
        for old, new, axis in zip(leaves, new_leaves, axes)])


__all__ = ["scatter_cache_rows"]
