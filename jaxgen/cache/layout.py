"""The heads-major layout every cache kind stores keys and values in.

A model hands the cache its new keys and values sequence-major, [B, S, Hkv, Dh]. Caches
keep them heads-major, [(L,) B, Hkv, T, Dh]: each (row, kv head) holds its keys as one
contiguous [T, Dh] block, so the attention products are plain batched matmuls with no
transpose of the cache (on CPU a [B, T, Hkv, Dh] cache would cost a full copy of every
layer per step).

A per-layer field is stored stacked, one [L, ...] array, or as a tuple of L [...] arrays
(`jaxgen.cache.layer_forms`). `stored_shape`, `replace_layer` and the scatters below take
either; a tuple field needs a static layer.

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
    >>> split = scatter_heads_major((cache[0], cache[1]), new, positions, layer=1)
    >>> bool((split[1] == written[1]).all()), stored_shape(split)
    (True, (2, 2, 4, 8, 8))
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The logical axes of a heads-major array, as the kinds declare them for sharding
# (jaxgen.cache.sharding: "batch" goes on the mesh's "data" axis, "kv_heads" on "model").
HEADS_MAJOR_AXES = ("layer", "batch", "kv_heads", "time", "head_dim")


def stored_shape(buf) -> tuple[int, ...]:
    """The [L, ...] shape of a per-layer field, stored stacked or split (a tuple)."""
    if isinstance(buf, tuple):
        return (len(buf),) + tuple(buf[0].shape)
    return tuple(buf.shape)


def stored_dtype(buf):
    """The dtype of a per-layer field, stored stacked or split."""
    return buf[0].dtype if isinstance(buf, tuple) else buf.dtype


def cache_dtype(cache, default=jnp.float32):
    """The float dtype of a dense-layout cache's keys (`default` for kinds without `k`)."""
    keys = getattr(cache, "k", None)
    return default if keys is None else stored_dtype(keys)


def _static_layer(layer) -> int:
    if isinstance(layer, jax.core.Tracer):
        raise TypeError("a cache held as per-layer tuples (jaxgen.cache.layer_forms) needs a "
                        "static layer index; run the model's layers unrolled, or stack the cache")
    return int(layer)


def replace_layer(buf, layer, value):
    """buf with layer `layer` set to value [...]: a new tuple (split) or buf.at[layer].set."""
    if isinstance(buf, tuple):
        index = _static_layer(layer)
        return buf[:index] + (value,) + buf[index + 1:]
    return buf.at[layer].set(value)


def fit_time(buf, max_len: int):
    """A heads-major per-layer field [L, B, Hkv, T, X] (stacked or split) cropped or grown
    with zeros to T = max_len."""
    if isinstance(buf, tuple):
        return tuple(_fit_axis(a, max_len, 2) for a in buf)
    return _fit_axis(buf, max_len, 3)


def _fit_axis(a: jax.Array, size: int, axis: int) -> jax.Array:
    if size <= a.shape[axis]:
        return lax.slice_in_dim(a, 0, size, axis=axis)
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def heads_major(x: jax.Array) -> jax.Array:
    """[B, S, Hkv, Dh] (a model's new keys or values) -> [B, Hkv, S, Dh]."""
    return jnp.swapaxes(x, 1, 2)


def scatter_heads_major(buf: jax.Array, updates: jax.Array, slots: jax.Array,
                        layer=None) -> jax.Array:
    """Writes heads-major updates [B, Hkv, S, X] into buf [(L,) B, Hkv, T, X] at each row's
    slots int32 [B, S] (of `layer` when buf has the leading L axis, stacked (the layer may be
    traced) or split (static)). Slots outside [0, T) are dropped.

    One scatter whose rows and heads are batching dimensions: on a mesh (jaxgen.cache.sharding)
    each device writes its own rows and heads, where an index built from row / head iotas
    makes XLA gather every device's new keys first. Same speed on one device.
    """
    if isinstance(buf, tuple):
        own = scatter_heads_major(buf[_static_layer(layer)], updates, slots)
        return replace_layer(buf, layer, own)
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


def move_time_slots(buf, src: jax.Array, dst: jax.Array):
    """A heads-major per-layer field [L, B, Hkv, T, X] (stacked or split) with each row's
    slots src int32 [B, S] copied to its slots dst [B, S], every layer (all read before any
    is written; dst outside [0, T) dropped). A token tree's accepted path moves this way.

    Example:
        >>> buf = jnp.arange(6.0).reshape(1, 1, 1, 6, 1)             # slot j holds j
        >>> moved = move_time_slots(buf, jnp.array([[4, 5]]), jnp.array([[1, 2]]))
        >>> moved[0, 0, 0, :, 0].tolist()
        [0.0, 4.0, 5.0, 3.0, 4.0, 5.0]
    """
    def one(layer_buf):  # [B, Hkv, T, X]
        taken = jnp.take_along_axis(layer_buf, src[:, None, :, None].astype(jnp.int32),
                                    axis=2)  # [B, Hkv, S, X] (Hkv, X broadcast)
        return scatter_heads_major(layer_buf, taken, dst)

    if isinstance(buf, tuple):
        return tuple(one(layer_buf) for layer_buf in buf)
    return jax.vmap(one)(buf)


def scatter_rows(buf: jax.Array, values: jax.Array, slots: jax.Array, layer) -> jax.Array:
    """Writes values [B, S] into buf [L, B, T] (stacked or split) at layer `layer` and each
    row's slots [B, S] (a ring's position table), rows as a batching dimension (see
    `scatter_heads_major`)."""
    if isinstance(buf, tuple):
        own = buf[_static_layer(layer)]  # [B, T]
        index = slots.astype(jnp.int32)[..., None]  # [B, S, 1]
        numbers = lax.ScatterDimensionNumbers(
            update_window_dims=(), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
            operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
        own = lax.scatter(own, index, values.astype(own.dtype), numbers,
                          mode=lax.GatherScatterMode.FILL_OR_DROP)
        return replace_layer(buf, layer, own)
    batch, seq = values.shape
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (batch, seq))
    index = jnp.stack([layers, slots.astype(jnp.int32)], axis=-1)  # [B, S, 2]
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0, 2), scatter_dims_to_operand_dims=(0, 2),
        operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))
    return lax.scatter(buf, index, values.astype(buf.dtype), numbers,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)
