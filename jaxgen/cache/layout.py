"""The heads-major layout every cache kind stores keys and values in.

A model hands the cache its new keys and values sequence-major, [B, S, Hkv, Dh]. Caches
keep them heads-major, [(L,) B, Hkv, T, Dh]: each (row, kv head) holds its keys as one
contiguous [T, Dh] block, so the attention products are plain batched matmuls with no
transpose of the cache (on CPU a [B, T, Hkv, Dh] cache would cost a full copy of every
layer per step).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache.layout import heads_major, scatter_heads_major
    >>> heads_major(jnp.zeros((2, 3, 4, 8))).shape    # [B, S, Hkv, Dh] -> [B, Hkv, S, Dh]
    (2, 4, 3, 8)
    >>> positions = jnp.array([[5, 6, 7], [0, 1, 2]])  # [B, S]
    >>> cache = jnp.zeros((2, 2, 4, 8, 8))             # [L, B, Hkv, T, Dh]
    >>> new = jnp.ones((2, 4, 3, 8))                   # [B, Hkv, S, Dh] (heads-major)
    >>> written = scatter_heads_major(cache, new, positions, layer=1)
    >>> written[1, 0, :, 5:8].sum().tolist(), written[1, 0, :, 3].sum().tolist()
    (96.0, 0.0)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The logical axes of a heads-major array, as the kinds declare them for sharding
# (jaxgen.cache.sharding: "batch" goes on the mesh's "data" axis, "kv_heads" on "model").
HEADS_MAJOR_AXES = ("layer", "batch", "kv_heads", "time", "head_dim")


def heads_major(x: jax.Array) -> jax.Array:
    """[B, S, Hkv, Dh] (a model's new keys or values) -> [B, Hkv, S, Dh]."""
    return jnp.swapaxes(x, 1, 2)


def scatter_heads_major(buf: jax.Array, updates: jax.Array, slots: jax.Array,
                        layer=None) -> jax.Array:
    """Writes heads-major updates [B, Hkv, S, X] into buf [(L,) B, Hkv, T, X] at each row's
    slots int32 [B, S] (of `layer` when buf has the leading L axis; it may be traced). Slots
    outside [0, T) are dropped.

    One scatter whose rows and heads are batching dimensions: on a mesh (jaxgen.cache.sharding)
    each device writes its own rows and heads, where an index built from row / head iotas
    makes XLA gather every device's new keys first. Same speed on one device.
    """
    batch, heads, seq = updates.shape[:3]
    slot = jnp.broadcast_to(slots[:, None, :], (batch, heads, seq)).astype(jnp.int32)
    if layer is None:
        index = slot[..., None]  # [B, Hkv, S, 1]
        fixed, batched = (2,), (0, 1)
    else:
        layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (batch, heads, seq))
        index = jnp.stack([layers, slot], axis=-1)  # [B, Hkv, S, 2]
        fixed, batched = (0, 3), (1, 2)
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=(3,), inserted_window_dims=fixed, scatter_dims_to_operand_dims=fixed,
        operand_batching_dims=batched, scatter_indices_batching_dims=(0, 1))
    return lax.scatter(buf, index, updates.astype(buf.dtype), numbers,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)


def scatter_rows(buf: jax.Array, values: jax.Array, slots: jax.Array, layer) -> jax.Array:
    """Writes values [B, S] into buf [L, B, T] at layer `layer` and each row's slots [B, S]
    (a ring's position table), rows as a batching dimension (see `scatter_heads_major`)."""
    batch, seq = values.shape
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (batch, seq))
    index = jnp.stack([layers, slots.astype(jnp.int32)], axis=-1)  # [B, S, 2]
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0, 2), scatter_dims_to_operand_dims=(0, 2),
        operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))
    return lax.scatter(buf, index, values.astype(buf.dtype), numbers,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)
