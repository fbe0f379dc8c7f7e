"""A pruned draft vocabulary (jaxgen.models.draft_vocab): logits inside the vocabulary are the
full head's, -inf outside; assisted decoding with it stays exact (greedy equals plain greedy)
and lossless when sampling (chi-square against the exact distribution, with the draft's q
zero on the target's favourite tokens)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import chi_square
from stubs import BigramStub
from test_speculative import SMALL_V, _exact_joint, _sample_cfg

from jaxgen import generate, init_state
from jaxgen.api.generate import generate_ids
from jaxgen.models import tiny_llama
from jaxgen.models.draft_vocab import (
    DraftVocabModel,
    restricted_logits,
    select_draft_vocab,
    with_draft_head,
)


def test_logits_inside_equal_the_full_head_and_minus_inf_outside():
    model, params = tiny_llama(seed=2, num_layers=2)
    vocab = (1, 4, 9, 30)
    small = DraftVocabModel(model, vocab)
    tokens, positions = jnp.array([[3, 5, 7]]), jnp.arange(3)[None]
    full = model(params, tokens, positions, model.init_cache(1, 4)).logits
    for p in (params, with_draft_head(small, params)):
        got = small(p, tokens, positions, small.init_cache(1, 4)).logits
        np.testing.assert_allclose(got[..., jnp.array(vocab)], full[..., jnp.array(vocab)],
                                   rtol=1e-5, atol=1e-5)
        outside = np.setdiff1d(np.arange(model.vocab_size), vocab)
        assert np.all(np.isneginf(np.asarray(got)[..., outside]))


def test_restricted_logits_over_every_token_is_the_head():
    model, params = tiny_llama(seed=3)
    hidden = jax.random.normal(jax.random.key(0), (2, 3, 16))
    np.testing.assert_allclose(restricted_logits(model, params, hidden, jnp.arange(32)),
                               model.head(params, hidden), rtol=1e-5, atol=1e-5)


def test_select_draft_vocab_keeps_the_most_frequent_and_the_forced_ids():
    counts = np.array([5, 0, 9, 9, 1, 0])
    assert select_draft_vocab(counts, 2) == (2, 3)
    assert select_draft_vocab(counts, 3, keep=(5,)) == (0, 2, 3, 5)


@pytest.mark.parametrize("vocab", [(), (3, 1), (0, 32), (2, 2)])
def test_bad_vocab_is_a_value_error(vocab):
    model, _ = tiny_llama()
    with pytest.raises(ValueError, match="vocab must be"):
        DraftVocabModel(model, vocab)


def test_greedy_with_pruned_draft_equals_plain_greedy():
    target, target_params = tiny_llama(seed=4, num_layers=2)
    draft, draft_params = tiny_llama(seed=5)
    small = DraftVocabModel(draft, tuple(range(0, 32, 3)))
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    plain = generate_ids(target, target_params, prompts, max_new_tokens=10, pad_token_id=0)
    assisted = generate_ids(target, target_params, prompts, max_new_tokens=10, pad_token_id=0,
                            num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                            assistant_model=(small, with_draft_head(small, draft_params)))
    assert assisted == plain


def test_sampling_with_pruned_draft_is_lossless():
    rng = np.random.default_rng(7)
    table = rng.normal(size=(SMALL_V, SMALL_V)).astype(np.float32) * 1.5
    target = BigramStub(vocab_size=SMALL_V, pad_token_id=0)
    draft, draft_params = tiny_llama(seed=6, vocab_size=SMALL_V)
    favourite = int(np.argmax(table[3]))  # the target's top token after the prompt's last
    small = DraftVocabModel(draft, tuple(t for t in range(SMALL_V) if t != favourite))
    rows, prompt = 16000, [2, 3, 2, 3, 2]
    cfg = _sample_cfg(num_assistant_tokens=2, assistant_confidence_threshold=0.0,
                      max_new_tokens=4)
    state = init_state(target, [prompt] * rows, cfg, jax.random.key(11))
    out = generate({"table": jnp.asarray(table)}, state, cfg,
                   assistant_model=(small, draft_params))
    new = np.asarray(out.sequences)[:, len(prompt):len(prompt) + 3]  # [rows, 3]
    counts = np.zeros((SMALL_V,) * 3)
    np.add.at(counts, (new[:, 0], new[:, 1], new[:, 2]), 1)
    exact = _exact_joint(table, prompt[-1], 3)
    assert chi_square(counts, exact) > 1e-3
    assert 0.5 * np.abs(counts / rows - exact).sum() < 0.05
    assert int(np.asarray(out.speculative.drafted).sum()) > 0
    # the favourite is never drafted, yet the target emits it at its own rate
    assert abs((new[:, 1] == favourite).mean() - exact.sum(axis=(0, 2))[favourite]) < 0.02
