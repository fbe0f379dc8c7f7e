"""A static cache's first positions as a cache of their own, and written back into it.

Continuous batching keeps every slot's buffer as long as the longest request it may take,
while the rows decoding at a moment usually sit far below its end. Attention reads the whole
buffer, so a decode chunk whose rows all stay below position T' runs on the cache cropped to
T' (`cache.resize(T')`: its cost follows T', not the buffer) and `write_prefix` puts the
cropped cache's positions back. Positions past T' are untouched; a write there (a done row's)
is dropped by the cropped cache's `update`.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import KVCache
    >>> full = KVCache.init(num_layers=1, batch=2, max_len=8, num_kv_heads=1, head_dim=2)
    >>> short = full.resize(4)
    >>> short = KVCache(k=short.k + 1, v=short.v, length=jnp.array([3, 2]))
    >>> back = write_prefix(full, short)
    >>> back.k[0, 0, 0, :, 0].tolist(), back.length.tolist(), crops_time(full)
    ([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [3, 2], True)
"""
from __future__ import annotations

import jax
from jax import lax

CROPPABLE_KINDS = ("static",)  # a position's keys live at its own time index (no ring)


def crops_time(cache) -> bool:
    """True when `cache` can run cropped (`resize`) and be written back (`write_prefix`)."""
    return getattr(cache, "kind", None) in CROPPABLE_KINDS and hasattr(cache, "resize")


def _put(full: jax.Array, prefix: jax.Array) -> jax.Array:
    """full with prefix written at index 0 of the one axis where their shapes differ."""
    if full.shape == prefix.shape:
        return prefix.astype(full.dtype)
    axis = next(i for i, (a, b) in enumerate(zip(full.shape, prefix.shape)) if a != b)
    return lax.dynamic_update_slice_in_dim(full, prefix.astype(full.dtype), 0, axis)


def write_prefix(full, prefix):
    """`full` with the positions of `prefix` (full.resize(T') after some steps) written back;
    fields without a time axis (lengths) are prefix's."""
    return jax.tree_util.tree_map(_put, full, prefix)


__all__ = ["CROPPABLE_KINDS", "crops_time", "write_prefix"]
