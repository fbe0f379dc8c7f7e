"""The verification core: vectorized acceptance masks for speculative decoding.

Every row b of a batch proposes k_row[b] <= K draft tokens; the target scores all K + 1
positions in one forward. Nothing here loops over rows or positions in Python:

    drafts  int32   [B, K]        proposed tokens (entries at i >= k_row are ignored)
    p       float32 [B, K+1, V]   target *processed* scores, position i predicts draft i
    q       float32 [B, K, V]     draft processed scores the drafts were drawn from, or None
                                  for a deterministic drafter (one-hot q, e.g. prompt lookup)

    greedy    acc_i = d_i == argmax p_i                    ensemble: argmax(w*P_i + (1-w)*Q_i)
    sampling  acc_i = u_i * Q_i(d_i) <= V_i(d_i) and V_i(d_i) > 0,
              V = P (lossless) or V = w*P + (1-w)*Q (static ensemble, lossy by design)
    n         = sum(cumprod(acc & (i < k_row)))            accepted drafts per row, 0..k_row
    fix       = n == k_row ? draw(P_n) : draw(norm(max(P_n - Q_n, 0)))     (greedy: argmax)
    out       = where(i < n, d_i, where(i == n, fix, pad))                 [B, K+1]

(P, Q: softmax of the scores.) With V = P this is the rejection sampler of Leviathan et al.
(2023): the emitted token at every position follows P exactly. With the ensemble weight w,
the first emitted token follows V = w*P + (1-w)*Q (the residual max(V - Q, 0) = w*max(P - Q, 0)
normalises to the same distribution as the lossless one) and the acceptance rate is
sum_x min(Q, V) = 1 - w * TV(P, Q).

Numerical edges: a residual that is (numerically) all zero (P == Q) falls back to P_n, so no
NaN can appear; Q(d) = 0 with V(d) > 0 always accepts; V(d) = 0 never accepts.

Example:
    >>> import jax.numpy as jnp
    >>> drafts = jnp.array([[1, 2]]); k_row = jnp.array([2])
    >>> p = jnp.log(jnp.array([[[0, 1., 0], [0, 1., 0], [1., 0, 0]]]))
    >>> n, fix = accept_greedy(drafts, k_row, p)
    >>> int(n[0]), int(fix[0])     # d_0 = 1 matches, d_1 = 2 does not: correction argmax p_1 = 1
    (1, 1)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.logits.sampling import sample_rows

_TINY = float(jnp.finfo(jnp.float32).tiny)


def accepted_count(acc: jax.Array, k_row: jax.Array) -> jax.Array:
    """acc bool [B, K], k_row int32 [B] -> n int32 [B]: length of the accepted prefix."""
    K = acc.shape[1]
    live = acc & (jnp.arange(K)[None, :] < k_row[:, None])  # [B, K]
    return jnp.sum(jnp.cumprod(live.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [B]


def _at(array: jax.Array, index: jax.Array) -> jax.Array:
    """array [B, S, ...] at per-row index [B] -> [B, ...]."""
    expanded = index.reshape(index.shape + (1,) * (array.ndim - 1))
    return jnp.take_along_axis(array, expanded, axis=1)[:, 0]


def _token_probs(probs: jax.Array, tokens: jax.Array) -> jax.Array:
    """probs [B, K, V] at tokens [B, K] -> [B, K]."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def accept_greedy(drafts: jax.Array, k_row: jax.Array, p_scores: jax.Array,
                  q_scores: jax.Array | None = None, weight=None
                  ) -> tuple[jax.Array, jax.Array]:
    """Greedy verification. Returns (n int32 [B], fix int32 [B]).

    drafts [B, K]; k_row [B]; p_scores [B, K+1, V]; q_scores [B, K, V] (needed with an
    ensemble `weight` w (scalar or [B]): the first K positions compare against
    argmax(w * P + (1 - w) * Q), as Hugging Face's greedy ensemble does).
    """
    K = drafts.shape[1]
    target = jnp.argmax(p_scores, axis=-1).astype(jnp.int32)  # [B, K+1]
    if weight is None:
        n = accepted_count(drafts == target[:, :K], k_row)  # [B]
        return n, _at(target, n)
    w = jnp.reshape(jnp.asarray(weight, jnp.float32), (-1, 1, 1))  # [B|1, 1, 1]
    mix = (w * jax.nn.softmax(p_scores[:, :K], axis=-1)
           + (1.0 - w) * jax.nn.softmax(q_scores, axis=-1))  # [B, K, V]
    chosen = jnp.argmax(mix, axis=-1).astype(jnp.int32)  # [B, K]
    n = accepted_count(drafts == chosen, k_row)  # [B]
    corrected = _at(jnp.concatenate([chosen, target[:, K:]], axis=1), n)  # [B]
    bonus = _at(target, n)  # [B]
    return n, jnp.where(n < k_row, corrected, bonus)


def accept_sample(drafts: jax.Array, k_row: jax.Array, p_scores: jax.Array,
                  q_scores: jax.Array | None, uniforms: jax.Array, fix_keys: jax.Array,
                  weight=None) -> tuple[jax.Array, jax.Array]:
    """Speculative (rejection) sampling. Returns (n int32 [B], fix int32 [B]).

    drafts [B, K]; k_row [B]; p_scores [B, K+1, V]; q_scores [B, K, V] or None (one-hot q);
    uniforms float32 [B, K] in [0, 1); fix_keys: one PRNG key per row [B] for the correction
    or bonus draw; weight: ensemble weight w (scalar or [B]) or None (lossless).
    """
    batch, K = drafts.shape
    p = jax.nn.softmax(p_scores, axis=-1)  # [B, K+1, V]
    p_d = _token_probs(p[:, :K], drafts)  # [B, K]
    if q_scores is None:
        q_d = jnp.ones_like(p_d)  # [B, K] one-hot drafter: Q(d) = 1
    else:
        q = jax.nn.softmax(q_scores, axis=-1)  # [B, K, V]
        q_d = _token_probs(q, drafts)  # [B, K]
    if weight is None:
        v_d = p_d
    else:
        w = jnp.reshape(jnp.asarray(weight, jnp.float32), (-1, 1))  # [B|1, 1]
        v_d = w * p_d + (1.0 - w) * q_d  # [B, K]
    acc = (uniforms * q_d <= v_d) & (v_d > 0)  # [B, K]
    n = accepted_count(acc, k_row)  # [B]

    p_n = _at(p, n)  # [B, V]
    if q_scores is None:
        d_n = _at(jnp.concatenate([drafts, drafts[:, :1]], axis=1), n)  # [B]
        q_n = jax.nn.one_hot(d_n, p.shape[-1], dtype=p.dtype)  # [B, V]
    else:
        q_n = _at(jnp.concatenate([q, q[:, :1]], axis=1), n)  # [B, V] (index K unused)
    residual = jnp.maximum(p_n - q_n, 0.0)  # [B, V]
    total = jnp.sum(residual, axis=-1, keepdims=True)  # [B, 1]
    degenerate = total <= _TINY  # P_n == Q_n numerically: rejection had probability ~0
    residual = jnp.where(degenerate, p_n, residual / jnp.where(degenerate, 1.0, total))
    target = jnp.where((n < k_row)[:, None], residual, p_n)  # [B, V]
    logits = jnp.where(target > 0, jnp.log(jnp.where(target > 0, target, 1.0)), -jnp.inf)
    fix = sample_rows(logits, fix_keys)  # [B]
    return n, fix


def assemble(drafts: jax.Array, n: jax.Array, fix: jax.Array, pad_id: int) -> jax.Array:
    """out int32 [B, K+1]: the accepted drafts, then the correction / bonus token, then pad."""
    batch, K = drafts.shape
    index = jnp.arange(K + 1)[None, :]  # [1, K+1]
    extended = jnp.concatenate([drafts, jnp.full((batch, 1), pad_id, drafts.dtype)], axis=1)
    return jnp.where(index < n[:, None], extended,
                     jnp.where(index == n[:, None], fix[:, None], pad_id)).astype(jnp.int32)
