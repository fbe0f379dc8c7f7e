"""The dense caches: `KVCache` ("static") and `DynamicKVCache` ("dynamic"), and the dense
attention they read through.

    k, v    [L, B, Hkv, T, Dh]   keys / values (heads-major, jaxgen.cache.layout),
                                 T = max_len, the static buffer length
    length  int32 [B]            number of valid positions per row

Position j of a row lives at index j along T; a query at position p sees keys j <= p (and
p - j < window for sliding-window models). Keys at j >= length are stale and get
overwritten before they become visible, so `rollback(n)` only lowers the length.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import KVCache
    >>> cache = KVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1, head_dim=4)
    >>> cache.k.shape                                   # [L, B, Hkv, T, Dh]
    (2, 1, 1, 8, 4)
    >>> k = jnp.ones((1, 3, 1, 4))                      # [B, S, Hkv, Dh]
    >>> cache = cache.update(0, k, k, jnp.arange(3)[None]).with_length(jnp.array([3]))
    >>> cache.rollback(1).length.tolist(), cache.resize(16).max_len
    ([2], 16)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.checks import cache_nbytes, rollback_by_length
from jaxgen.cache.layout import (
    HEADS_MAJOR_AXES,
    fit_time,
    heads_major,
    move_time_slots,
    scatter_heads_major,
    stored_shape,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Dense static cache (fp32 or bf16; cache_implementation="static"). A PyTree; shapes
    never change inside a jitted call."""

    k: jax.Array  # [L, B, Hkv, T, Dh]
    v: jax.Array  # [L, B, Hkv, T, Dh]
    length: jax.Array  # int32 [B]

    kind: ClassVar[str] = "static"
    field_axes: ClassVar[dict] = {"k": HEADS_MAJOR_AXES, "v": HEADS_MAJOR_AXES,
                                  "length": ("batch",)}  # jaxgen.cache.sharding

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, **extra) -> "KVCache":
        """An empty cache; `extra`: the fields a subclass adds (e.g. OffloadedKVCache)."""
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32), **extra)

    @property
    def max_len(self) -> int:
        return stored_shape(self.k)[3]

    @property
    def batch(self) -> int:
        return stored_shape(self.k)[1]

    def nbytes(self) -> int:
        return cache_nbytes(self)

    def update(self, layer, k_new: jax.Array, v_new: jax.Array,
               positions: jax.Array) -> "KVCache":
        """Writes one layer's new keys/values at `positions`.

        layer: int32 scalar (may be traced); k_new, v_new: [B, S, Hkv, Dh];
        positions: int32 [B, S]. Positions outside [0, T) are dropped.
        """
        k = scatter_heads_major(self.k, heads_major(k_new), positions, layer)
        v = scatter_heads_major(self.v, heads_major(v_new), positions, layer)
        return dataclasses.replace(self, k=k, v=v)

    def attend(self, layer, q: jax.Array, q_positions: jax.Array, *,
               scale: float, window: int | None = None,
               softcap: float | None = None, tree_mask: jax.Array | None = None) -> jax.Array:
        """Attention of queries over this layer's cache.

        q: [B, S, H, Dh]; q_positions: int32 [B, S]. Returns [B, S, H, Dh] in q's dtype.
        window: the model's sliding window (keys at j <= p - window are invisible).
        softcap: attention logit soft-capping (jaxgen.cache.attention; None: none).
        tree_mask: bool [B, S, S], a token tree's ancestor mask over the slots
        q_positions[:, 0] + 0..S-1 (jaxgen.cache.attention); None: by position.
        """
        k_layer = self.k[layer]  # [B, Hkv, T, Dh]
        v_layer = self.v[layer]  # [B, Hkv, T, Dh]
        return attend_dense(q, k_layer, v_layer, q_positions, scale=scale, window=window,
                            softcap=softcap, tree_mask=tree_mask)

    def update_attend(self, layer, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      positions: jax.Array, *, scale: float, window: int | None = None,
                      softcap: float | None = None, tree_mask: jax.Array | None = None
                      ) -> tuple[jax.Array, "KVCache"]:
        """Writes the new K/V, then attends (queries at `positions`). Returns (out, cache)."""
        cache = self.update(layer, k_new, v_new, positions)
        tree = {} if tree_mask is None else {"tree_mask": tree_mask}  # kinds without trees too
        return cache.attend(layer, q, positions, scale=scale, window=window, softcap=softcap,
                            **tree), cache

    def move_slots(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Every layer's K/V at each row's slots src int32 [B, S] copied to slots dst [B, S]
        (a token tree's accepted path, written back contiguously); length unchanged."""
        return dataclasses.replace(self, k=move_time_slots(self.k, src, dst),
                                   v=move_time_slots(self.v, src, dst))

    def with_length(self, length: jax.Array) -> "KVCache":
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def max_rollback(self) -> jax.Array:
        """int32 [B]: how many tokens each row can roll back (dense: all of them)."""
        return self.length

    def rollback(self, n: jax.Array) -> "KVCache":
        """Forgets the last n[B] positions of each row (no copy).

        Outside jit (concrete arrays) an impossible rollback (n < 0 or n > length) raises
        ValueError (`jaxgen.cache.check_rollback`); under jit it is not checked.
        """
        return rollback_by_length(self, n)

    def resize(self, max_len: int) -> "KVCache":
        """A copy with T = max_len (grows with zeros, or crops; positions are unchanged)."""
        return dataclasses.replace(self, k=fit_time(self.k, max_len), v=fit_time(self.v, max_len))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicKVCache(KVCache):
    """The dense cache of `cache_implementation="dynamic"`: same layout, small T that
    jaxgen.drivers.growing doubles between jitted chunks (`resize`)."""

    kind: ClassVar[str] = "dynamic"


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
                 scale: float, window: int | None = None,
                 softcap: float | None = None, tree_mask: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention with the causal-by-position mask.

    q: [B, S, H, Dh]; k, v: [B, Hkv, T, Dh] (heads-major); q_positions: int32 [B, S].
    Key j is visible to a query at position p iff j <= p (and p - j < window). Softmax in fp32.
    Returns [B, S, H, Dh] in q's dtype. tree_mask: see `KVCache.attend`.
    """
    block = KeyBlock(k=k, v=v, positions=jnp.arange(k.shape[2], dtype=jnp.int32),
                     ordered=True)
    return attend_blocks(q, q_positions, [block], scale=scale, window=window, softcap=softcap,
                         tree_mask=tree_mask)
