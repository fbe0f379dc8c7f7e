"""Quantized KV cache (cache_implementation="quantized"): int8 (or packed 4-bit) codes of
Hadamard-rotated K/V with per-group scales, and an optional full-precision residual ring.

    kq, vq      int8  [L, B, Hkv, T, Dh]       codes of k R, v R (nbits=8; heads-major)
                uint8 [L, B, Hkv, T, Dh/2]     (nbits=4: two signed 4-bit codes a byte)
    k_scale     [L, B, Hkv, T, Nk]             Nk = 4 key groups per head (Dh/16 for Dh = 64),
    v_scale     [L, B, Hkv, T, Nv]             Nv = 2 value groups, or Dh / q_group_size for
                                               both when q_group_size is set; cache dtype
    rk, rv      [L, B, Hkv, S, Dh]             full-precision ring of the most recent tokens,
    rpos        int32 [L, B, S]                S = min(T, R + rollback_slack) slots
                                               (residual_length = R > 0 only, else None)
    length      int32 [B]

Scheme. R is the orthonormal Hadamard matrix [Dh, Dh] (`rotate=True`, the default, for
power-of-two Dh; identity otherwise). Llama keys carry a few large channels (post-RoPE);
rotating spreads them over all channels, so a per-token absmax no longer spends its range on
them. Then symmetric quantization per (token, head, group): scale = max|x| / qmax, code =
round(x / scale), qmax = 127 (int8) or 7 (4-bit). Keys get more groups than values: on
SmolLM2 the key error dominates (greedy agreement with exact keys and int8 values: 0.97).
Attention never dequantizes the cache: the query is rotated (q R . k R = q . k), the
query-code products are multiplied by the key scales, the attention weights by the value
scales, and the block's output is rotated back by R^T (jaxgen.cache.attention). R is fixed,
not fitted to data, so the codes of a token depend on that token alone.

Which precision a key is read in depends only on its age relative to the query:
age = p - j < residual_length reads the full-precision copy, older keys read the codes. So
the result does not depend on how the tokens were chunked (prefill, one by one, speculative
verify) and rolling back then regenerating reproduces a fresh run, as long as the residual
ring still holds the recent keys (rollback <= rollback_slack + 1); past that, the affected
keys fall back to their int8 codes (never to garbage).

Bytes per token and head (K + V): 2 Dh (int8) + (Nk + Nv) * itemsize. For Dh = 64 and the
default 4 + 2 scales: 0.297x of fp32, 0.547x of bf16 (plus the residual ring, if any; with
residual_length = 128 the ring alone is ~1x the fp32 cache at 150 tokens, so it stays off).

Example:
    >>> import numpy as np
    >>> from jaxgen.cache import QuantizedKVCache
    >>> from jaxgen.cache.int8 import dequantize, hadamard, quantize
    >>> c = QuantizedKVCache.init(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=4)
    >>> c.kq.dtype, c.k_scale.shape, c.v_scale.shape
    (dtype('int8'), (1, 1, 1, 8, 4), (1, 1, 1, 8, 2))
    >>> h = hadamard(4)
    >>> bool(np.allclose(h @ h.T, np.eye(4)))
    True
    >>> x = np.array([[1.0, -3.0, 0.5, 4.0]], np.float32)
    >>> codes, scale = quantize(x, nbits=8, groups=1, scale_dtype=np.float32)
    >>> codes.tolist(), bool(np.allclose(dequantize(codes, scale, 8), x, atol=scale[0, 0] / 2))
    ([[32, -95, 16, 127]], True)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.checks import cache_nbytes, rollback_by_length
from jaxgen.cache.layout import (
    HEADS_MAJOR_AXES,
    fit_time,
    heads_major,
    scatter_heads_major,
    stored_dtype,
    stored_shape,
)
from jaxgen.cache.ring import ring_write

QMAX = {8: 127, 4: 7}
KEY_GROUPS, VALUE_GROUPS = 4, 2  # default scales per token and head (q_group_size unset)


def hadamard(dim: int) -> np.ndarray | None:
    """Orthonormal Sylvester-Hadamard matrix [Dh, Dh] float32; None if Dh is not a power of 2."""
    if dim < 1 or dim & (dim - 1):
        return None
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(np.float32(dim))  # [Dh, Dh], h @ h.T = I


def default_groups(head_dim: int, group_size: int | None) -> tuple[int, int]:
    """(key groups, value groups) per head: head_dim // q_group_size for both if set, else
    KEY_GROUPS / VALUE_GROUPS (one group where they do not divide head_dim)."""
    if group_size:
        return head_dim // group_size, head_dim // group_size
    fit = lambda n: n if head_dim % n == 0 else 1  # noqa: E731
    return fit(KEY_GROUPS), fit(VALUE_GROUPS)


def quantize(x: jax.Array, nbits: int, groups: int, scale_dtype):
    """x [..., Dh] -> (codes int8 [..., Dh] (nbits=8) | uint8 [..., Dh/2] (4), scale [..., N])."""
    head_dim = x.shape[-1]
    xg = x.astype(jnp.float32).reshape(x.shape[:-1] + (groups, head_dim // groups))  # [..., N, g]
    amax = jnp.max(jnp.abs(xg), axis=-1)  # [..., N]
    scale = (amax / QMAX[nbits]).astype(scale_dtype)  # [..., N] as stored
    safe = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))  # [..., N]
    codes = jnp.clip(jnp.round(xg / safe[..., None]), -QMAX[nbits], QMAX[nbits])
    codes = codes.astype(jnp.int8).reshape(x.shape)  # [..., Dh]
    if nbits == 4:
        codes = pack4(codes)  # [..., Dh/2]
    return codes, scale


def pack4(codes: jax.Array) -> jax.Array:
    """int8 [..., Dh] in [-8, 7] -> uint8 [..., Dh/2] (even index in the low nibble)."""
    nibbles = codes.astype(jnp.uint8) & 0xF  # [..., Dh]
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [..., Dh/2]


def unpack4(packed: jax.Array) -> jax.Array:
    """uint8 [..., Dh/2] -> int8 [..., Dh] (sign-extended 4-bit codes)."""
    signed = jax.lax.bitcast_convert_type(packed, jnp.int8)  # [..., Dh/2] the same bits
    low = jax.lax.shift_right_arithmetic(signed << 4, jnp.int8(4))  # sign-extended low nibble
    high = jax.lax.shift_right_arithmetic(signed, jnp.int8(4))  # sign-extended high nibble
    both = jnp.stack([low, high], axis=-1)  # [..., Dh/2, 2]
    return both.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))  # [..., Dh]


def dequantize(codes: jax.Array, scale: jax.Array, nbits: int) -> jax.Array:
    """For tests and reference only: codes + scale [..., N] -> float32 [..., Dh]."""
    if nbits == 4:
        codes = unpack4(codes)
    groups = scale.shape[-1]
    xg = codes.astype(jnp.float32).reshape(codes.shape[:-1] + (groups, -1))
    return (xg * scale.astype(jnp.float32)[..., None]).reshape(codes.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVCache:
    """int8 / 4-bit KV cache of rotated K/V (cache_implementation="quantized"). A PyTree."""

    kq: jax.Array  # int8 [L, B, Hkv, T, Dh] | uint8 [L, B, Hkv, T, Dh/2] (codes of k R)
    vq: jax.Array  # (codes of v R)
    k_scale: jax.Array  # [L, B, Hkv, T, Nk]
    v_scale: jax.Array  # [L, B, Hkv, T, Nv]
    rk: jax.Array | None  # [L, B, Hkv, S, Dh] residual ring (None when residual_length == 0)
    rv: jax.Array | None
    rpos: jax.Array | None  # int32 [L, B, S]
    length: jax.Array  # int32 [B]
    nbits: int = dataclasses.field(metadata=dict(static=True))
    residual_length: int = dataclasses.field(metadata=dict(static=True))
    rotate: bool = dataclasses.field(default=False, metadata=dict(static=True))

    kind: ClassVar[str] = "quantized"
    field_axes: ClassVar[dict] = {  # jaxgen.cache.sharding
        **{name: HEADS_MAJOR_AXES for name in ("kq", "vq", "k_scale", "v_scale", "rk", "rv")},
        "rpos": ("layer", "batch", "slot"), "length": ("batch",)}

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, nbits: int = 8, group_size: int | None = None,
             residual_length: int = 0, rollback_slack: int = 0,
             rotate: bool = True) -> "QuantizedKVCache":
        if nbits not in QMAX:
            raise ValueError(f"nbits={nbits!r} is not supported (allowed: 8, 4)")
        if (group_size and head_dim % group_size) or (nbits == 4 and head_dim % 2):
            raise ValueError(f"q_group_size={group_size} must divide head_dim={head_dim} "
                             f"(and head_dim must be even for nbits=4)")
        lead = (num_layers, batch, num_kv_heads, max_len)
        code_dim = head_dim if nbits == 8 else head_dim // 2
        code_dtype = jnp.int8 if nbits == 8 else jnp.uint8
        key_groups, value_groups = default_groups(head_dim, group_size)
        rk = rv = rpos = None
        if residual_length > 0:
            slots = min(int(max_len), int(residual_length) + int(rollback_slack))
            ring = (num_layers, batch, num_kv_heads, slots, head_dim)
            rk, rv = jnp.zeros(ring, dtype), jnp.zeros(ring, dtype)
            rpos = jnp.full((num_layers, batch, slots), -1, jnp.int32)
        return cls(kq=jnp.zeros(lead + (code_dim,), code_dtype),
                   vq=jnp.zeros(lead + (code_dim,), code_dtype),
                   k_scale=jnp.zeros(lead + (key_groups,), dtype),
                   v_scale=jnp.zeros(lead + (value_groups,), dtype),
                   rk=rk, rv=rv, rpos=rpos, length=jnp.zeros((batch,), jnp.int32),
                   nbits=int(nbits), residual_length=int(residual_length),
                   rotate=bool(rotate) and hadamard(head_dim) is not None)

    # ------------------------------------------------------------------ shapes
    @property
    def max_len(self) -> int:
        return stored_shape(self.kq)[3]

    @property
    def batch(self) -> int:
        return stored_shape(self.kq)[1]

    @property
    def dtype(self):
        return stored_dtype(self.k_scale)

    def nbytes(self) -> int:
        return cache_nbytes(self)

    # ------------------------------------------------------------------ writes
    @property
    def rotation(self) -> jax.Array | None:
        """[Dh, Dh] the Hadamard matrix R the codes are taken in (None: no rotation)."""
        return jnp.asarray(hadamard(self.head_dim)) if self.rotate else None

    @property
    def head_dim(self) -> int:
        return stored_shape(self.kq)[-1] * (2 if self.nbits == 4 else 1)

    def _rotated(self, x: jax.Array) -> jax.Array:
        """New K or V [B, S, Hkv, Dh] -> heads-major float32 [B, Hkv, S, Dh], times R."""
        x = heads_major(x).astype(jnp.float32)  # [B, Hkv, S, Dh]
        return x if not self.rotate else x @ self.rotation  # [B, Hkv, S, Dh]

    def _write_codes(self, layer, k_new, v_new, positions) -> "QuantizedKVCache":
        key_groups, value_groups = stored_shape(self.k_scale)[-1], stored_shape(self.v_scale)[-1]
        kq, ks = quantize(self._rotated(k_new), self.nbits, key_groups, self.dtype)  # [B,Hkv,S,*]
        vq, vs = quantize(self._rotated(v_new), self.nbits, value_groups, self.dtype)
        put = lambda buf, new: scatter_heads_major(buf, new, positions, layer)  # noqa: E731
        return dataclasses.replace(self, kq=put(self.kq, kq), vq=put(self.vq, vq),
                                   k_scale=put(self.k_scale, ks), v_scale=put(self.v_scale, vs))

    def _write_ring(self, layer, k_new, v_new, positions) -> "QuantizedKVCache":
        if self.rk is None:
            return self
        rk, rv, rpos = ring_write(self.rk, self.rv, self.rpos, layer, k_new, v_new, positions)
        return dataclasses.replace(self, rk=rk, rv=rv, rpos=rpos)

    def update(self, layer, k_new, v_new, positions) -> "QuantizedKVCache":
        """Quantizes and writes one layer's new K/V [B, S, Hkv, Dh] at positions [B, S]."""
        return self._write_codes(layer, k_new, v_new, positions)._write_ring(
            layer, k_new, v_new, positions)

    # ------------------------------------------------------------------ reads
    def _codes_block(self, layer, bypass=None) -> KeyBlock:
        kq, vq = self.kq[layer], self.vq[layer]  # [B, Hkv, T, *]
        return KeyBlock(k=kq, v=vq, positions=jnp.arange(self.max_len, dtype=jnp.int32),
                        k_scale=self.k_scale[layer], v_scale=self.v_scale[layer],
                        min_age=self.residual_length, bypass=bypass, rotation=self.rotation,
                        unpack=unpack4 if self.nbits == 4 else None)  # codes, never scaled

    def _in_ring(self, layer) -> jax.Array:
        """bool [B, T]: key j has its full-precision copy in the residual ring."""
        rpos = self.rpos[layer]  # [B, S]
        j = jnp.arange(self.max_len, dtype=jnp.int32)  # [T]
        return jnp.take(rpos, j % rpos.shape[1], axis=1) == j[None]  # [B, T]

    def attend(self, layer, q, q_positions, *, scale: float, window: int | None = None,
               softcap: float | None = None):
        """Attention over this layer: int8 codes for old keys, the ring for recent ones."""
        if self.rk is None:
            return attend_blocks(q, q_positions, [self._codes_block(layer)], scale=scale,
                                 window=window, softcap=softcap)
        codes = self._codes_block(layer, bypass=~self._in_ring(layer))
        ring = KeyBlock(k=self.rk[layer], v=self.rv[layer], positions=self.rpos[layer],
                        max_age=self.residual_length)
        return attend_blocks(q, q_positions, [codes, ring], scale=scale, window=window,
                             softcap=softcap)

    def update_attend(self, layer, q, k_new, v_new, positions, *, scale: float,
                      window: int | None = None, softcap: float | None = None):
        """Writes the codes, attends (the chunk's recent keys in full precision), then
        writes the residual ring. Returns (out, cache)."""
        cache = self._write_codes(layer, k_new, v_new, positions)
        if cache.rk is None:
            out = attend_blocks(q, positions, [cache._codes_block(layer)], scale=scale,
                                window=window, softcap=softcap)
            return out, cache
        start, last = positions[:, :1], positions[:, -1:]  # [B, 1]
        j = jnp.arange(cache.max_len, dtype=jnp.int32)[None]  # [1, T]
        in_chunk = (j >= start) & (j <= last)  # [B, T]
        in_old_ring = cache._in_ring(layer) & (j < start)  # [B, T]
        rpos = cache.rpos[layer]  # [B, S]
        blocks = [cache._codes_block(layer, bypass=~(in_chunk | in_old_ring)),
                  KeyBlock(k=cache.rk[layer], v=cache.rv[layer], positions=rpos,
                           valid=rpos < start, max_age=cache.residual_length),
                  KeyBlock(k=heads_major(k_new), v=heads_major(v_new), positions=positions,
                           max_age=cache.residual_length)]
        out = attend_blocks(q, positions, blocks, scale=scale, window=window, softcap=softcap)
        return out, cache._write_ring(layer, k_new, v_new, positions)

    # ------------------------------------------------------------------ length
    def with_length(self, length: jax.Array) -> "QuantizedKVCache":
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def max_rollback(self) -> jax.Array:
        """int32 [B]: every row can roll back all its tokens (past the residual slack the
        rolled-back window reads int8 codes instead of full precision)."""
        return self.length

    def rollback(self, n) -> "QuantizedKVCache":
        """Forgets the last n[B] positions of each row (no copy); checked outside jit."""
        return rollback_by_length(self, n)

    def resize(self, max_len: int) -> "QuantizedKVCache":
        """A copy with T = max_len (the codes and scales grow with zeros, or are cropped)."""
        return dataclasses.replace(self, kq=fit_time(self.kq, max_len),
                                   vq=fit_time(self.vq, max_len),
                                   k_scale=fit_time(self.k_scale, max_len),
                                   v_scale=fit_time(self.v_scale, max_len))
