"""Detecting the green-list watermark (Hugging Face's WatermarkDetector, same numbers).

Every token after the first `context_width` is scored: it is green when it lies in the green
list its context seeds (lefthash: the token before it; selfhash: its own window). With T
scored tokens of which g are green and ratio gamma, z = (g - gamma T) / sqrt(T gamma (1 -
gamma)); unwatermarked text has z ~ N(0, 1), watermarked text a large z. As in HF, a leading
BOS is dropped (for all rows or none), each distinct n-gram is looked up once, and
`ignore_repeated_ngrams` counts each distinct n-gram once.

Green membership is recomputed with `jaxgen.logits.watermark.rng.in_prefix` (torch's permutation,
bit for bit), batched over the distinct n-grams of all rows in one jitted call.

Example:
    >>> from jaxgen.config.watermarking import WatermarkingConfig
    >>> detector = WatermarkDetector(WatermarkingConfig(greenlist_ratio=0.5), vocab_size=6)
    >>> out = detector([[3, 1, 3, 1, 3, 1, 3, 1]], return_dict=True)  # 1 and 3 are green here
    >>> out.num_tokens_scored.tolist(), out.num_green_tokens.tolist()
    ([7.0], [7.0])
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.fields import check_int
from jaxgen.config.watermarking import WatermarkingConfig, parse_watermarking_config
from jaxgen.logits.watermark.green_list import (
    p_value,
    python_seed,
    selfhash_seeds,
    z_score,
)
from jaxgen.logits.watermark.rng import in_prefix


@dataclasses.dataclass
class WatermarkDetectorOutput:
    """Per-row detection results (numpy arrays [B]), HF's WatermarkDetectorOutput fields."""

    num_tokens_scored: np.ndarray
    num_green_tokens: np.ndarray
    green_fraction: np.ndarray
    z_score: np.ndarray
    p_value: np.ndarray
    prediction: np.ndarray
    confidence: np.ndarray


@functools.lru_cache(maxsize=16)
def _membership(vocab_size: int, green: int):
    """A jitted (seeds [N], targets [N]) -> bool [N]: target in randperm(V, seed)[:G]."""
    return jax.jit(lambda seeds, targets: in_prefix(seeds, vocab_size, green, targets))


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class WatermarkDetector:
    """Counts green tokens and computes the z-score of each row.

    watermarking_config: the generation's WatermarkingConfig (or a dict / HF's object).
    vocab_size: the model's vocabulary (the size the green lists were drawn from).
    bos_token_id: dropped when every row starts with it (HF's rule).
    """

    def __init__(self, watermarking_config, vocab_size: int, bos_token_id: int | None = None,
                 ignore_repeated_ngrams: bool = False):
        self.config = parse_watermarking_config(watermarking_config)
        if not isinstance(self.config, WatermarkingConfig):
            raise ValueError("WatermarkDetector detects the green-list watermark; for SynthID "
                             "use jaxgen.logits.watermark.synthid.SynthIDTextDetector")
        check_int("vocab_size", vocab_size, low=1)
        check_int("bos_token_id", bos_token_id, allow_none=True)
        self.vocab_size, self.bos_token_id = int(vocab_size), bos_token_id
        self.ignore_repeated_ngrams = bool(ignore_repeated_ngrams)

    # ------------------------------------------------------------------ green flags
    @property
    def ngram_len(self) -> int:
        """Tokens per scored n-gram: the context and the target (selfhash: the target is
        its own context's last token)."""
        selfhash = self.config.seeding_scheme == "selfhash"
        return self.config.context_width + 1 - int(selfhash)

    def seeds(self, ngrams: np.ndarray) -> np.ndarray:
        """uint32 [N]: the seed of each n-gram [N, n] (exact Python-int arithmetic)."""
        key = self.config.hashing_key
        if self.config.seeding_scheme == "selfhash":
            return selfhash_seeds(key, ngrams)
        return np.asarray([python_seed(key * int(t)) for t in ngrams[:, -2]], np.uint32)

    def green(self, ngrams: np.ndarray) -> np.ndarray:
        """bool [N]: each n-gram's last token is green under its context."""
        ngrams = np.asarray(ngrams, np.int64).reshape(-1, self.ngram_len)
        count = ngrams.shape[0]
        if count == 0:
            return np.zeros((0,), bool)
        size = _bucket(count)
        seeds = np.zeros((size,), np.uint32)
        targets = np.full((size,), -1, np.int32)
        seeds[:count], targets[:count] = self.seeds(ngrams), ngrams[:, -1]
        members = _membership(self.vocab_size, self.config.green_size(self.vocab_size))
        return np.asarray(members(jnp.asarray(seeds), jnp.asarray(targets)))[:count]

    # ---------------------------------------------------------------------- scoring
    def _rows(self, input_ids) -> list[list[int]]:
        rows = [list(map(int, np.asarray(row).reshape(-1))) for row in input_ids]
        if not rows:
            raise ValueError("WatermarkDetector needs at least one row of token ids")
        starts = [bool(row) and row[0] == self.bos_token_id for row in rows]
        if any(starts) != all(starts):
            raise ValueError("some rows start with the BOS token and some do not; tokenize "
                             "every row the same way")
        if all(starts):
            rows = [row[1:] for row in rows]
        shortest = min(len(row) for row in rows)
        if shortest - self.config.context_width < 1:
            raise ValueError(f"every row needs at least {self.config.context_width + 1} tokens "
                             f"(context_width={self.config.context_width} + 1 scored), the "
                             f"shortest has {shortest}")
        return rows

    def count(self, input_ids) -> tuple[np.ndarray, np.ndarray]:
        """(tokens scored [B], green tokens [B]) of each row (ragged rows allowed)."""
        n = self.ngram_len
        tables = [collections.Counter(tuple(row[i:i + n]) for i in range(len(row) - n + 1))
                  for row in self._rows(input_ids)]
        distinct = sorted({gram for table in tables for gram in table})
        flags = dict(zip(distinct, self.green(np.asarray(distinct, np.int64)).tolist()))
        scored = np.zeros(len(tables))
        greens = np.zeros(len(tables))
        for b, table in enumerate(tables):
            if self.ignore_repeated_ngrams:
                scored[b] = len(table)
                greens[b] = sum(flags[gram] for gram in table)
            else:
                scored[b] = sum(table.values())
                greens[b] = sum(freq * flags[gram] for gram, freq in table.items())
        return scored, greens

    def __call__(self, input_ids, z_threshold: float = 3.0, return_dict: bool = False):
        """Predictions (z > z_threshold) per row, or a WatermarkDetectorOutput."""
        scored, greens = self.count(input_ids)
        z = z_score(greens, scored, self.config.greenlist_ratio)
        prediction = z > z_threshold
        if not return_dict:
            return prediction
        p = p_value(z)
        return WatermarkDetectorOutput(num_tokens_scored=scored, num_green_tokens=greens,
                                       green_fraction=greens / scored, z_score=z, p_value=p,
                                       prediction=prediction, confidence=1 - p)
