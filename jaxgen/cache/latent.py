"""The latent cache of multi-head latent attention (MLA: DeepSeek-V2/V3): per layer, the
compressed latent every head's keys and values are expanded from, never the per-head K/V.

    latent  [L, B, 1, T, R + P]   position j of a row at index j along T: first c_kv [R]
                                  (kv_lora_rank, after kv_a_layernorm), then k_pe [P]
                                  (qk_rope_head_dim, the rotary key every head shares,
                                  rotated); the axis of size 1 is the one "KV head"
    length  int32 [B]             valid positions per row

`c_kv` and `k_pe` read the two parts. They share one buffer so that attention reads each
layer's keys as one contiguous [T, R + P] block per row, with no copy per step: the model
attends in the absorbed form (jaxgen/models/mla.py), whose keys are exactly [c_kv ; k_pe]
and whose values are c_kv (the first R columns of the same block). Per token and layer
that is R + P numbers (576 for DeepSeek-V3) where the expanded cache holds H * (Dqk + Dv)
(128 * (192 + 128) = 40,960): `bytes_per_token()`.

The update follows HF's `cache.update(kv_nope, k_rot, layer)`: `update(layer, c_kv, k_pe,
positions)` takes the latent [B, S, R] and the rotary key [B, S, P]. Visibility, rollback
and growth are the dense cache's (jaxgen/cache/dense.py): keys at j >= length are stale and
rewritten before a query sees them. "static" is `LatentCache`, "dynamic" (grown between
chunks by jaxgen.drivers.growing) `DynamicLatentCache`.

Example:
    >>> import jax.numpy as jnp
    >>> cache = LatentCache.init(num_layers=2, batch=1, max_len=8, kv_lora_rank=4, rope_dim=2)
    >>> cache.latent.shape                              # [L, B, 1, T, R + P]
    (2, 1, 1, 8, 6)
    >>> c_kv, k_pe = jnp.ones((1, 3, 4)), jnp.ones((1, 3, 2))   # [B, S, R], [B, S, P]
    >>> cache = cache.update(0, c_kv, k_pe, jnp.arange(3)[None]).with_length(jnp.array([3]))
    >>> cache.c_kv.shape, cache.k_pe.shape, cache.bytes_per_token()
    ((2, 1, 8, 4), (2, 1, 8, 2), 48)
    >>> q = jnp.ones((1, 1, 2, 6))                      # [B, S, H, R + P] absorbed queries
    >>> cache.attend(0, q, jnp.array([[2]]), scale=1.0).shape   # [B, S, H, R]
    (1, 1, 2, 4)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.checks import cache_nbytes, rollback_by_length
from jaxgen.cache.layout import (
    fit_time,
    scatter_heads_major,
    stored_dtype,
    stored_shape,
)

# The logical axes of the latent (jaxgen.cache.sharding): rows on "data"; no axis goes on
# "model" (the latent has no head axis: every device holds it whole for its own heads).
LATENT_AXES = ("layer", "batch", "latent_head", "time", "latent")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """MLA's latent cache (cache_implementation="static"). A PyTree; shapes never change
    inside a jitted call."""

    latent: jax.Array  # [L, B, 1, T, R + P] (stacked, or a tuple of L [B, 1, T, R + P])
    length: jax.Array  # int32 [B]
    kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))  # R

    kind: ClassVar[str] = "static"
    field_axes: ClassVar[dict] = {"latent": LATENT_AXES, "length": ("batch",)}

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, kv_lora_rank: int,
             rope_dim: int, dtype=jnp.float32) -> "LatentCache":
        """An empty cache of `max_len` positions per row."""
        shape = (num_layers, batch, 1, max_len, kv_lora_rank + rope_dim)
        return cls(latent=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32),
                   kv_lora_rank=int(kv_lora_rank))

    @property
    def max_len(self) -> int:
        return stored_shape(self.latent)[3]

    @property
    def batch(self) -> int:
        return stored_shape(self.latent)[1]

    @property
    def c_kv(self) -> jax.Array:
        """[L, B, T, R]: every layer's compressed latent (stacked form)."""
        return _stacked(self.latent)[:, :, 0, :, :self.kv_lora_rank]

    @property
    def k_pe(self) -> jax.Array:
        """[L, B, T, P]: every layer's rotary key, shared by the heads (stacked form)."""
        return _stacked(self.latent)[:, :, 0, :, self.kv_lora_rank:]

    def nbytes(self) -> int:
        return cache_nbytes(self)

    def bytes_per_token(self) -> int:
        """Bytes one position of one row takes over every layer: L * (R + P) * itemsize."""
        layers, _, _, _, width = stored_shape(self.latent)
        return int(layers * width * jnp.dtype(stored_dtype(self.latent)).itemsize)

    def update(self, layer, c_kv: jax.Array, k_pe: jax.Array,
               positions: jax.Array) -> "LatentCache":
        """Writes one layer's new latents c_kv [B, S, R] and rotary keys k_pe [B, S, P] at
        `positions` int32 [B, S] (layer: an int32 scalar, traced unless the storage is a
        tuple). Positions outside [0, T) are dropped."""
        new = jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)[:, None]  # [B,1,S,R+P]
        return dataclasses.replace(
            self, latent=scatter_heads_major(self.latent, new, positions, layer))

    def attend(self, layer, q: jax.Array, q_positions: jax.Array, *, scale: float,
               window: int | None = None) -> jax.Array:
        """Absorbed attention over one layer's latent: queries q [B, S, H, R + P] (each
        head's no-rope query through its key up-projection, then its rotary query) score
        the keys [c_kv ; k_pe] and weigh the values c_kv. Returns [B, S, H, R] in q's dtype
        (the latent-space output, before each head's value up-projection)."""
        block = self._layer(layer)  # [B, 1, T, R + P]
        keys = KeyBlock(k=block, v=block, positions=jnp.arange(block.shape[2], dtype=jnp.int32),
                        ordered=True)
        out = attend_blocks(q.astype(block.dtype), q_positions, [keys], scale=scale,
                            window=window)  # [B, S, H, R + P]
        return out[..., :self.kv_lora_rank].astype(q.dtype)  # [B, S, H, R]

    def update_attend(self, layer, q: jax.Array, c_kv: jax.Array, k_pe: jax.Array,
                      positions: jax.Array, *, scale: float, window: int | None = None
                      ) -> tuple[jax.Array, "LatentCache"]:
        """Writes the new latents, then attends (queries at `positions`). Returns
        (out [B, S, H, R], cache)."""
        cache = self.update(layer, c_kv, k_pe, positions)
        return cache.attend(layer, q, positions, scale=scale, window=window), cache

    def with_length(self, length: jax.Array) -> "LatentCache":
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def max_rollback(self) -> jax.Array:
        """int32 [B]: how many tokens each row can roll back (all of them)."""
        return self.length

    def rollback(self, n: jax.Array) -> "LatentCache":
        """Forgets the last n[B] positions of each row (no copy); outside jit an impossible
        rollback raises ValueError (jaxgen.cache.check_rollback)."""
        return rollback_by_length(self, n)

    def resize(self, max_len: int) -> "LatentCache":
        """A copy with T = max_len (grows with zeros, or crops; positions are unchanged)."""
        return dataclasses.replace(self, latent=fit_time(self.latent, max_len))

    def _layer(self, layer) -> jax.Array:
        """One layer's latent [B, 1, T, R + P] (a tuple needs a static layer)."""
        if isinstance(self.latent, tuple):
            return self.latent[int(layer)]
        return self.latent[layer]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLatentCache(LatentCache):
    """The latent cache of `cache_implementation="dynamic"`: same layout, a small T that
    jaxgen.drivers.growing doubles between jitted chunks (`resize`)."""

    kind: ClassVar[str] = "dynamic"


def _stacked(buf) -> jax.Array:
    return jnp.stack(buf) if isinstance(buf, tuple) else buf


LATENT_KINDS = {"static": LatentCache, "dynamic": DynamicLatentCache}
