"""The static KV cache and the attention kernel that reads it.

A cache holds every layer's keys and values in fixed-shape arrays, stacked over
layers so that a model can `lax.scan` over its layers with the cache in the
carry. Each row has its own length (DESIGN s.2):

    k, v    [L, B, T, Hkv, Dh]   keys / values, T = static buffer length
    length  int32 [B]            number of valid positions per row

Visibility rule: a query at position p sees the keys at positions j <= p.
Every forward writes a contiguous block starting at the row's current length,
so the keys a query can see are always fresh; anything at j >= length is stale
and is overwritten before it becomes visible. Rolling back a rejected
speculative tail is therefore just `cache.rollback(n)`.

Example:
    >>> cache = KVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1,
    ...                      head_dim=4, dtype=jnp.float32)
    >>> cache.k.shape
    (2, 1, 8, 1, 4)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CACHE_KINDS = ("static",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Dense static cache (fp32 or bf16). A PyTree; shapes never change."""

    k: jax.Array  # [L, B, T, Hkv, Dh]
    v: jax.Array  # [L, B, T, Hkv, Dh]
    length: jax.Array  # int32 [B]

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes + self.length.nbytes)

    def update(self, layer, k_new: jax.Array, v_new: jax.Array,
               positions: jax.Array) -> "KVCache":
        """Writes one layer's new keys/values at `positions`.

        layer: int32 scalar (may be traced); k_new, v_new: [B, S, Hkv, Dh];
        positions: int32 [B, S]. Positions outside [0, T) are dropped.
        """
        batch, seq = positions.shape
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))  # [B, S]
        layers = jnp.full((batch, seq), layer, jnp.int32)  # [B, S]
        k = self.k.at[layers, rows, positions].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[layers, rows, positions].set(v_new.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=k, v=v)

    def attend(self, layer, q: jax.Array, q_positions: jax.Array, *,
               scale: float) -> jax.Array:
        """Attention of queries over this layer's cache.

        q: [B, S, H, Dh]; q_positions: int32 [B, S]. Returns [B, S, H, Dh] in q's dtype.
        """
        k_layer = self.k[layer]  # [B, T, Hkv, Dh]
        v_layer = self.v[layer]  # [B, T, Hkv, Dh]
        return attend_dense(q, k_layer, v_layer, q_positions, scale=scale)

    def with_length(self, length: jax.Array) -> "KVCache":
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def rollback(self, n: jax.Array) -> "KVCache":
        """Forgets the last n[B] positions of each row (no copy)."""
        return self.with_length(self.length - n)


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
                 scale: float) -> jax.Array:
    """Grouped-query attention with the causal-by-position mask.

    q: [B, S, H, Dh]; k, v: [B, T, Hkv, Dh]; q_positions: int32 [B, S].
    Key j is visible to a query at position p iff j <= p. Softmax in fp32.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(batch, seq, num_kv_heads, group, head_dim)  # [B, S, Hkv, G, Dh]
    scores = jnp.einsum("bshgd,bthd->bhgst", q_grouped, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale  # [B, Hkv, G, S, T]
    key_index = jnp.arange(k.shape[1])  # [T]
    visible = key_index[None, None, :] <= q_positions[:, :, None]  # [B, S, T]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)  # [B, Hkv, G, S, T]
    weights = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, G, S, T]
    out = jnp.einsum("bhgst,bthd->bshgd", weights.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)  # [B, S, Hkv, G, Dh]
    return out.reshape(batch, seq, num_heads, head_dim).astype(q.dtype)
