"""The heads-major layout every cache kind stores keys and values in.

A model hands the cache its new keys and values sequence-major, [B, S, Hkv, Dh]. Caches
keep them heads-major, [(L,) B, Hkv, T, Dh]: each (row, kv head) holds its keys as one
contiguous [T, Dh] block, so the attention products are plain batched matmuls with no
transpose of the cache (on CPU a [B, T, Hkv, Dh] cache would cost a full copy of every
layer per step).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache.layout import heads_major, heads_major_index
    >>> heads_major(jnp.zeros((2, 3, 4, 8))).shape    # [B, S, Hkv, Dh] -> [B, Hkv, S, Dh]
    (2, 4, 3, 8)
    >>> positions = jnp.array([[5, 6, 7], [0, 1, 2]])  # [B, S]
    >>> [a.shape for a in heads_major_index(positions, num_kv_heads=4, layer=1)]
    [(2, 4, 3), (2, 4, 3), (2, 4, 3), (2, 4, 3)]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def heads_major(x: jax.Array) -> jax.Array:
    """[B, S, Hkv, Dh] (a model's new keys or values) -> [B, Hkv, S, Dh]."""
    return jnp.swapaxes(x, 1, 2)


def heads_major_index(positions: jax.Array, num_kv_heads: int, layer=None) -> tuple:
    """Scatter index of new keys [B, Hkv, S, Dh] into a heads-major [(L,) B, Hkv, T, Dh] array.

    positions: int32 [B, S], the slots to write. Returns (rows, heads, slots), each int32
    [B, Hkv, S], preceded by a layer index of the same shape when `layer` is given.
    """
    batch, seq = positions.shape
    shape = (batch, num_kv_heads, seq)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None, None], shape)  # [B, Hkv, S]
    heads = jnp.broadcast_to(jnp.arange(num_kv_heads)[None, :, None], shape)  # [B, Hkv, S]
    slots = jnp.broadcast_to(positions[:, None, :], shape)  # [B, Hkv, S]
    if layer is None:
        return rows, heads, slots
    return jnp.full(shape, layer, jnp.int32), rows, heads, slots
