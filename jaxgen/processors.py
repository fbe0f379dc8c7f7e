"""Logits processors: pure transforms `(logits [B, V], ctx) -> logits`.

Numeric parameters come from the config's dynamic leaves (scalar or per-row [B]), so a
new temperature or top-p never recompiles; which processors run is static.

Top-k and top-p have two implementations with identical masks up to ties:
- the default *search* path finds the cut-off logit by a binary search over the
  float32 bit patterns (32 passes over the vocabulary, no sort);
- the *sort* path mirrors Hugging Face's sort-based warpers exactly.

Example:
    >>> logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    >>> top_k_filter(logits, jnp.int32(2))
    Array([[-inf,   3.,   2., -inf]], dtype=float32)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgen.config import GenerationConfig

NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorContext:
    """What a processor may read besides the logits.

    tokens: int32 [B, T] prompt + generated so far (entries at index >= length are padding);
    length: int32 [B] number of valid tokens (the token being chosen goes at index `length`);
    prompt_len: int32 [B].
    """

    tokens: jax.Array
    length: jax.Array
    prompt_len: jax.Array


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


def _search_threshold(logits: jax.Array, keep_at_least) -> jax.Array:
    """Largest float t (per row) such that `keep_at_least(t)` holds.

    logits: [B, V]; keep_at_least: [B, 1] float -> [B] bool, monotone (true for small t).
    Returns t: [B, 1]. 32 bisection steps over the int32 images of the floats.
    """
    batch = logits.shape[0]
    # Search between the images of -inf and +inf: the predicate must hold at -inf, and the
    # NaN bit patterns outside that range are never visited.
    low = jnp.full((batch,), _sortable_bits(jnp.float32(-jnp.inf)), jnp.int32)  # [B]
    high = jnp.full((batch,), _sortable_bits(jnp.float32(jnp.inf)), jnp.int32)  # [B]

    def body(_, bounds):
        low, high = bounds
        span = high.astype(jnp.uint32) - low.astype(jnp.uint32)  # [B], no int32 overflow
        mid = (low.astype(jnp.uint32) + (span >> 1) + (span & 1)).astype(jnp.int32)  # [B]
        ok = keep_at_least(_bits_to_float(mid)[:, None])  # [B]
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)

    low, _ = jax.lax.fori_loop(0, 32, body, (low, high))
    return _bits_to_float(low)[:, None]  # [B, 1]


# ---------------------------------------------------------------------- processors
def temperature_scale(logits: jax.Array, temperature) -> jax.Array:
    """HF TemperatureLogitsWarper: logits / temperature."""
    return logits / per_row(temperature, logits.shape[0])  # [B, V]


def top_k_filter(logits: jax.Array, top_k, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopKLogitsWarper (search path): keep values >= the k-th largest; 0 disables."""
    batch, vocab = logits.shape
    k = per_row(top_k, batch, jnp.int32)  # [B, 1]
    k = jnp.where(k <= 0, vocab, jnp.clip(jnp.maximum(k, min_tokens_to_keep), 1, vocab))
    threshold = _search_threshold(
        logits, lambda t: jnp.sum(logits >= t, axis=-1) >= k[:, 0])  # [B, 1]
    return jnp.where(logits >= threshold, logits, NEG_INF)  # [B, V]


def top_k_filter_sorted(logits: jax.Array, top_k, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopKLogitsWarper (exact sort path)."""
    batch, vocab = logits.shape
    k = per_row(top_k, batch, jnp.int32)  # [B, 1]
    k = jnp.where(k <= 0, vocab, jnp.clip(jnp.maximum(k, min_tokens_to_keep), 1, vocab))
    descending = -jnp.sort(-logits, axis=-1)  # [B, V]
    kth = jnp.take_along_axis(descending, k - 1, axis=-1)  # [B, 1]
    return jnp.where(logits < kth, NEG_INF, logits)  # [B, V]


def top_p_filter(logits: jax.Array, top_p, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopPLogitsWarper (search path).

    A token is kept iff the probability mass of the tokens strictly above it is < top_p
    (HF removes a token when the ascending cumulative mass up to it is <= 1 - top_p).
    """
    batch = logits.shape[0]
    p = per_row(top_p, batch)  # [B, 1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    # The cut-off is the smallest t with mass(x > t) < p; keeping x >= t keeps exactly the
    # tokens whose mass above is < p. The predicate holds for large t, so bisect over -t.
    above_mass = lambda t: jnp.sum(jnp.where(logits > t, probs, 0.0), axis=-1)  # noqa: E731
    threshold = -_search_threshold(-logits, lambda s: above_mass(-s) < p[:, 0])  # [B, 1]
    keep = (logits >= threshold) | (p >= 1.0)  # [B, V]; top_p = 1 is HF's "disabled"
    if min_tokens_to_keep > 1:
        keep |= top_k_filter(logits, min_tokens_to_keep) > NEG_INF
    return jnp.where(keep, logits, NEG_INF)  # [B, V]


def top_p_filter_sorted(logits: jax.Array, top_p, min_tokens_to_keep: int = 1) -> jax.Array:
    """HF TopPLogitsWarper (exact sort path, same arithmetic as HF)."""
    batch, vocab = logits.shape
    p = per_row(top_p, batch)  # [B, 1]
    order = jnp.argsort(logits, axis=-1, stable=True)  # [B, V] ascending
    ascending = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)  # [B, V]
    remove_sorted = (cumulative <= 1 - p) & (p < 1.0)  # [B, V]
    remove_sorted = remove_sorted.at[:, vocab - min_tokens_to_keep:].set(False)
    remove = jnp.zeros_like(remove_sorted).at[jnp.arange(batch)[:, None], order].set(
        remove_sorted)  # [B, V]
    return jnp.where(remove, NEG_INF, logits)  # [B, V]


# --------------------------------------------------------------------------- chain
def process_logits(cfg: GenerationConfig, logits: jax.Array, ctx: ProcessorContext, *,
                   exact: bool = False) -> jax.Array:
    """Applies the processors `cfg` enables, in Hugging Face's order.

    logits: float32 [B, V] raw next-token logits. Returns processed scores [B, V].
    `exact=True` uses the sort paths for top-k / top-p.
    """
    del ctx  # the sampling warpers do not read the history
    scores = logits.astype(jnp.float32)  # [B, V]
    active = cfg.active_dynamic()
    if cfg.do_sample:
        if "temperature" in active:
            scores = temperature_scale(scores, cfg.temperature)
        if "top_k" in active:
            scores = (top_k_filter_sorted if exact else top_k_filter)(scores, cfg.top_k)
        if "top_p" in active:
            scores = (top_p_filter_sorted if exact else top_p_filter)(scores, cfg.top_p)
    return scores
