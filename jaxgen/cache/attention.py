"""The one attention kernel every cache kind reads through.

A cache hands the kernel one or more *key blocks*; their scores are concatenated along the
key axis, soft-maxed together (fp32) and each block contributes its share of the output.
A block is dense (float keys/values) or quantized (int8 codes with per-token, per-head
(per-group) scales). Blocks are heads-major, [B, Hkv, Tk, Dh]: each (row, head) holds its keys
as one contiguous [Tk, Dh] matrix. Quantized blocks are never dequantized: the query-key products are
scaled by the key scales, and the attention weights by the value scales:

    score[j] = (q . kq[j]) * k_scale[j] * scale          (per group, summed over groups)
    out      = sum_j (w[j] * v_scale[j]) * vq[j]

A quantized block may hold the codes of rotated keys / values, k R and v R (R orthogonal,
`rotation`; the int8 cache uses a Hadamard matrix to spread outlier channels): the kernel then
rotates the query instead, (q R) . (k R) = q . k, and rotates the block's output back by R^T.

The products are batched over (row, kv head) with the G query heads of a group and the S
query positions folded into the rows of one matmul, [G*S, Dh] x [Dh, Tk]: on CPU this is one
matmul per (row, head) instead of G*S matrix-vector products (5x faster at batch 8).

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

Example (one query head group of 2 over 3 cached keys; every key is visible at position 2):
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache.attention import KeyBlock, attend_blocks
    >>> q = jnp.ones((1, 1, 2, 4))                       # [B, S, H, Dh]
    >>> k = jnp.ones((1, 1, 3, 4))                       # [B, Hkv, Tk, Dh]
    >>> v = jnp.arange(3.0)[None, None, :, None] * jnp.ones((1, 1, 3, 4))
    >>> block = KeyBlock(k=k, v=v, positions=jnp.arange(3))
    >>> out = attend_blocks(q, jnp.array([[2]]), [block], scale=0.5)
    >>> out.shape, float(out[0, 0, 0, 0])                # equal scores: the mean of 0, 1, 2
    ((1, 1, 2, 4), 1.0)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KeyBlock:
    """One block of keys/values for `attend_blocks` (not a PyTree; built inside a trace).

    k, v: [B, Hkv, Tk, Dh] float, or int8 codes with k_scale / v_scale [B, Hkv, Tk, N]
    (N groups along Dh). positions: int32 [B, Tk] or [Tk] (-1 = empty).
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
    rotation: jax.Array | None = None  # [Dh, Dh] orthogonal R: k and v hold k R and v R

    @property
    def num_keys(self) -> int:
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]


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


def _matmul_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int], batch: int) -> jax.Array:
    """dot_general over the leading `batch` axes of a and b, contracting a's axis contract[0]
    with b's axis contract[1]; float32 result. fp32 inputs accumulate in fp32; narrower inputs
    multiply in their own dtype (as HF does for bf16 models) and are widened after, since
    XLA:CPU has no bf16 x bf16 -> f32 kernel for every shape."""
    dims = (((contract[0],), (contract[1],)), (tuple(range(batch)), tuple(range(batch))))
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(a, b.astype(a.dtype), dims).astype(jnp.float32)


def _scores(q_rows: jax.Array, block: KeyBlock) -> jax.Array:
    """q_rows [B, Hkv, R, Dh] (R = G*S) -> scores [B, Hkv, R, Tk] float32 (unscaled)."""
    if block.k_scale is None:
        return _matmul_f32(q_rows, block.k, (3, 3), batch=2)  # [B, Hkv, R, Tk]
    batch, kv_heads, rows, head_dim = q_rows.shape
    groups = block.k_scale.shape[-1]
    codes = block.k.astype(q_rows.dtype)  # [B, Hkv, Tk, Dh] (int8 codes, not dequantized)
    k_scale = block.k_scale.astype(jnp.float32)  # [B, Hkv, Tk, N]
    if groups == 1:
        raw = _matmul_f32(q_rows, codes, (3, 3), batch=2)  # [B, Hkv, R, Tk]
        return raw * k_scale[:, :, None, :, 0]  # [B, Hkv, R, Tk]
    tk = codes.shape[2]
    qn = q_rows.reshape(batch, kv_heads, rows, groups, head_dim // groups)
    kn = codes.reshape(batch, kv_heads, tk, groups, head_dim // groups)
    qn, kn = jnp.moveaxis(qn, 3, 2), jnp.moveaxis(kn, 3, 2)  # [B, Hkv, N, R|Tk, Dg]
    raw = _matmul_f32(qn, kn, (4, 4), batch=3)  # [B, Hkv, N, R, Tk]
    scale = jnp.moveaxis(k_scale, 3, 2)[:, :, :, None, :]  # [B, Hkv, N, 1, Tk]
    return jnp.sum(raw * scale, axis=2)  # [B, Hkv, R, Tk]


def _values(weights: jax.Array, block: KeyBlock, out_dtype) -> jax.Array:
    """weights [B, Hkv, R, Tk] f32 -> [B, Hkv, R, Dh] float32."""
    if block.v_scale is None:
        return _matmul_f32(weights.astype(block.v.dtype), block.v, (3, 2), batch=2)
    batch, kv_heads, tk, head_dim = block.v.shape
    groups = block.v_scale.shape[-1]
    codes = block.v.astype(out_dtype)  # [B, Hkv, Tk, Dh]
    v_scale = block.v_scale.astype(jnp.float32)  # [B, Hkv, Tk, N]
    if groups == 1:
        scaled = (weights * v_scale[:, :, None, :, 0]).astype(out_dtype)  # [B, Hkv, R, Tk]
        return _matmul_f32(scaled, codes, (3, 2), batch=2)  # [B, Hkv, R, Dh]
    scale = jnp.moveaxis(v_scale, 3, 2)[:, :, :, None, :]  # [B, Hkv, N, 1, Tk]
    scaled = (weights[:, :, None] * scale).astype(out_dtype)  # [B, Hkv, N, R, Tk]
    vn = jnp.moveaxis(codes.reshape(batch, kv_heads, tk, groups, head_dim // groups), 3, 2)
    out = _matmul_f32(scaled, vn, (4, 3), batch=3)  # [B, Hkv, N, R, Dg]
    out = jnp.moveaxis(out, 2, 3)  # [B, Hkv, R, N, Dg]
    return out.reshape(out.shape[:3] + (head_dim,))  # [B, Hkv, R, Dh]


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
    q_rows = jnp.transpose(q_grouped, (0, 2, 3, 1, 4)).reshape(
        batch, num_kv_heads, group * seq, head_dim)  # [B, Hkv, G*S, Dh]
    parts = []
    for block in blocks:
        rows = q_rows if block.rotation is None else q_rows @ block.rotation.astype(q.dtype)
        scores = _scores(rows, block) * scale  # [B, Hkv, G*S, Tk]
        visible = _visible(block, q_positions, window)  # [B, S, Tk]
        visible = jnp.broadcast_to(visible[:, None], (batch, group) + visible.shape[1:])
        visible = visible.reshape(batch, 1, group * seq, -1)  # [B, 1, G*S, Tk]
        parts.append(jnp.where(visible, scores, -jnp.inf))
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)  # [B,Hkv,R,ΣTk]
    weights = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, G*S, ΣTk]
    out = None
    start = 0
    for block in blocks:
        size = block.num_keys
        part = weights if len(blocks) == 1 else weights[..., start:start + size]
        contribution = _values(part, block, q.dtype)  # [B, Hkv, G*S, Dh]
        if block.rotation is not None:
            contribution = contribution @ block.rotation.T  # [B, Hkv, G*S, Dh] (float32)
        out = contribution if out is None else out + contribution
        start += size
    out = out.reshape(batch, num_kv_heads, group, seq, head_dim)  # [B, Hkv, G, S, Dh]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, seq, num_heads, head_dim
                                                       ).astype(q.dtype)
