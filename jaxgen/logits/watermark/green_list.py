"""The green-list watermark (Kirchenbauer et al. 2023), bit-compatible with Hugging Face's
WatermarkLogitsProcessor, as a step of the compiled processor chain.

Each step, a "green list" of int(V * greenlist_ratio) token ids is drawn from a seed and
their scores get `+bias`, so sampled text holds more green tokens than chance; a detector
that knows the key recounts them (`jaxgen.logits.watermark.detect`). The seed, as in HF:
    lefthash  hashing_key * (the row's newest token)           green list: randperm(V)[:G]
    selfhash  per candidate c among the 40 best-scored tokens: hashing_key * b_c * b_c with
              b_c = fixed_table[c] + 1 (int64 arithmetic), fixed_table = randperm(1_000_003)
              under hashing_key; c gets the bias iff c is in its own green list.
randperm is torch's CPU permutation, reproduced bit for bit in `jaxgen.logits.watermark.rng`, so a
text watermarked here is detected by transformers' WatermarkDetector and the other way round.

`GenerationConfig(watermarking_config=...)` takes a `WatermarkingConfig`, a dict of its fields
or HF's `WatermarkingConfig` object; it is static (part of the compiled program). The bias is
added after every other processor (HF's order), to every row whose length reaches
`context_width` (HF skips shorter inputs), in greedy and beam modes too.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> wm = WatermarkingConfig(greenlist_ratio=0.5, bias=10.0)
    >>> ctx = ProcessorContext(tokens=jnp.array([[3, 0]]), length=jnp.array([1]),
    ...                        prompt_len=jnp.array([1]))
    >>> green_list_bias(jnp.zeros((1, 6)), ctx, wm).tolist()    # 3 of 6 ids get +10
    [[0.0, 10.0, 0.0, 10.0, 10.0, 0.0]]
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.watermarking import WatermarkingConfig
from jaxgen.logits.watermark.rng import green_mask, in_prefix, randperm_prefix

SELFHASH_CANDIDATES = 40  # HF tries the 40 best-scored tokens
FIXED_TABLE_SIZE = 1_000_003  # HF's selfhash table: randperm(1_000_003) under hashing_key
_U64 = 2**64


# ----------------------------------------------------------------------------- seeds
def lefthash_seeds(hashing_key: int, previous: jax.Array) -> jax.Array:
    """uint32 [B]: torch's seed for hashing_key * previous token (low 32 bits: exact, as the
    product of a key < 2**32 and a token id < 2**31 is below 2**64 - 1)."""
    return jnp.uint32(hashing_key) * previous.astype(jnp.uint32)  # [B]


def python_seed(value: int) -> int:
    """HF's `manual_seed(value % (2**64 - 1))` -> the 32 bits MT19937 uses."""
    return (value % (_U64 - 1)) & 0xFFFFFFFF


def int64(value: int) -> int:
    """A Python int wrapped to torch's int64 arithmetic."""
    value %= _U64
    return value - _U64 if value >= 2**63 else value


@functools.lru_cache(maxsize=8)
def fixed_table(hashing_key: int, size: int) -> np.ndarray:
    """HF's selfhash table randperm(1_000_003) under hashing_key: its first `size` entries."""
    with jax.ensure_compile_time_eval():
        seed = jnp.asarray([hashing_key & 0xFFFFFFFF], jnp.uint32)
        return np.asarray(jax.jit(randperm_prefix, static_argnames=("n", "count"))(
            seed, n=FIXED_TABLE_SIZE, count=min(size, FIXED_TABLE_SIZE)))[0]


def selfhash_seeds(hashing_key: int, windows: np.ndarray) -> np.ndarray:
    """uint32 [N]: HF's selfhash seed of each window [N, W] (its last token is the target):
    min over the window of int64(hashing_key * a_j * b), a_j = table[t_j] + 1, b = a_last."""
    windows = np.asarray(windows, np.int64) % FIXED_TABLE_SIZE
    table = fixed_table(hashing_key, int(windows.max()) + 1).astype(np.int64)
    a = table[windows] + 1  # [N, W]
    seeds = [python_seed(min(int64(hashing_key * int(x) * int(row[-1])) for x in row))
             for row in a.tolist()]
    return np.asarray(seeds, np.uint32)


@functools.lru_cache(maxsize=8)
def self_green_table(wm: WatermarkingConfig, vocab_size: int) -> np.ndarray:
    """bool [V]: token c is in the green list its own (selfhash, width 1) seed draws."""
    seeds = selfhash_seeds(wm.hashing_key, np.arange(vocab_size)[:, None])  # [V]
    green = wm.green_size(vocab_size)
    out, chunk = [], min(4096, vocab_size)
    members = jax.jit(lambda s, c: in_prefix(s, vocab_size, green, c))
    with jax.ensure_compile_time_eval():
        for begin in range(0, vocab_size, chunk):
            ids = np.arange(begin, begin + chunk) % vocab_size
            out.append(np.asarray(members(jnp.asarray(seeds[ids]), jnp.asarray(ids))))
    return np.concatenate(out)[:vocab_size]


# ------------------------------------------------------------------------- processor
def newest_tokens(ctx) -> jax.Array:
    """int32 [B]: each row's newest token (the seed of lefthash)."""
    index = jnp.maximum(ctx.length - 1, 0)[:, None]  # [B, 1]
    return jnp.take_along_axis(ctx.tokens, index, axis=1)[:, 0]  # [B]


def green_list_bias(scores: jax.Array, ctx, wm: WatermarkingConfig) -> jax.Array:
    """HF WatermarkLogitsProcessor per row: scores [B, V] + bias on the row's green ids."""
    batch, vocab = scores.shape
    if wm.seeding_scheme == "lefthash":
        seeds = lefthash_seeds(wm.hashing_key, newest_tokens(ctx))  # [B]
        green = green_mask(seeds, vocab, wm.green_size(vocab))  # [B, V]
    else:
        table = jnp.asarray(self_green_table(wm, vocab))  # [V]
        _, best = jax.lax.top_k(scores, min(SELFHASH_CANDIDATES, vocab))  # [B, 40]
        rows = jnp.arange(batch)[:, None]
        green = jnp.zeros((batch, vocab), bool).at[rows, best].set(table[best])  # [B, V]
    green &= (ctx.length >= wm.context_width)[:, None]
    return scores + jnp.where(green, jnp.float32(wm.bias), 0.0)  # [B, V]


def watermark_scores(scores: jax.Array, ctx, wm) -> jax.Array:
    """The watermark `wm` (green list or SynthID) applied to processed scores [B, V]."""
    if isinstance(wm, WatermarkingConfig):
        return green_list_bias(scores, ctx, wm)
    from jaxgen.logits.watermark.synthid import synthid_scores
    return synthid_scores(scores, ctx, wm)


def z_score(green: np.ndarray, scored: np.ndarray, ratio: float) -> np.ndarray:
    """(green - ratio * T) / sqrt(T * ratio * (1 - ratio)), HF's statistic."""
    green, scored = np.asarray(green, np.float64), np.asarray(scored, np.float64)
    return (green - ratio * scored) / np.sqrt(scored * ratio * (1 - ratio))


def p_value(z) -> np.ndarray:
    """One-sided normal tail: P(Z > z)."""
    return np.asarray([0.5 * math.erfc(v / math.sqrt(2)) for v in np.ravel(z)]).reshape(
        np.shape(z))
