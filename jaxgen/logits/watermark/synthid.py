"""SynthID-text (Dathathri et al., Nature 2024), bit-compatible with Hugging Face's
SynthIDTextWatermarkLogitsProcessor, as a step of the compiled processor chain.

For each candidate token v, a 64-bit hash of (the last ngram_len - 1 generated tokens, v) is
mixed with each of the `depth` keys and mapped, through a fixed random 0/1 table, to g-values
g[v, d]; the distribution is then tilted depth by depth (p <- p (1 + g_d - E_p[g_d])), which
favours tokens with g = 1 (tournament sampling with two candidates per layer). A detector
that knows the keys recomputes the g-values of a text: their mean is about 1/2 for ordinary
text and higher for watermarked text (`jaxgen.logits.watermark.synthid_detect`).

Hugging Face keeps a stateful per-batch context; jaxgen reads the same things from each
row's tokens, so nothing is carried in the loop:
- the context at a step is the row's last ngram_len - 1 *generated* tokens, left-filled with
  0 (HF starts its context at zeros and appends each generated token; the prompt is not used);
- a context already seen at one of the row's last `context_history_size` steps is not
  watermarked (HF's context history), nor are the first ngram_len - 1 steps when
  `skip_first_ngram_calls`.
The 64-bit arithmetic of HF's hash (int64, wrapping) is done on pairs of uint32 words.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> wm = SynthIDTextWatermarkingConfig(ngram_len=2, keys=(7, 11))
    >>> ctx = ProcessorContext(tokens=jnp.array([[1, 3, 0]]), length=jnp.array([2]),
    ...                        prompt_len=jnp.array([1]))
    >>> g_values(wm, ctx, 4).tolist()      # [B, V, depth]: 0/1 per candidate and key
    [[[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.watermarking import SynthIDTextWatermarkingConfig

MULTIPLIER = 6364136223846793005  # HF's LCG multiplier (newlib / musl)
_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=8)
def sampling_table(seed: int, size: int) -> np.ndarray:
    """HF's table torch.randint(0, 2, (size,)) under manual_seed(seed): MT19937 outputs % 2
    (numpy's legacy RandomState is the same Mersenne Twister, seeded the same way)."""
    raw = np.random.RandomState(seed & _MASK32).randint(0, 2**32, size=size, dtype=np.uint32)
    return (raw % 2).astype(np.float32)


# --------------------------------------------------------------- 64-bit on uint32 pairs
def _split(value: int) -> tuple[jax.Array, jax.Array]:
    value %= 2**64
    return jnp.uint32(value >> 32), jnp.uint32(value & _MASK32)


def _mul32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The full 64-bit product of two uint32 arrays as (high, low) words."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    low = (middle << 16) | (p00 & 0xFFFF)
    return p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16), low


def _add(x, y):
    low = x[1] + y[1]
    return x[0] + y[0] + (low < x[1]).astype(jnp.uint32), low


def accumulate_hash(current, data: list) -> tuple[jax.Array, jax.Array]:
    """HF's accumulate_hash: for each value x in `data`, h = (h + x) * MULTIPLIER + 1 (int64,
    wrapping). current: (high, low) words; each x a (high, low) pair or a non-negative int32
    array."""
    mul_high, mul_low = _split(MULTIPLIER)
    for x in data:
        if not isinstance(x, tuple):
            x = (jnp.zeros_like(x, jnp.uint32), x.astype(jnp.uint32))
        high, low = _add(current, x)
        product_high, product_low = _mul32(low, jnp.broadcast_to(mul_low, low.shape))
        high = product_high + low * mul_high + high * mul_low
        current = _add((high, product_low), (jnp.uint32(0), jnp.uint32(1)))
    return current


def floor_mod(value, modulus: int) -> jax.Array:
    """int32: the int64 `value` (high, low words) mod `modulus` (<= 2**24), the result's
    sign following the modulus (torch's and Python's %)."""
    high, low = value
    rest = jnp.zeros_like(low)
    for word in (high, low):  # bytes, most significant first: rest * 256 stays < 2**32
        for shift in (24, 16, 8, 0):
            rest = (rest * 256 + ((word >> shift) & 0xFF)) % jnp.uint32(modulus)
    wrap = jnp.uint32(2**64 % modulus)  # a negative int64 is its unsigned value - 2**64
    negative = (high >> 31) == 1
    rest = jnp.where(negative, (rest + jnp.uint32(modulus) - wrap) % jnp.uint32(modulus), rest)
    return rest.astype(jnp.int32)


# ------------------------------------------------------------------------- processor
def contexts(ctx, ngram_len: int) -> jax.Array:
    """int32 [B, T, n-1]: the context each step s = 0 .. T-1 had (the last n-1 generated
    tokens before step s, left-filled with 0); step s of a row writes index prompt_len + s."""
    tokens, prompt_len = ctx.tokens, ctx.prompt_len  # [B, T], [B]
    width = tokens.shape[1]
    offsets = jnp.arange(width)[:, None] - (ngram_len - 1) + jnp.arange(ngram_len - 1)[None]
    index = prompt_len[:, None, None] + offsets[None]  # [B, T, n-1]
    picked = jnp.take_along_axis(tokens, jnp.clip(index, 0, width - 1).reshape(
        tokens.shape[0], -1), axis=1).reshape(index.shape)
    return jnp.where(index >= prompt_len[:, None, None], picked, 0)  # [B, T, n-1]


def current_context(ctx, ngram_len: int) -> jax.Array:
    """int32 [B, n-1]: the context of the token being chosen now (at index ctx.length)."""
    offsets = ctx.length[:, None] - (ngram_len - 1) + jnp.arange(ngram_len - 1)[None]  # [B, n-1]
    picked = jnp.take_along_axis(ctx.tokens, jnp.clip(offsets, 0, ctx.tokens.shape[1] - 1),
                                 axis=1)
    return jnp.where(offsets >= ctx.prompt_len[:, None], picked, 0)  # [B, n-1]


def g_values(wm: SynthIDTextWatermarkingConfig, ctx, vocab: int) -> jax.Array:
    """float32 [B, V, depth]: the g-value of every candidate token at every layer."""
    context = current_context(ctx, wm.ngram_len)  # [B, n-1]
    ones = (jnp.zeros(context.shape[:1], jnp.uint32), jnp.ones(context.shape[:1], jnp.uint32))
    hashed = accumulate_hash(ones, [context[:, i] for i in range(wm.ngram_len - 1)])  # [B]
    candidates = jnp.arange(vocab, dtype=jnp.int32)[None, :]  # [1, V]
    hashed = accumulate_hash((hashed[0][:, None], hashed[1][:, None]), [candidates])  # [B, V]
    table = jnp.asarray(sampling_table(wm.sampling_table_seed, wm.sampling_table_size))
    layers = [table[floor_mod(accumulate_hash(hashed, [_split(key)]), wm.sampling_table_size)]
              for key in wm.keys]
    return jnp.stack(layers, axis=-1)  # [B, V, depth]


def tilt(scores: jax.Array, g: jax.Array) -> jax.Array:
    """HF's update_scores: p <- p (1 + g_d - E_p[g_d]) layer by layer; log, with non-finite
    values replaced by float32's most negative number. scores [B, V], g [B, V, depth]."""
    probs = jax.nn.softmax(scores, axis=-1)  # [B, V]
    for d in range(g.shape[-1]):
        mass = jnp.sum(g[..., d] * probs, axis=-1, keepdims=True)  # [B, 1]
        probs = probs * (1 + g[..., d] - mass)
    logs = jnp.log(probs)
    return jnp.where(jnp.isfinite(logs), logs, jnp.finfo(jnp.float32).min)  # [B, V]


def repeated_context(wm: SynthIDTextWatermarkingConfig, ctx) -> jax.Array:
    """bool [B]: the current context was the context of one of the row's last
    `context_history_size` watermarked steps (HF's context history)."""
    steps = ctx.length - ctx.prompt_len  # [B] steps already taken
    past = contexts(ctx, wm.ngram_len)  # [B, T, n-1]
    now = current_context(ctx, wm.ngram_len)  # [B, n-1]
    s = jnp.arange(past.shape[1])[None, :]  # [1, T]
    seen = (s < steps[:, None]) & (s >= steps[:, None] - wm.context_history_size)
    if wm.skip_first_ngram_calls:  # skipped steps never entered the history
        seen &= s >= wm.ngram_len - 1
    same = jnp.all(past == now[:, None, :], axis=-1)  # [B, T]
    return jnp.any(same & seen, axis=-1)  # [B]


def synthid_scores(scores: jax.Array, ctx, wm: SynthIDTextWatermarkingConfig) -> jax.Array:
    """HF SynthIDTextWatermarkLogitsProcessor for each row: tilted log-probabilities [B, V]
    (the scores unchanged on a repeated context or a skipped first step)."""
    if wm.debug_mode:
        scores = jnp.ones_like(scores)
    tilted = tilt(scores, g_values(wm, ctx, scores.shape[-1]))  # [B, V]
    keep = repeated_context(wm, ctx)  # [B]
    if wm.skip_first_ngram_calls:
        keep |= ctx.length - ctx.prompt_len < wm.ngram_len - 1
    return jnp.where(keep[:, None], scores, tilted)  # [B, V]
