"""Sampling warpers: temperature, top-k, top-p, min-p, top-H, typical-p, epsilon and eta.

Every function is a pure transform of scores [B, V] whose numeric parameter is a scalar or a
per-row [B] array (a traced value is fine: nothing here recompiles when it changes).

Top-k, top-p, min-p and typical-p have two implementations with identical masks up to ties:
- the default *search* path finds the cut-off by a binary search over the float32 bit
  patterns (32 passes over the vocabulary, no sort; t5x's trick);
- the *sort* path (`*_sorted`) mirrors Hugging Face's sort-based warpers step by step.
Top-H has one (HF's top-100 selection and running sum, ties split as HF splits them).

Neutral values are exact identities (temperature 1, top_k 0, top_p 1, min_p 0, typical_p 1,
epsilon 0, eta 0), so a vmapped sweep may include them. Top-H has none (HF's warper always
keeps at most its 100 most likely tokens): it runs whenever `top_h` is set.

Example:
    >>> logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    >>> top_k_filter(logits, jnp.int32(2))
    Array([[-inf,   3.,   2., -inf]], dtype=float32)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def per_row(value, batch: int, dtype=jnp.float32) -> jax.Array:
    """A scalar or [B] parameter as a [B, 1] column."""
    value = jnp.asarray(value, dtype)
    return jnp.broadcast_to(value.reshape(-1, 1), (batch, 1))  # [B, 1]


# ------------------------------------------------------------------ float-bit search
def _sortable_bits(x: jax.Array) -> jax.Array:
    """Maps float32 to int32 so that integer order equals float order (-inf < ... < inf)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, jnp.int32(-(2**31)) - bits - 1, bits)


def _bits_to_float(bits: jax.Array) -> jax.Array:
    raw = jnp.where(bits < 0, jnp.int32(-(2**31)) - bits - 1, bits)
    return jax.lax.bitcast_convert_type(raw, jnp.float32)


def search_threshold(batch: int, holds) -> jax.Array:
    """Largest float t (per row) such that `holds(t)` is true.

    holds: [B, 1] float -> [B] bool, monotone (true for small t, in particular at -inf).
    Returns t: [B, 1]. 32 bisection steps over the int32 images of the floats.
    """
    # Search between the images of -inf and +inf: the predicate must hold at -inf, and the
    # NaN bit patterns outside that range are never visited.
    low = jnp.full((batch,), _sortable_bits(jnp.float32(-jnp.inf)), jnp.int32)  # [B]
    high = jnp.full((batch,), _sortable_bits(jnp.float32(jnp.inf)), jnp.int32)  # [B]

    def body(_, bounds):
        low, high = bounds
        span = high.astype(jnp.uint32) - low.astype(jnp.uint32)  # [B], no int32 overflow
        mid = (low.astype(jnp.uint32) + (span >> 1) + (span & 1)).astype(jnp.int32)  # [B]
        ok = holds(_bits_to_float(mid)[:, None])  # [B]
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)

    low, _ = jax.lax.fori_loop(0, 32, body, (low, high))
    return _bits_to_float(low)[:, None]  # [B, 1]


def kth_largest(values: jax.Array, k) -> jax.Array:
    """The k-th largest value per row (k: int or [B, 1] int32, 1 <= k <= V), no sort. [B, 1]."""
    if isinstance(k, int) and k == 1:
        return jnp.max(values, axis=-1, keepdims=True)  # [B, 1]
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32).reshape(-1, 1), (values.shape[0], 1))
    search = lambda: search_threshold(  # noqa: E731
        values.shape[0], lambda t: jnp.sum(values >= t, axis=-1) >= k[:, 0])  # [B, 1]
    # every row k = 1 (a server's temperature-0 requests): the max, without 32 passes
    return jax.lax.cond(jnp.all(k <= 1), lambda: jnp.max(values, axis=-1, keepdims=True),
                        search)  # [B, 1]


def kth_largest_sorted(values: jax.Array, k) -> jax.Array:
    """Sort-path twin of `kth_largest`. [B, 1]."""
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32).reshape(-1, 1), (values.shape[0], 1))
    descending = -jnp.sort(-values, axis=-1)  # [B, V]
    return jnp.take_along_axis(descending, k - 1, axis=-1)  # [B, 1]


# ---------------------------------------------------------------------- temperature
def temperature_scale(scores: jax.Array, temperature) -> jax.Array:
    """HF TemperatureLogitsWarper: scores / temperature."""
    return scores / per_row(temperature, scores.shape[0])  # [B, V]


# ---------------------------------------------------------------------------- top-k
def _top_k_count(top_k, batch: int, vocab: int, min_tokens_to_keep: int) -> jax.Array:
    k = per_row(top_k, batch, jnp.int32)  # [B, 1]
    return jnp.where(k <= 0, vocab, jnp.clip(jnp.maximum(k, min_tokens_to_keep), 1, vocab))


def top_k_filter(scores: jax.Array, top_k, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopKLogitsWarper (search path): keep values >= the k-th largest; 0 disables."""
    batch, vocab = scores.shape
    k = _top_k_count(top_k, batch, vocab, min_tokens_to_keep)  # [B, 1]
    keep_top = lambda: jnp.where(scores >= kth_largest(scores, k), scores, NEG_INF)  # noqa: E731
    # no row filters (top_k 0 or >= the vocabulary everywhere): the scores as they are
    return jax.lax.cond(jnp.all(k >= vocab), lambda: scores, keep_top)  # [B, V]


def top_k_filter_sorted(scores: jax.Array, top_k, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopKLogitsWarper (exact sort path)."""
    batch, vocab = scores.shape
    kth = kth_largest_sorted(scores, _top_k_count(top_k, batch, vocab, min_tokens_to_keep))
    return jnp.where(scores < kth, NEG_INF, scores)  # [B, V]


# ---------------------------------------------------------------------------- top-p
def top_p_filter(scores: jax.Array, top_p, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopPLogitsWarper (search path).

    A token is kept iff the probability mass of the tokens strictly above it is < top_p
    (HF removes a token when the ascending cumulative mass up to it is <= 1 - top_p).
    """
    batch = scores.shape[0]
    p = per_row(top_p, batch)  # [B, 1]
    # no row filters (top_p = 1 everywhere): the scores as they are, without the search
    return jax.lax.cond(jnp.all(p >= 1.0), lambda: scores,
                        lambda: _top_p_search(scores, p, min_tokens_to_keep))  # [B, V]


def _top_p_search(scores: jax.Array, p: jax.Array, min_tokens_to_keep: int) -> jax.Array:
    """top_p_filter's bisection: p [B, 1]. [B, V]."""
    batch = scores.shape[0]
    probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
    # The cut-off is the smallest t with mass(x > t) < p; keeping x >= t keeps exactly the
    # tokens whose mass above is < p. The predicate holds for large t, so bisect over -t.
    above_mass = lambda t: jnp.sum(jnp.where(scores > t, probs, 0.0), axis=-1)  # noqa: E731
    threshold = -search_threshold(batch, lambda s: above_mass(-s) < p[:, 0])  # [B, 1]
    keep = (scores >= threshold) | (p >= 1.0)  # [B, V]; top_p = 1 is HF's "disabled"
    if min_tokens_to_keep > 1:
        keep |= scores >= kth_largest(scores, min_tokens_to_keep)
    return jnp.where(keep, scores, NEG_INF)  # [B, V]


def _scatter_rows(sorted_values: jax.Array, order: jax.Array) -> jax.Array:
    """Inverse of take_along_axis(x, order): values given in sorted order -> original order."""
    rows = jnp.arange(order.shape[0])[:, None]  # [B, 1]
    return jnp.zeros_like(sorted_values).at[rows, order].set(sorted_values)  # [B, V]


def top_p_filter_sorted(scores: jax.Array, top_p, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopPLogitsWarper (exact sort path, same arithmetic as HF)."""
    batch, vocab = scores.shape
    p = per_row(top_p, batch)  # [B, 1]
    order = jnp.argsort(scores, axis=-1, stable=True)  # [B, V] ascending
    ascending = jnp.take_along_axis(scores, order, axis=-1)  # [B, V]
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)  # [B, V]
    remove_sorted = (cumulative <= 1 - p) & (p < 1.0)  # [B, V]
    remove_sorted = remove_sorted.at[:, vocab - min_tokens_to_keep:].set(False)
    return jnp.where(_scatter_rows(remove_sorted, order), NEG_INF, scores)  # [B, V]


# ---------------------------------------------------------------------------- min-p
def min_p_filter(scores: jax.Array, min_p, min_tokens_to_keep: int = 1, *,
                 exact: bool = False) -> jax.Array:
    """HF MinPLogitsWarper: drop tokens with prob < min_p * max prob (no sort needed).

    min_tokens_to_keep > 1 keeps exactly that many tokens, ranked by their scores (not their
    probabilities, which can underflow to equal zeros) with ties broken by the lower index, as
    HF's argsort of the scores does; `exact` changes nothing here (both paths rank alike).
    """
    del exact
    probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
    top = jnp.max(probs, axis=-1, keepdims=True)  # [B, 1]
    remove = probs < per_row(min_p, scores.shape[0]) * top  # [B, V]
    if min_tokens_to_keep > 1:
        keep = min(int(min_tokens_to_keep), scores.shape[-1])
        _, best = jax.lax.top_k(scores, keep)  # [B, k]; equal scores: lower index first
        rows = jnp.arange(scores.shape[0])[:, None]
        remove = remove.at[rows, best].set(False)
    return jnp.where(remove, NEG_INF, scores)  # [B, V]


# ---------------------------------------------------------------------------- top-H
TOP_H_CANDIDATES = 100  # HF TopHLogitsWarper.top_n: only the 100 most likely tokens compete


def _entropy_terms(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """HF's top-H quantities over candidate scores [B, N] (-inf = not a candidate).

    Returns (terms [B, N], tau-less entropy [B, 1]): terms = -p log p with p the softmax of
    the candidates, NaN where p underflows to 0 (HF computes log(0) * 0 = NaN there, which
    removes that token and every later one); the entropy treats those terms as 0 (torch's
    Categorical.entropy clamps the log-probabilities).
    """
    logp = jax.nn.log_softmax(scores, axis=-1)  # [B, N]
    probs = jax.nn.softmax(scores, axis=-1)  # [B, N]
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1, keepdims=True)
    return -probs * jnp.log(probs), entropy  # [B, N], [B, 1]


def top_h_filter(scores: jax.Array, top_h) -> jax.Array:
    """HF TopHLogitsWarper, HF's arithmetic, on both paths: among the 100 most likely tokens
    in descending order (`lax.top_k`, a partial selection, not a sort; on XLA:CPU about 10x
    faster than a float-bit search over the vocabulary), keep the most likely one and every
    token whose running sum of -p log p (p renormalised over those 100) stays <= top_h *
    their entropy.

    Ties: HF walks tied tokens one by one, so a tie at the cut is split, keeping as many of
    them as fit; so does this (the kept scores are HF's, token for token in count). Which of
    the equal-scored ids are kept follows each library's top-k order among equals: the lowest
    ids here, torch.topk's implementation-defined order in HF.

    >>> top_h_filter(jnp.array([[3.0, 0.0, 2.0, -1.0]]), 0.9)
    Array([[  3., -inf,   2., -inf]], dtype=float32)
    >>> top_h_filter(jnp.array([[2.0, 1.0, 1.0, 1.0, 1.0]]), 0.6)  # one of the tied 1s fits
    Array([[  2.,   1., -inf, -inf, -inf]], dtype=float32)
    """
    batch, vocab = scores.shape
    top, index = jax.lax.top_k(scores, min(TOP_H_CANDIDATES, vocab))  # [B, N] descending
    terms, entropy = _entropy_terms(top)  # [B, N], [B, 1]
    tau = entropy * per_row(top_h, batch)  # [B, 1]
    keep_sorted = (jnp.cumsum(terms, axis=-1) <= tau).at[:, 0].set(True)  # [B, N]
    rows = jnp.arange(batch)[:, None]  # [B, 1]
    keep = jnp.zeros((batch, vocab), bool).at[rows, index].set(keep_sorted)  # [B, V]
    return jnp.where(keep, scores, NEG_INF)  # [B, V]


def top_h_filter_sorted(scores: jax.Array, top_h) -> jax.Array:
    """The `filter_impl="sort"` name of `top_h_filter` (one implementation serves both).

    >>> top_h_filter_sorted(jnp.array([[3.0, 0.0, 2.0, -1.0]]), 0.5)
    Array([[  3., -inf, -inf, -inf]], dtype=float32)
    """
    return top_h_filter(scores, top_h)


# ------------------------------------------------------------------------ typical-p
def _typical_shift(scores: jax.Array) -> jax.Array:
    """|-log p - H| per token (HF's "shifted scores"). [B, V]."""
    normalized = jax.nn.log_softmax(scores, axis=-1)  # [B, V]
    p = jnp.exp(normalized)  # [B, V]
    plogp = normalized * p  # [B, V]; -inf * 0 = nan, skipped like torch.nansum
    entropy = -jnp.sum(jnp.where(jnp.isnan(plogp), 0.0, plogp), axis=-1, keepdims=True)
    return jnp.abs(-normalized - entropy)  # [B, V]


def typical_filter(scores: jax.Array, mass, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TypicalLogitsWarper (search path).

    HF keeps the tokens whose shift is <= tau, where tau is the smallest shift value at which
    the mass of tokens with shift <= tau reaches `mass` (all tokens if it never does).
    """
    batch = scores.shape[0]
    m = per_row(mass, batch)  # [B, 1]
    shifted = _typical_shift(scores)  # [B, V]
    probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
    mass_upto = lambda t: jnp.sum(jnp.where(shifted <= t, probs, 0.0), axis=-1)  # noqa: E731
    tau = -search_threshold(batch, lambda u: mass_upto(-u) >= m[:, 0])  # [B, 1]
    keep = (shifted <= tau) | (m >= 1.0)  # [B, V]
    if min_tokens_to_keep > 1:
        keep |= -shifted >= kth_largest(-shifted, min_tokens_to_keep)
    return jnp.where(keep, scores, NEG_INF)  # [B, V]


def typical_filter_sorted(scores: jax.Array, mass, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TypicalLogitsWarper (exact sort path, same arithmetic as HF)."""
    batch, vocab = scores.shape
    m = per_row(mass, batch)  # [B, 1]
    shifted = _typical_shift(scores)  # [B, V]
    order = jnp.argsort(shifted, axis=-1, stable=True)  # [B, V] ascending shift
    sorted_shift = jnp.take_along_axis(shifted, order, axis=-1)  # [B, V]
    sorted_scores = jnp.take_along_axis(scores, order, axis=-1)  # [B, V]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_scores, axis=-1), axis=-1)  # [B, V]
    last = jnp.minimum(jnp.sum(cumulative < m, axis=-1, keepdims=True), vocab - 1)  # [B, 1]
    remove_sorted = sorted_shift > jnp.take_along_axis(sorted_shift, last, axis=-1)  # [B, V]
    remove_sorted = remove_sorted.at[:, :min_tokens_to_keep].set(False) & (m < 1.0)
    return jnp.where(_scatter_rows(remove_sorted, order), NEG_INF, scores)  # [B, V]


# ------------------------------------------------------------------ epsilon and eta
def epsilon_filter(scores: jax.Array, epsilon, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF EpsilonLogitsWarper: drop tokens with prob < epsilon (the top ones survive)."""
    probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
    remove = probs < per_row(epsilon, scores.shape[0])  # [B, V]
    remove &= scores < kth_largest(scores, min_tokens_to_keep)
    return jnp.where(remove, NEG_INF, scores)  # [B, V]


def eta_filter(scores: jax.Array, epsilon, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF EtaLogitsWarper: drop tokens with prob < min(eps, sqrt(eps) * exp(-entropy))."""
    eps = per_row(epsilon, scores.shape[0])  # [B, 1]
    logp = jax.nn.log_softmax(scores, axis=-1)  # [B, V]
    probs = jnp.exp(logp)  # [B, V]
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1, keepdims=True)
    eta = jnp.minimum(eps, jnp.sqrt(eps) * jnp.exp(-entropy))  # [B, 1]
    remove = (probs < eta) & (scores < kth_largest(scores, min_tokens_to_keep))  # [B, V]
    return jnp.where(remove, NEG_INF, scores)  # [B, V]
