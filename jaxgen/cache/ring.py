"""Ring buffers: the fixed-size storage of the sliding-window cache and of the quantized
cache's full-precision residual window.

A ring keeps S slots per row and layer; position j lives in slot j % S, and `pos` records
which position each slot holds (-1: empty):

    k, v    [L, B, Hkv, S, Dh]   (heads-major, like the dense cache)
    pos     int32 [L, B, S]

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache.ring import ring_holds_window, ring_write
    >>> k = v = jnp.zeros((1, 1, 1, 4, 2))                  # 4 slots
    >>> pos = jnp.full((1, 1, 4), -1, jnp.int32)
    >>> new = jnp.ones((1, 6, 1, 2))                        # 6 tokens: [B, n, Hkv, Dh]
    >>> k, v, pos = ring_write(k, v, pos, 0, new, new, jnp.arange(6)[None])
    >>> pos[0, 0].tolist()                                  # the last 4 positions survive
    [4, 5, 2, 3]
    >>> ring_holds_window(pos[0], jnp.array([6]), window=4).tolist()
    [True]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.cache.layout import (
    heads_major,
    scatter_heads_major,
    scatter_rows,
    stored_shape,
)


def ring_write(k_buf: jax.Array, v_buf: jax.Array, pos_buf: jax.Array, layer,
               k_new: jax.Array, v_new: jax.Array, positions: jax.Array):
    """Writes a chunk into ring buffers k/v [L, B, Hkv, S, Dh], pos [L, B, S] (stacked or
    split, jaxgen.cache.layout).

    k_new, v_new: [B, n, Hkv, Dh]; positions int32 [B, n] (contiguous per row). Only the
    chunk's last S tokens are written (earlier ones would collide with them).
    Returns the new (k_buf, v_buf, pos_buf).
    """
    slots = stored_shape(k_buf)[3]
    if positions.shape[1] > slots:
        k_new, v_new, positions = k_new[:, -slots:], v_new[:, -slots:], positions[:, -slots:]
    slot = positions % slots  # [B, n]
    k_buf = scatter_heads_major(k_buf, heads_major(k_new), slot, layer)
    v_buf = scatter_heads_major(v_buf, heads_major(v_new), slot, layer)
    pos_buf = scatter_rows(pos_buf, positions, slot, layer)
    return k_buf, v_buf, pos_buf


def ring_holds_window(pos: jax.Array, length: jax.Array, window: int) -> jax.Array:
    """bool [B]: does the ring pos [B, S] hold every position in [length-window+1, length-1]?"""
    slots = pos.shape[-1]
    slot = jnp.arange(slots, dtype=jnp.int32)  # [S]
    last = length[:, None] - 1  # [B, 1]
    candidate = last - jnp.mod(last - slot[None], slots)  # [B, S] the position slot s must hold
    needed = (candidate >= 0) & (candidate > last + 1 - window)  # [B, S] in [L-W+1, L-1]
    return jnp.all(~needed | (pos == candidate), axis=-1)  # [B]


def ring_max_rollback(pos: jax.Array, length: jax.Array, window: int) -> jax.Array:
    """int32 [B]: the largest n such that rolling back n tokens keeps the window.

    pos: int32 [B, S]; length: int32 [B]. The ring holds the S newest positions it was
    written, [hw - S, hw); decoding at L needs [L - W + 1, L - 1].
    """
    slots = pos.shape[-1]
    high = jnp.max(pos, axis=-1) + 1  # [B] high-water mark
    floor = high - slots + window - 1  # [B] smallest safe length once wrapped
    safe = jnp.where(high <= slots, 0, jnp.maximum(floor, 0))  # [B]
    return jnp.maximum(length - safe, 0).astype(jnp.int32)
