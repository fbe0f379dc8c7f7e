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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.checks import check_float, check_int
from jaxgen.logits.watermark.rng import green_mask, in_prefix, randperm_prefix

SEEDING_SCHEMES = ("lefthash", "selfhash")
SELFHASH_CANDIDATES = 40  # HF tries the 40 best-scored tokens
FIXED_TABLE_SIZE = 1_000_003  # HF's selfhash table: randperm(1_000_003) under hashing_key
_U64 = 2**64


@dataclasses.dataclass(frozen=True)
class WatermarkingConfig:
    """The green-list watermark's settings (Hugging Face's WatermarkingConfig fields).

    greenlist_ratio  share of the vocabulary that is green at each step, in (0, 1)
    bias             added to the green tokens' scores (a finite float)
    hashing_key      the secret key, an int in [0, 2**32) (jaxgen computes the lefthash seed
                     in 32-bit arithmetic, exact for keys below 2**32)
    seeding_scheme   "lefthash" (the seed is the newest token) or "selfhash" (each candidate
                     seeds its own list; context_width 1 only)
    context_width    tokens the seed reads; rows shorter than it are not watermarked

    >>> WatermarkingConfig(seeding_scheme="lefthash", greenlist_ratio=0.5).greenlist_ratio
    0.5
    >>> WatermarkingConfig(seeding_scheme="sha256")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `watermarking_config.seeding_scheme` must be one of ('lefthash', 'selfhash'), ...
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self):
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise ValueError(f"`watermarking_config.seeding_scheme` must be one of "
                             f"{SEEDING_SCHEMES}, got {self.seeding_scheme!r}")
        check_float("watermarking_config.greenlist_ratio", self.greenlist_ratio, low=0.0,
                    high=1.0, low_open=True, high_open=True,
                    allowed="a float in the open interval (0, 1)")
        check_float("watermarking_config.bias", self.bias, allowed="a finite float")
        key = self.hashing_key
        if (isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer))
                or not 0 <= key < 2**32):
            raise ValueError(f"`watermarking_config.hashing_key` must be an int in [0, 2**32) "
                             f"(jaxgen seeds in 32-bit arithmetic), got {key!r}")
        object.__setattr__(self, "hashing_key", int(key))
        check_int("watermarking_config.context_width", self.context_width, low=1)
        if self.seeding_scheme == "selfhash" and self.context_width != 1:
            raise ValueError(f"`watermarking_config.context_width`={self.context_width} with "
                             f"seeding_scheme='selfhash' is not supported for generation "
                             f"(allowed: context_width=1 with 'selfhash', any width with "
                             f"'lefthash')")
        object.__setattr__(self, "greenlist_ratio", float(self.greenlist_ratio))
        object.__setattr__(self, "bias", float(self.bias))

    def green_size(self, vocab_size: int) -> int:
        """G = int(vocab_size * greenlist_ratio), as HF."""
        return int(vocab_size * self.greenlist_ratio)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_watermarking_config(value):
    """None, a WatermarkingConfig / SynthIDTextWatermarkingConfig, a dict of one's fields or
    Hugging Face's config object (anything with `to_dict()`) -> jaxgen's config object.

    >>> parse_watermarking_config({"bias": 3.0}).bias
    3.0
    """
    from jaxgen.logits.watermark.synthid import SynthIDTextWatermarkingConfig
    if value is None or isinstance(value, (WatermarkingConfig, SynthIDTextWatermarkingConfig)):
        return value
    if not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ValueError(f"`watermarking_config` must be a WatermarkingConfig, a "
                         f"SynthIDTextWatermarkingConfig or a dict of their fields, got "
                         f"{value!r}")
    kind = SynthIDTextWatermarkingConfig if "keys" in value else WatermarkingConfig
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"`watermarking_config` has unknown key(s) {unknown} for "
                         f"{kind.__name__} (allowed: {sorted(fields)})")
    return kind(**value)


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
