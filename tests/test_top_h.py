"""top_h (HF 5.x TopHLogitsWarper, entropy-bounded truncation): parity with transformers on
random logits and edge cases on both filter paths, its place in the chain, validation, the
sampled distribution and no recompilation when the value changes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TopHLogitsWarper

import jaxgen
from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.chain import ProcessorContext, process_logits
from jaxgen.logits.warpers import top_h_filter, top_h_filter_sorted
from tests.stubs import BigramStub, random_table

FILTERS = {"search": top_h_filter, "sort": top_h_filter_sorted}


def hf_top_h(scores: np.ndarray, top_h: float | np.ndarray) -> np.ndarray:
    values = np.broadcast_to(np.asarray(top_h, np.float64), (scores.shape[0],))
    return np.stack([TopHLogitsWarper(top_h=float(h))(
        torch.zeros((1, 1), dtype=torch.long), torch.tensor(row[None]))[0].numpy()
        for row, h in zip(scores, values)])


def assert_same(ours, theirs):
    ours = np.asarray(ours)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)])


@pytest.mark.parametrize("impl", ["search", "sort"])
@pytest.mark.parametrize("vocab", [37, 300])  # fewer / more tokens than HF's 100 candidates
def test_matches_transformers_on_random_logits(impl, vocab):
    rng = np.random.default_rng(vocab)
    rows = 12
    scores = (rng.normal(size=(rows, vocab))
              * rng.uniform(0.3, 4.0, size=(rows, 1))).astype(np.float32)
    scores[rng.random(scores.shape) < 0.05] = -np.inf
    top_h = rng.uniform(0.05, 1.0, size=rows).astype(np.float32)  # one value per row
    ours = jax.jit(FILTERS[impl])(jnp.asarray(scores), jnp.asarray(top_h))
    assert_same(ours, hf_top_h(scores, top_h))


# Edge cases, one per row (-inf padding is neutral: HF drops -inf candidates as we do).
EDGE_CASES = {
    "one finite token": [-np.inf, 1.0, -np.inf, -np.inf],
    "peaked": [30.0, 0.0, -1.0, -2.0, -3.0],
    "spread": [3.0, 2.5, 1.0, 0.0, -1.0, -2.0],
    "underflowing probabilities": [0.0, -0.5, -1.0, -200.0, -300.0],
    "mostly -inf": [2.0, -np.inf, 1.0, -np.inf, 0.5, -np.inf],
}


@pytest.mark.parametrize("impl", ["search", "sort"])
@pytest.mark.parametrize("top_h", [0.05, 0.5, 1.0])
def test_edge_cases_match_transformers(impl, top_h):
    width = max(len(row) for row in EDGE_CASES.values())
    scores = np.full((len(EDGE_CASES), width), -np.inf, np.float32)
    for b, row in enumerate(EDGE_CASES.values()):
        scores[b, :len(row)] = row
    assert_same(FILTERS[impl](jnp.asarray(scores), top_h), hf_top_h(scores, top_h))


@pytest.mark.parametrize("top_h", [0.05, 0.5, 0.9])
def test_ties_at_the_cut(top_h):
    """Equal tokens: HF keeps as many as its arithmetic allows, picking among the tie in
    torch.topk's (unspecified) order; both jaxgen paths keep the same number, lower index
    first. (top_h = 1 on a uniform row puts the cut exactly at the total entropy, where the
    last ulp of the running sum decides.)"""
    scores = np.full((1, 8), 0.5, np.float32)
    theirs = np.isfinite(hf_top_h(scores, top_h))[0]
    for path in (top_h_filter_sorted, top_h_filter):
        kept = np.isfinite(np.asarray(path(jnp.asarray(scores), top_h)))[0]
        assert kept.sum() == theirs.sum() and kept[:kept.sum()].all(), path.__name__


def test_chain_places_top_h_after_temperature_and_before_top_k():
    rng = np.random.default_rng(3)
    scores = jnp.asarray(rng.normal(size=(2, 50)).astype(np.float32) * 2)
    ctx = ProcessorContext(tokens=jnp.zeros((2, 4), jnp.int32), length=jnp.array([1, 2]),
                           prompt_len=jnp.array([1, 1]))
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_h=0.6, top_k=5)
    want = np.asarray(top_h_filter(scores / 0.7, 0.6))
    kth = np.sort(want, axis=-1)[:, -5][:, None]
    want = np.where(want >= kth, want, -np.inf)
    np.testing.assert_allclose(np.asarray(process_logits(cfg, scores, ctx)), want)
    greedy = GenerationConfig(top_h=0.6)  # a warper: greedy decoding ignores it, as in HF
    np.testing.assert_array_equal(np.asarray(process_logits(greedy, scores, ctx)), scores)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan"), "0.5", [0.5, 2.0]])
def test_bad_values_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"`top_h` must be a float in \(0, 1\]"):
        GenerationConfig(do_sample=True, top_h=value)


def test_sampled_distribution_is_the_filtered_softmax():
    vocab = 12
    model = BigramStub(vocab_size=vocab)
    params = random_table(vocab, seed=4, scale=1.5)
    cfg = GenerationConfig(do_sample=True, top_h=0.7, max_new_tokens=1)
    prompt, samples = 3, 2000
    state = jaxgen.init_state(model, [[prompt]] * samples, cfg, jax.random.key(0))
    first = np.asarray(jaxgen.generate(params, state, cfg).sequences)[:, 1]
    filtered = hf_top_h(np.asarray(params["table"][prompt])[None], 0.7)[0]
    expected = np.exp(filtered.astype(np.float64) - filtered.max())
    expected /= expected.sum()
    counts = np.bincount(first, minlength=vocab)
    support = expected > 0
    assert counts[~support].sum() == 0 and support.sum() > 1
    assert stats.chisquare(counts[support], expected[support] * samples).pvalue > 1e-3


def test_new_top_h_values_do_not_recompile():
    vocab = 12
    model, params = BigramStub(vocab_size=vocab), random_table(vocab, seed=5)
    before = None
    for i, top_h in enumerate([0.3, 0.9, 0.55]):
        cfg = GenerationConfig(do_sample=True, top_h=top_h, max_new_tokens=2)
        jaxgen.generate(params, jaxgen.init_state(model, [[1], [2, 3]], cfg,
                                                   jax.random.key(i)), cfg)
        before = jaxgen.trace_count() if before is None else before
    assert jaxgen.trace_count() == before
