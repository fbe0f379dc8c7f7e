"""Reading chosen rows of a cache, and writing rows into chosen rows of a cache of one kind.

Continuous batching (jaxgen.serving) prefills newcomers in a cache of their own and moves
their rows into free slots of the running cache. A cache is a PyTree whose leaves carry the
batch on a known axis (beam search finds them with jaxgen.loops.beam.cache_batch_axes);
`scatter_cache_rows` writes row i of `rows` into row slots[i] of `cache` along those axes. A
slot out of range (e.g. the cache's batch) drops that row: padded newcomers write nothing.
`take_cache_rows` reads rows slots[i] out as a cache of their own (a prompt prefilled in
chunks straight into its slot reads the row, extends it and writes it back).

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
    >>> take_cache_rows(out, jnp.array([2]), axes=(1, 1, 0)).length.tolist()
    [4]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def take_cache_rows(cache, slots: jax.Array, axes: tuple):
    """The rows slots int32 [N] of `cache` as a cache of N rows (axes: as scatter_cache_rows;
    a leaf without rows is kept whole)."""
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    if len(leaves) != len(axes):
        raise ValueError(f"take_cache_rows: the cache has {len(leaves)} leaves and `axes` "
                         f"names {len(axes)}; pass the cache's own batch axes")
    return jax.tree_util.tree_unflatten(treedef, [
        leaf if axis is None else jnp.take(leaf, slots, axis=axis, mode="clip")
        for leaf, axis in zip(leaves, axes)])


__all__ = ["scatter_cache_rows", "take_cache_rows"]
