"""Exact-distribution checks for lossless sampling: the true joint of the first three tokens,
computed from a model's processed conditionals, and the chi-square test of sampled counts
against it. Shared by the speculative-decoding test files (assisted, early exit, MTP, drafters).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

# A tiny vocabulary keeps the 3-token joint small enough to enumerate ([V, V, V]).
SMALL_V, TEMPERATURE, TOP_K = 6, 0.8, 4


def processed_probs(logits: np.ndarray) -> np.ndarray:
    """temperature + top-k, as the sampling configs of these tests ask [..., V]."""
    logits = logits / TEMPERATURE
    kth = np.sort(logits, axis=-1)[..., -TOP_K][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def next_probs(model, params, prefixes: list[list[int]]) -> np.ndarray:
    """The processed next-token distribution after each prefix (equal lengths) [N, V]."""
    tokens = jnp.asarray(prefixes, jnp.int32)  # [N, S]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = model(params, tokens, positions, model.init_cache(len(prefixes), tokens.shape[1]))
    return processed_probs(np.asarray(out.logits[:, -1], np.float64))


def three_token_joint(model, params, prompt: list[int]) -> np.ndarray:
    """p(t1, t2, t3 | prompt) under the processed distribution [V, V, V]."""
    vocab = model.config.vocab_size
    p1 = next_probs(model, params, [prompt])[0]  # [V]
    p2 = next_probs(model, params, [prompt + [a] for a in range(vocab)])  # [V, V]
    p3 = next_probs(model, params, [prompt + [a, b] for a in range(vocab)
                                    for b in range(vocab)]).reshape((vocab,) * 3)  # [V, V, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def first_three_counts(sequences, prompt_length: int, vocab: int) -> np.ndarray:
    """Counts of the first three generated tokens over the rows [V, V, V]."""
    new = np.asarray(sequences)[:, prompt_length:prompt_length + 3]  # [rows, 3]
    counts = np.zeros((vocab,) * 3)
    np.add.at(counts, (new[:, 0], new[:, 1], new[:, 2]), 1)
    return counts


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of counts against probabilities; cells expecting < 5 are pooled. Fails at once
    if a cell of probability zero was observed."""
    counts, probs = counts.reshape(-1), expected_probs.reshape(-1)
    total = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token with zero target probability was emitted"
    expected = probs * total
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:  # no small cells to pool
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * (observed.sum() / expected.sum())  # float64 rounding only
    return float(scipy_stats.chisquare(observed, expected).pvalue)


def assert_follows(counts: np.ndarray, exact: np.ndarray) -> None:
    """Counts follow the exact joint: chi-square p > 1e-3 and total variation < 0.05."""
    assert chi_square(counts, exact) > 1e-3
    assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.05
