"""Every jaxgen logits processor against the transformers processor of the same name.

Rows are ragged: each row's real tokens are tokens[b, :length[b]] (the rest is random
garbage that must never be counted) and HF sees exactly those tokens as its input_ids, one
row at a time. Scores hold -inf entries, repeated tokens are frequent.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from jaxgen.logits import chain as P
from jaxgen.logits.chain import ProcessorContext

V, T, B = 97, 24, 5
TOL = dict(rtol=1e-6, atol=1e-6)


def make_batch(seed: int, batch: int = B, vocab: int = V, width: int = T, small_ids: int = 12,
               neg_inf_frac: float = 0.1):
    """Random scores [B, V] with -inf entries, ragged rows of frequently repeated ids."""
    rng = np.random.default_rng(seed)
    scores = (rng.normal(size=(batch, vocab)) * 3).astype(np.float32)
    scores[rng.random((batch, vocab)) < neg_inf_frac] = -np.inf
    scores[0, : vocab // 2] = -np.inf  # a row already mostly masked
    tokens = rng.integers(0, vocab, size=(batch, width)).astype(np.int32)  # garbage padding
    length = rng.integers(1, width - 2, size=(batch,)).astype(np.int32)
    length[-1] = 1  # a one-token row
    prompt_len = np.array([rng.integers(1, n + 1) for n in length], np.int32)
    for b in range(batch):  # real tokens: mostly from a small alphabet -> repeats and n-grams
        real = rng.integers(0, small_ids, size=length[b])
        tokens[b, : length[b]] = real
    ctx = ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                           prompt_len=jnp.asarray(prompt_len))
    return scores, tokens, length, prompt_len, ctx


def hf_rows(processor_for_row, scores, tokens, length):
    """Runs an HF processor on each row alone; processor_for_row(b) -> processor."""
    out = []
    for b in range(scores.shape[0]):
        ids = torch.tensor(tokens[b, : length[b]][None], dtype=torch.long)
        out.append(processor_for_row(b)(ids, torch.tensor(scores[b][None]).clone())[0].numpy())
    return np.stack(out)


def close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), **TOL)


SEEDS = [0, 1]


# ------------------------------------------------------------------------ warpers
@pytest.mark.parametrize("seed", SEEDS)
def test_temperature_per_row(seed):
    scores, tokens, length, _, _ = make_batch(seed)
    temps = np.linspace(0.3, 1.7, B).astype(np.float32)
    ours = jax.jit(P.temperature_scale)(scores, temps)
    close(ours, hf_rows(lambda b: hf.TemperatureLogitsWarper(float(temps[b])), scores, tokens,
                        length))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("k", [1, 5, 40, 200])
def test_top_k(seed, keep, k):
    scores, tokens, length, _, _ = make_batch(seed)
    want = hf_rows(lambda b: hf.TopKLogitsWarper(k, min_tokens_to_keep=keep), scores, tokens,
                   length)
    close(jax.jit(P.top_k_filter, static_argnums=2)(scores, k, keep), want)
    close(jax.jit(P.top_k_filter_sorted, static_argnums=2)(scores, k, keep), want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep", [1, 4])
def test_top_p_per_row(seed, keep):
    scores, tokens, length, _, _ = make_batch(seed)
    ps = np.array([0.05, 0.3, 0.6, 0.9, 0.999], np.float32)
    want = hf_rows(lambda b: hf.TopPLogitsWarper(float(ps[b]), min_tokens_to_keep=keep), scores,
                   tokens, length)
    close(jax.jit(P.top_p_filter, static_argnums=2)(scores, ps, keep), want)
    close(jax.jit(P.top_p_filter_sorted, static_argnums=2)(scores, ps, keep), want)
    # top_p = 1 is the identity on both paths
    close(P.top_p_filter(scores, 1.0), scores)
    close(P.top_p_filter_sorted(scores, 1.0), scores)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.3, 1.0])
def test_min_p(seed, keep, min_p):
    scores, tokens, length, _, _ = make_batch(seed)
    want = hf_rows(lambda b: hf.MinPLogitsWarper(min_p, min_tokens_to_keep=keep), scores, tokens,
                   length)
    close(P.min_p_filter(scores, min_p, keep), want)
    close(P.min_p_filter(scores, min_p, keep, exact=True), want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("mass", [0.2, 0.7, 0.95])
def test_typical(seed, keep, mass):
    scores, tokens, length, _, _ = make_batch(seed)
    want = hf_rows(lambda b: hf.TypicalLogitsWarper(mass, min_tokens_to_keep=keep), scores,
                   tokens, length)
    close(jax.jit(P.typical_filter, static_argnums=2)(scores, mass, keep), want)
    close(jax.jit(P.typical_filter_sorted, static_argnums=2)(scores, mass, keep), want)
    close(P.typical_filter(scores, 1.0), scores)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("eps", [1e-4, 3e-3, 0.05])
def test_epsilon_and_eta(seed, keep, eps):
    scores, tokens, length, _, _ = make_batch(seed)
    close(P.epsilon_filter(scores, eps, keep),
          hf_rows(lambda b: hf.EpsilonLogitsWarper(eps, min_tokens_to_keep=keep), scores, tokens,
                  length))
    close(P.eta_filter(scores, eps, keep),
          hf_rows(lambda b: hf.EtaLogitsWarper(eps, min_tokens_to_keep=keep), scores, tokens,
                  length))
    close(P.epsilon_filter(scores, 0.0), scores)
    close(P.eta_filter(scores, 0.0), scores)


def test_search_and_sort_masks_agree_on_large_vocab():
    rng = np.random.default_rng(7)
    scores = jnp.asarray((rng.normal(size=(4, 49152)) * 4).astype(np.float32))
    for k in (1, 50, 1000):
        np.testing.assert_array_equal(P.top_k_filter(scores, k), P.top_k_filter_sorted(scores, k))
    # Top-p / typical-p: the two paths sum probabilities in different orders (float32), so a
    # token whose cumulative mass lies within rounding (1e-5) of the cut-off may differ.
    s64 = np.asarray(scores, np.float64)
    probs = np.exp(s64 - s64.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    for p in (0.1, 0.9, 0.99):
        fast = np.asarray(P.top_p_filter(scores, p)) > -np.inf
        exact = np.asarray(P.top_p_filter_sorted(scores, p)) > -np.inf
        for row, tok in zip(*np.nonzero(fast != exact)):
            above = probs[row][s64[row] > s64[row, tok]].sum()
            assert abs(above - p) < 1e-5, (p, row, tok, above)
        assert (fast != exact).sum() <= 2
    for m in (0.5, 0.95):
        fast = np.asarray(P.typical_filter(scores, m)) > -np.inf
        exact = np.asarray(P.typical_filter_sorted(scores, m)) > -np.inf
        assert (fast != exact).sum() <= 2


def test_top_k_ties_keep_every_tied_value():
    scores = jnp.array([[1.0, 2.0, 2.0, 2.0, 0.5]])
    for fn in (P.top_k_filter, P.top_k_filter_sorted):
        np.testing.assert_array_equal(fn(scores, 2) > -jnp.inf, [[False, True, True, True, False]])


# ------------------------------------------------------------------------ history
@pytest.mark.parametrize("seed", SEEDS)
def test_repetition_penalty_per_row(seed):
    scores, tokens, length, _, ctx = make_batch(seed)
    pens = np.array([0.5, 1.0, 1.3, 2.0, 1.7], np.float32)
    ours = jax.jit(P.repetition_penalty)(scores, ctx, pens)
    close(ours, hf_rows(lambda b: hf.RepetitionPenaltyLogitsProcessor(float(pens[b])), scores,
                        tokens, length))


@pytest.mark.parametrize("seed", SEEDS)
def test_presence_frequency_generated_only(seed):
    scores, tokens, length, prompt_len, ctx = make_batch(seed)
    presence = np.array([0.5, -0.3, 0.0, 1.0, 2.0], np.float32)
    frequency = np.array([0.2, 0.0, -1.0, 0.7, 0.1], np.float32)
    ours = np.asarray(jax.jit(P.presence_frequency_penalty)(scores, ctx, presence, frequency))
    want = scores.copy()
    for b in range(B):
        counts = np.bincount(tokens[b, prompt_len[b]:length[b]], minlength=V)
        want[b] -= frequency[b] * counts + presence[b] * (counts > 0)
    close(ours, want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram(seed, n):
    scores, tokens, length, _, ctx = make_batch(seed, small_ids=4)
    ours = jax.jit(P.no_repeat_ngram, static_argnums=2)(scores, ctx, n)
    close(ours, hf_rows(lambda b: hf.NoRepeatNGramLogitsProcessor(n), scores, tokens, length))


def _sequences(rng, count, small_ids=6, max_len=3):
    seqs = []
    for _ in range(count):
        size = int(rng.integers(1, max_len + 1))
        seqs.append([int(t) for t in rng.integers(0, small_ids, size=size)])
    return seqs


@pytest.mark.parametrize("seed", SEEDS)
def test_bad_words(seed):
    scores, tokens, length, _, ctx = make_batch(seed, small_ids=6)
    rng = np.random.default_rng(100 + seed)
    bad = _sequences(rng, 8) + [[2], [5, 2]]  # [2] is an EOS id: HF keeps it allowed
    eos = (2, 9)
    ours = P.sequence_bias(scores, ctx, P.bad_words_as_bias(bad, eos))
    close(ours, hf_rows(lambda b: hf.NoBadWordsLogitsProcessor(bad, list(eos)), scores, tokens,
                        length))


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_bias(seed):
    scores, tokens, length, _, ctx = make_batch(seed, small_ids=6, neg_inf_frac=0.0)
    rng = np.random.default_rng(200 + seed)
    pairs = [[seq, float(rng.normal() * 3)] for seq in _sequences(rng, 10)]
    ours = P.sequence_bias(scores, ctx, P.normalize_sequence_bias(pairs))
    close(ours, hf_rows(lambda b: hf.SequenceBiasLogitsProcessor(pairs), scores, tokens, length))


# ----------------------------------------------------------------------- position
@pytest.mark.parametrize("seed", SEEDS)
def test_min_length_and_min_new_tokens(seed):
    scores, tokens, length, prompt_len, ctx = make_batch(seed)
    eos = (3, 7)
    for min_length in (0, 5, 12, 30):
        close(P.min_length_mask(scores, ctx, eos, min_length=min_length),
              hf_rows(lambda b: hf.MinLengthLogitsProcessor(min_length, list(eos)), scores,
                      tokens, length))
    for min_new in (0, 1, 3, 8):
        close(P.min_length_mask(scores, ctx, eos, min_new_tokens=min_new),
              hf_rows(lambda b: hf.MinNewTokensLengthLogitsProcessor(int(prompt_len[b]), min_new,
                                                                     list(eos)),
                      scores, tokens, length))


@pytest.mark.parametrize("seed", SEEDS)
def test_forced_bos_and_eos(seed):
    scores, tokens, length, prompt_len, ctx = make_batch(seed)
    close(P.forced_bos(scores, ctx, 4),
          hf_rows(lambda b: hf.ForcedBOSTokenLogitsProcessor(4), scores, tokens, length))
    max_new = np.array([length[b] - prompt_len[b] + 1 if b % 2 else 7 for b in range(B)], np.int32)
    ctx_budget = ProcessorContext(tokens=ctx.tokens, length=ctx.length, prompt_len=ctx.prompt_len,
                                  max_new=jnp.asarray(max_new))
    for eos in ([6], [6, 11]):
        close(P.forced_eos(scores, ctx_budget, tuple(eos)),
              hf_rows(lambda b: hf.ForcedEOSTokenLogitsProcessor(
                  int(prompt_len[b] + max_new[b]), eos), scores, tokens, length))


def test_remove_invalid_values():
    scores = np.array([[np.nan, np.inf, -np.inf, 1.5, -2.0]], np.float32)
    ids = torch.tensor([[1]])
    want = hf.InfNanRemoveLogitsProcessor()(ids, torch.tensor(scores)).numpy()
    close(P.remove_invalid_values(jnp.asarray(scores)), want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("start,factor", [(0, 1.5), (2, 1.1), (1, 0.8)])
def test_exponential_decay_length_penalty(seed, start, factor):
    scores, tokens, length, prompt_len, ctx = make_batch(seed)
    eos = (3, 8)
    want = hf_rows(lambda b: hf.ExponentialDecayLengthPenalty((start, factor), list(eos),
                                                             int(prompt_len[b])),
                   scores, tokens, length)
    np.testing.assert_allclose(
        np.asarray(P.exponential_decay_length_penalty(scores, ctx, start, factor, eos)), want,
        rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_suppress_and_begin_suppress(seed):
    scores, tokens, length, prompt_len, ctx = make_batch(seed)
    ids = (1, 5, 90)
    close(P.suppress_tokens(scores, ids),
          hf_rows(lambda b: hf.SuppressTokensLogitsProcessor(list(ids)), scores, tokens, length))
    # The first generated slot of each row: length == prompt_len.
    at_begin = ProcessorContext(tokens=ctx.tokens, length=ctx.prompt_len, prompt_len=ctx.prompt_len)
    for forced_bos in (None, 4):
        for c in (ctx, at_begin):
            lens = np.asarray(c.length)
            begin = [int(p) if (p > 1 or forced_bos is None) else int(p) + 1 for p in prompt_len]
            close(P.begin_suppress_tokens(scores, c, ids, forced_bos),
                  hf_rows(lambda b: hf.SuppressTokensAtBeginLogitsProcessor(list(ids), begin[b]),
                          scores, tokens, lens))


@pytest.mark.parametrize("seed", SEEDS)
def test_renormalize(seed):
    scores, tokens, length, _, _ = make_batch(seed)
    close(P.renormalize(jnp.asarray(scores)),
          hf_rows(lambda b: hf.LogitNormalization(), scores, tokens, length))


# ------------------------------------------------------------------ padding safety
def test_padding_is_never_counted():
    """Changing the garbage after each row's length changes nothing."""
    from jaxgen.config.generation import GenerationConfig
    cfg = GenerationConfig(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3,
                           no_repeat_ngram_size=2, bad_words_ids=[[1, 2], [3]],
                           sequence_bias=[[[4, 5], 2.0]], eos_token_id=2, min_new_tokens=2)
    scores, tokens, length, prompt_len, ctx = make_batch(3)
    other = np.array(tokens)
    mask = np.arange(T)[None, :] >= length[:, None]
    other[mask] = np.random.default_rng(9).integers(0, V, size=int(mask.sum()))
    ctx2 = ProcessorContext(tokens=jnp.asarray(other), length=ctx.length, prompt_len=ctx.prompt_len)
    np.testing.assert_array_equal(P.process_logits(cfg, scores, ctx),
                                  P.process_logits(cfg, scores, ctx2))
