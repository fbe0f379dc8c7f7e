"""The one attention kernel every cache kind reads through.

A cache hands the kernel one or more *key blocks*; their scores are concatenated along the
key axis, soft-maxed together (fp32) and each block contributes its share of the output.
A block is dense (float keys/values) or quantized (int8 codes with per-token, per-head
(per-group) scales). Quantized blocks are never dequantized: the query-key products are
scaled by the key scales, and the attention weights by the value scales:

    score[j] = (q . kq[j]) * k_scale[j] * scale          (per group, summed over groups)
    out      = sum_j (w[j] * v_scale[j]) * vq[j]

Visibility of key j (at absolute position pos[j]) to a query at position p, with
age = p - pos[j]:

    pos[j] >= 0 and age >= 0                          (causal; -1 marks an empty slot)
    age < window                                      (sliding-window models, Mistral)
    min_age <= age < max_age  (or `bypass[j]`)        (int8 cache with a full-precision
                                                       residual window: recent keys come from
                                                       the residual block, older ones from the
                                                       int8 block)
    valid[j]                                          (block-specific, e.g. "older than the
                                                       chunk being written")

Example:
    >>> q = jnp.ones((1, 1, 2, 4)); k = v = jnp.ones((1, 3, 1, 4))
    >>> blk = KeyBlock(k=k, v=v, positions=jnp.arange(3))
    >>> attend_blocks(q, jnp.array([[2]]), [blk], scale=0.5).shape
    (1, 1, 2, 4)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KeyBlock:
    """One block of keys/values for `attend_blocks` (not a PyTree; built inside a trace).

    k, v: [B, Tk, Hkv, Dh] float, or int8 codes [B, Tk, Hkv, Dh] with k_scale / v_scale
    [B, Tk, Hkv, N] (N groups along Dh). positions: int32 [B, Tk] or [Tk] (-1 = empty).
    heads_major: dense k, v are stored [B, Hkv, Tk, Dh] instead (no transpose needed).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    valid: jax.Array | None = None  # bool [B, Tk]
    min_age: int = 0
    max_age: int | None = None
    bypass: jax.Array | None = None  # bool [B, Tk]: visible at any age >= 0 (min/max_age ignored)
    heads_major: bool = False

    @property
    def num_keys(self) -> int:
        return self.k.shape[2 if self.heads_major else 1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1 if self.heads_major else 2]


def _visible(block: KeyBlock, q_positions: jax.Array, window: int | None) -> jax.Array:
    """bool [B, S, Tk]."""
    positions = block.positions
    if positions.ndim == 1:
        positions = positions[None]  # [1, Tk]
    age = q_positions[:, :, None] - positions[:, None, :]  # [B, S, Tk]
    visible = (age >= 0) & (positions[:, None, :] >= 0)  # [B, S, Tk]
    if window is not None:
        visible &= age < window
    band = age >= block.min_age if block.min_age > 0 else None
    if block.max_age is not None:
        upper = age < block.max_age
        band = upper if band is None else band & upper
    if band is not None:
        if block.bypass is not None:
            band |= block.bypass[:, None, :]
        visible &= band
    if block.valid is not None:
        visible &= block.valid[:, None, :]
    return visible


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with a float32 result. fp32 inputs accumulate in fp32; narrower inputs multiply
    in their own dtype (as HF does for bf16 models) and are widened after, since XLA:CPU has
    no bf16 x bf16 -> f32 kernel for every shape."""
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b).astype(jnp.float32)


def _scores(q_grouped: jax.Array, block: KeyBlock) -> jax.Array:
    """q_grouped [B, S, Hkv, G, Dh] -> scores [B, Hkv, G, S, Tk] float32 (unscaled)."""
    if block.k_scale is None:
        k = block.k.astype(q_grouped.dtype)  # [B, Hkv, Tk, Dh] or [B, Tk, Hkv, Dh]
        k = k if block.heads_major else jnp.swapaxes(k, 1, 2)  # [B, Hkv, Tk, Dh]
        return _einsum_f32("bshgd,bhtd->bhgst", q_grouped, k)  # [B, Hkv, G, S, Tk]
    batch, seq, kv_heads, group, head_dim = q_grouped.shape
    groups = block.k_scale.shape[-1]
    codes = block.k.astype(q_grouped.dtype)  # [B, Tk, Hkv, Dh] (int8 codes, not dequantized)
    k_scale = jnp.transpose(block.k_scale, (0, 2, 3, 1)).astype(jnp.float32)  # [B, Hkv, N, Tk]
    if groups == 1:
        raw = _einsum_f32("bshgd,bthd->bhgst", q_grouped, codes)  # [B, Hkv, G, S, Tk]
        return raw * k_scale[:, :, None, 0, None, :]  # [B, Hkv, G, S, Tk]
    qn = q_grouped.reshape(batch, seq, kv_heads, group, groups, head_dim // groups)
    kn = codes.reshape(codes.shape[0], codes.shape[1], kv_heads, groups, head_dim // groups)
    raw = _einsum_f32("bshgnd,bthnd->bhgnst", qn, kn)  # [B, Hkv, G, N, S, Tk]
    return jnp.sum(raw * k_scale[:, :, None, :, None, :], axis=3)  # [B, Hkv, G, S, Tk]


def _values(weights: jax.Array, block: KeyBlock, out_dtype) -> jax.Array:
    """weights [B, Hkv, G, S, Tk] f32 -> [B, S, Hkv, G, Dh] float32."""
    if block.v_scale is None:
        v = block.v if block.heads_major else jnp.swapaxes(block.v, 1, 2)  # [B, Hkv, Tk, Dh]
        probs = weights.astype(block.v.dtype)  # [B, Hkv, G, S, Tk]
        return _einsum_f32("bhgst,bhtd->bshgd", probs, v)  # [B, S, Hkv, G, Dh]
    batch, tk, kv_heads, head_dim = block.v.shape
    groups = block.v_scale.shape[-1]
    codes = block.v.astype(out_dtype)  # [B, Tk, Hkv, Dh]
    v_scale = jnp.transpose(block.v_scale, (0, 2, 3, 1)).astype(jnp.float32)  # [B, Hkv, N, Tk]
    if groups == 1:
        scaled = (weights * v_scale[:, :, None, 0, None, :]).astype(out_dtype)  # [B,Hkv,G,S,Tk]
        return _einsum_f32("bhgst,bthd->bshgd", scaled, codes)  # [B, S, Hkv, G, Dh]
    scaled = (weights[:, :, :, None] * v_scale[:, :, None, :, None, :]
              ).astype(out_dtype)  # [B, Hkv, G, N, S, Tk]
    vn = codes.reshape(batch, tk, kv_heads, groups, head_dim // groups)  # [B, Tk, Hkv, N, Dg]
    out = _einsum_f32("bhgnst,bthnd->bshgnd", scaled, vn)  # [B, S, Hkv, G, N, Dg]
    return out.reshape(out.shape[:4] + (head_dim,))  # [B, S, Hkv, G, Dh]


def attend_blocks(q: jax.Array, q_positions: jax.Array, blocks: Sequence[KeyBlock], *,
                  scale: float, window: int | None = None) -> jax.Array:
    """Grouped-query attention of q [B, S, H, Dh] over the union of `blocks`.

    q_positions: int32 [B, S]. Returns [B, S, H, Dh] in q's dtype. Softmax in fp32 over
    every block's keys at once.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = blocks[0].num_kv_heads
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(batch, seq, num_kv_heads, group, head_dim)  # [B, S, Hkv, G, Dh]
    parts = []
    for block in blocks:
        scores = _scores(q_grouped, block) * scale  # [B, Hkv, G, S, Tk]
        visible = _visible(block, q_positions, window)  # [B, S, Tk]
        parts.append(jnp.where(visible[:, None, None], scores, -jnp.inf))
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)  # [B,Hkv,G,S,ΣT]
    weights = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, G, S, ΣTk]
    out = None
    start = 0
    for block in blocks:
        size = block.num_keys
        part = weights if len(blocks) == 1 else weights[..., start:start + size]
        contribution = _values(part, block, q.dtype)  # [B, S, Hkv, G, Dh]
        out = contribution if out is None else out + contribution
        start += size
    return out.reshape(batch, seq, num_heads, head_dim).astype(q.dtype)
