"""Multi-head latent attention (MLA), as transformers' DeepseekV3Attention computes it, in the
absorbed form over the latent cache (jaxgen/cache/latent.py).

Per token (H heads, N = qk_nope_head_dim, P = qk_rope_head_dim, V = v_head_dim,
R = kv_lora_rank, Rq = q_lora_rank):

    q            = q_b(q_a_norm(q_a(x)))  (or q_proj(x) when q_lora_rank is None)  [H, N + P]
    c_kv ; k_pe  = kv_a_proj_with_mqa(x)                                  [R + P]
    c_kv         = kv_a_norm(c_kv)         the latent the cache holds     [R]
    q_pe, k_pe   = RoPE(q_pe), RoPE(k_pe)  k_pe shared by every head     [H, P], [P]
    kv_b(c_kv)   = per head: k_nope [N], value [V]  (kv_b_proj: W_uk [R, H, N], W_uv [R, H, V])
    score_h(j)   = (q_nope_h . k_nope_h(j) + q_pe_h . k_pe(j)) * softmax_scale
    out          = o_proj(concat_h sum_j softmax(score_h)(j) value_h(j))

Absorbed form (what this module runs): q_nope_h . (W_uk_h^T c) = (W_uk_h q_nope_h) . c, so
each head's query becomes [W_uk_h q_nope_h ; q_pe_h] (R + P numbers) and scores the cached
[c_kv ; k_pe] directly; the weighted sum of c_kv is lifted to the head's value space by W_uv
after the softmax. Chosen over expanding K/V from the latent at every step because a decode
step then reads only the latent (R + P numbers per cached token, not H * (N + P + V)) and
never materialises per-head keys: faster at long contexts, and the same math (float rounding
aside).

RoPE: the rotary half uses `rope_interleave` (DeepSeek's checkpoints: pairs (x0, x1), (x2, x3)
.. each rotated by one frequency; transformers de-interleaves them to [evens ; odds] before the
usual rotate-half); "yarn" `rope_parameters` (DeepSeek-V3's context extension) scale the
frequencies, multiply cos / sin by the attention factor, and fold mscale(factor,
mscale_all_dim)^2 into the softmax scale (transformers' yarn_apply_mscale).

Params of one layer (`mla_shapes`, no layer axis; a family stacks them on axis 0):

    wq_a [D, Rq]  q_a_norm [Rq]  wq_b [Rq, H*(N+P)]      (q_lora_rank set; bq_a [Rq] with
    wq [D, H*(N+P)]                                       attention_bias) (q_lora_rank None)
    wkv_a [D, R+P]  (bkv_a [R+P])  kv_a_norm [R]  wkv_b [R, H*(N+V)]
    wo [H*V, D]  (bo [D])

Example:
    >>> import types
    >>> from jaxgen.cache.latent import LatentCache
    >>> cfg = types.SimpleNamespace(hidden_size=16, num_heads=2, q_lora_rank=None,
    ...     kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
    ...     attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
    ...     rope_interleave=True, max_position_embeddings=64)
    >>> p = {k: jnp.full(s, 0.1) for k, s in mla_shapes(cfg).items()}
    >>> cache = LatentCache.init(num_layers=1, batch=1, max_len=8, kv_lora_rank=8, rope_dim=4)
    >>> positions = jnp.arange(3)[None]                               # [B, S]
    >>> cos, sin = rope_cos_sin(positions, cfg, jnp.float32)          # [B, S, P] each
    >>> out, cache = mla_attention(p, jnp.ones((1, 3, 16)), 0, positions, cos, sin, cache, cfg)
    >>> out.shape, cache.c_kv.shape                                   # [B, S, D], [L, B, T, R]
    ((1, 3, 16), (1, 1, 8, 8))
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models import rope as rope_lib
from jaxgen.models.norms import rms_norm

__all__ = ["ROPE_TYPES", "expanded_kv_bytes_per_token", "latent_bytes_per_token",
           "mla_attention", "mla_shapes", "rope_cos_sin", "softmax_scale", "yarn_inv_freq"]

# rope_type values MLA runs: rope.py's, plus YaRN (DeepSeek-V3's own)
ROPE_TYPES = (*rope_lib.ROPE_TYPES, "yarn")


def mla_shapes(config) -> dict:
    """One layer's attention parameter shapes (no layer axis): see the module docs."""
    d, h = config.hidden_size, config.num_heads
    n, p, v, r = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
                  config.kv_lora_rank)
    shapes = {"wkv_a": (d, r + p), "kv_a_norm": (r,), "wkv_b": (r, h * (n + v)),
              "wo": (h * v, d)}
    if config.q_lora_rank is None:
        shapes["wq"] = (d, h * (n + p))
    else:
        rq = config.q_lora_rank
        shapes.update(wq_a=(d, rq), q_a_norm=(rq,), wq_b=(rq, h * (n + p)))
        if config.attention_bias:
            shapes["bq_a"] = (rq,)
    if config.attention_bias:
        shapes.update(bkv_a=(r + p,), bo=(d,))
    return shapes


def latent_bytes_per_token(config, num_layers: int, dtype=jnp.float32) -> int:
    """Bytes the latent cache holds per position and row: L * (R + P) * itemsize."""
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return int(num_layers * width * jnp.dtype(dtype).itemsize)


def expanded_kv_bytes_per_token(config, num_layers: int, dtype=jnp.float32) -> int:
    """Bytes an expanded per-head K/V cache would hold per position and row (what
    transformers' eager attention builds): L * H * ((N + P) + V) * itemsize."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return int(num_layers * config.num_heads * per_head * jnp.dtype(dtype).itemsize)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's mscale: 0.1 * mscale * log(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(params: dict, max_position_embeddings: int) -> float:
    factor = params.get("factor")
    if factor is None:  # DeepSeek: the ratio of the two context lengths
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        factor = max_position_embeddings / original
    return float(factor)


def yarn_inv_freq(dim: int, theta: float, params: dict,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """YaRN's (inverse frequencies float32 [dim/2], attention factor), as transformers'
    _compute_yarn_parameters: frequencies interpolated by `factor` below the beta_slow
    rotations, kept above beta_fast, a linear ramp between."""
    factor = _yarn_factor(params, max_position_embeddings)
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs  # [dim/2]
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)  # [dim/2]
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)  # [dim/2]
    keep = np.float32(1.0) - ramp  # extrapolation's share
    freqs = interpolation * (1 - keep) + extrapolation * keep
    return freqs.astype(np.float32), float(attention)


def softmax_scale(config) -> float:
    """(N + P)^-0.5, times mscale(factor, mscale_all_dim)^2 when rope_parameters scale with
    `mscale_all_dim` (transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = dict(config.rope_scaling or ())
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = _yarn_factor(params, config.max_position_embeddings)
        scale *= _yarn_mscale(factor, params["mscale_all_dim"]) ** 2
    return scale


def rope_cos_sin(positions: jax.Array, config, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, P] in `dtype` for int positions [B, S] (cat(freqs, freqs); YaRN's
    attention factor applied)."""
    params = dict(config.rope_scaling or ())
    dim = config.qk_rope_head_dim
    if params.get("rope_type") != "yarn":
        return rope_lib.cos_sin(positions, dim, config.rope_theta, config.rope_scaling,
                                config.max_position_embeddings, dtype)
    freqs_table, attention = yarn_inv_freq(dim, config.rope_theta, params,
                                           config.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(freqs_table)  # [B, S, P/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, P]
    return (jnp.cos(emb) * attention).astype(dtype), (jnp.sin(emb) * attention).astype(dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """RoPE on x [B, S, N, P] with cos, sin [B, S, P]; interleaved pairs are de-interleaved to
    [evens ; odds] first (transformers' apply_rotary_pos_emb_interleave)."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)  # [B, S, N, P]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, S, N, P]
    return x * cos[:, :, None] + rotated * sin[:, :, None]  # [B, S, N, P]


def mla_attention(p: dict, h: jax.Array, layer, positions: jax.Array, cos: jax.Array,
                  sin: jax.Array, cache, config) -> tuple[jax.Array, object]:
    """One layer's attention on normed hidden states h [B, S, D] at `positions` [B, S]
    (cos, sin [B, S, P] from `rope_cos_sin`), writing the latent of layer `layer` into the
    latent cache. Returns (o_proj output [B, S, D], cache)."""
    batch, seq, _ = h.shape
    heads, n, r = config.num_heads, config.qk_nope_head_dim, config.kv_lora_rank
    eps = config.rms_norm_eps
    if "wq" in p:
        q = h @ p["wq"]  # [B, S, H*(N+P)]
    else:
        q_a = h @ p["wq_a"]  # [B, S, Rq]
        if "bq_a" in p:
            q_a = q_a + p["bq_a"]
        q = rms_norm(q_a, p["q_a_norm"], eps) @ p["wq_b"]  # [B, S, H*(N+P)]
    q = q.reshape(batch, seq, heads, -1)  # [B, S, H, N+P]
    q_nope, q_pe = q[..., :n], q[..., n:]  # [B, S, H, N], [B, S, H, P]
    kv = h @ p["wkv_a"]  # [B, S, R+P]
    if "bkv_a" in p:
        kv = kv + p["bkv_a"]
    c_kv = rms_norm(kv[..., :r], p["kv_a_norm"], eps)  # [B, S, R]
    k_pe = kv[..., r:]  # [B, S, P]
    interleave = bool(config.rope_interleave)
    q_pe = _rotate(q_pe, cos, sin, interleave)  # [B, S, H, P]
    k_pe = _rotate(k_pe[:, :, None], cos, sin, interleave)[:, :, 0]  # [B, S, P]
    wkv_b = p["wkv_b"].reshape(r, heads, -1)  # [R, H, N+V]
    w_uk, w_uv = wkv_b[..., :n], wkv_b[..., n:]  # [R, H, N], [R, H, V]
    q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)  # [B, S, H, R]
    query = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)  # [B,S,H,R+P]
    attended, cache = cache.update_attend(layer, query, c_kv, k_pe, positions,
                                          scale=softmax_scale(config))  # [B, S, H, R]
    values = jnp.einsum("bshr,rhv->bshv", attended, w_uv)  # [B, S, H, V]
    out = values.reshape(batch, seq, -1) @ p["wo"]  # [B, S, D]
    if "bo" in p:
        out = out + p["bo"]
    return out, cache
