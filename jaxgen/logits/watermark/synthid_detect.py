"""Detecting SynthID-text: g-values, masks and the mean / weighted-mean scores.

The g-values and masks are Hugging Face's (SynthIDTextWatermarkLogitsProcessor.
compute_g_values / compute_context_repetition_mask / compute_eos_token_mask, same numbers);
the scores are the SynthID paper's non-learned ones: the mean g-value over the scored
n-grams and layers, and the weighted mean whose layer weights fall linearly from 10 to 1
(normalised to mean 1). Ordinary text has g-values that are fair coin flips (mean 1/2);
watermarked text has a higher mean. `z_score` measures the excess in standard deviations
of that null (each g ~ Bernoulli(1/2) independently). HF's Bayesian detector is a trained
model and is not rebuilt here; its inputs (g-values and the combined mask) are.

Example:
    >>> from jaxgen.config.watermarking import SynthIDTextWatermarkingConfig
    >>> wm = SynthIDTextWatermarkingConfig(ngram_len=2, keys=(7, 11))
    >>> compute_g_values(wm, [[1, 3, 2]]).tolist()   # [B, T - n + 1, depth]
    [[[0.0, 1.0], [0.0, 0.0]]]
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.watermarking import SynthIDTextWatermarkingConfig
from jaxgen.logits.watermark.synthid import (
    _split,
    accumulate_hash,
    floor_mod,
    sampling_table,
)


def _ids(input_ids) -> np.ndarray:
    ids = np.asarray(input_ids, np.int64)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length], got shape {ids.shape}")
    return ids


def _hashes(ids: np.ndarray, size: int):
    """(high, low) words [B, W] of the hash of every window of `size` tokens."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, size, axis=1)  # [B, W, size]
    tokens = jnp.asarray(windows.astype(np.int32))
    ones = (jnp.zeros(tokens.shape[:2], jnp.uint32), jnp.ones(tokens.shape[:2], jnp.uint32))
    return accumulate_hash(ones, [tokens[..., i] for i in range(size)])


def compute_g_values(wm: SynthIDTextWatermarkingConfig, input_ids) -> np.ndarray:
    """float32 [B, T - n + 1, depth]: the g-value of each n-gram's last token at each layer."""
    ids = _ids(input_ids)
    with jax.ensure_compile_time_eval():
        hashed = _hashes(ids, wm.ngram_len)  # [B, W]
        table = jnp.asarray(sampling_table(wm.sampling_table_seed, wm.sampling_table_size))
        layers = [table[floor_mod(accumulate_hash(hashed, [_split(key)]),
                                  wm.sampling_table_size)] for key in wm.keys]
        return np.asarray(jnp.stack(layers, axis=-1))


def context_repetition_mask(wm: SynthIDTextWatermarkingConfig, input_ids) -> np.ndarray:
    """bool [B, T - n + 1]: True where the n-gram's context was not among the previous
    `context_history_size` contexts (HF's history, which starts filled with zero hashes)."""
    ids = _ids(input_ids)
    with jax.ensure_compile_time_eval():
        high, low = _hashes(ids[:, :-1], wm.ngram_len - 1)  # [B, W]
    hashes = (np.asarray(high, np.uint64) << np.uint64(32)) | np.asarray(low, np.uint64)
    out = np.zeros(hashes.shape, bool)
    for b, row in enumerate(hashes.tolist()):
        history = [0] * wm.context_history_size  # newest first
        for i, value in enumerate(row):
            out[b, i] = value not in history
            history = [value] + history[:-1]
    return out


def eos_token_mask(input_ids, eos_token_id: int) -> np.ndarray:
    """bool [B, T]: True before each row's first EOS (HF's compute_eos_token_mask)."""
    ids = _ids(input_ids)
    seen = np.cumsum(ids == eos_token_id, axis=1) > 0
    return ~seen


def layer_weights(depth: int) -> np.ndarray:
    """The weighted mean's layer weights: 10 down to 1, normalised to mean 1."""
    weights = np.linspace(10.0, 1.0, depth)
    return weights * depth / weights.sum()


@dataclasses.dataclass
class SynthIDDetectorOutput:
    """Per-row scores (numpy [B])."""

    num_ngrams_scored: np.ndarray
    mean_score: np.ndarray
    weighted_mean_score: np.ndarray
    z_score: np.ndarray


class SynthIDTextDetector:
    """Scores texts for a SynthID-text watermark with the generation's config.

    eos_token_id: n-grams from a row's first EOS on are not scored (None: all are).
    """

    def __init__(self, watermarking_config, eos_token_id: int | None = None):
        from jaxgen.config.watermarking import parse_watermarking_config
        self.config = parse_watermarking_config(watermarking_config)
        if not isinstance(self.config, SynthIDTextWatermarkingConfig):
            raise ValueError("SynthIDTextDetector needs a SynthIDTextWatermarkingConfig; for "
                             "the green-list watermark use jaxgen.logits.watermark.detect")
        self.eos_token_id = eos_token_id

    def mask(self, input_ids) -> np.ndarray:
        """bool [B, T - n + 1]: the n-grams that count (not repeated, before EOS)."""
        mask = context_repetition_mask(self.config, input_ids)
        if self.eos_token_id is not None:
            mask &= eos_token_mask(input_ids, self.eos_token_id)[:, self.config.ngram_len - 1:]
        return mask

    def __call__(self, input_ids) -> SynthIDDetectorOutput:
        g = compute_g_values(self.config, input_ids)  # [B, W, depth]
        mask = self.mask(input_ids).astype(np.float64)  # [B, W]
        depth = self.config.depth
        counted = mask.sum(axis=1)  # [B]
        total = np.maximum(counted * depth, 1)
        mean = (g * mask[..., None]).sum(axis=(1, 2)) / total
        weighted = (g * mask[..., None] * layer_weights(depth)).sum(axis=(1, 2)) / total
        z = (mean - 0.5) * np.sqrt(4 * total)
        return SynthIDDetectorOutput(num_ngrams_scored=counted, mean_score=mean,
                                     weighted_mean_score=weighted, z_score=z)


def p_value(z: float) -> float:
    """One-sided normal tail P(Z > z)."""
    return 0.5 * math.erfc(z / math.sqrt(2))
