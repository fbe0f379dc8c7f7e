"""The repetition penalty's `prompt_ignore_length` (HF: an argument of
RepetitionPenaltyLogitsProcessor; jaxgen: the dynamic config field of the same name)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import jaxgen
from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.chain import ProcessorContext, process_logits
from tests.stubs import BigramStub, random_table

V, T, B = 40, 16, 4


def batch(seed: int):
    rng = np.random.default_rng(seed)
    scores = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)  # garbage past each length
    length = np.array([1, 5, 9, T], np.int32)
    tokens[:, :T] = np.where(np.arange(T)[None] < length[:, None],
                             rng.integers(0, 8, size=(B, T)), tokens)  # repeats
    ctx = ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                           prompt_len=jnp.asarray(np.minimum(length, 3)))
    return scores, tokens, length, ctx


@pytest.mark.parametrize("ignore", [0, 2, 7, 100, [0, 3, 9, 4]])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_transformers(ignore, seed):
    scores, tokens, length, ctx = batch(seed)
    cfg = GenerationConfig(repetition_penalty=1.7, prompt_ignore_length=ignore)
    ours = np.asarray(process_logits(cfg, jnp.asarray(scores), ctx))
    per_row = np.broadcast_to(np.asarray(ignore), (B,))
    for b in range(B):  # HF on each row alone (int form), and the batch (tensor form)
        ids = torch.tensor(tokens[b, :length[b]][None], dtype=torch.long)
        want = RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=int(per_row[b]))(
            ids, torch.tensor(scores[b][None]))[0].numpy()
        np.testing.assert_allclose(ours[b], want, rtol=1e-6)
    full = torch.tensor(tokens[:, :T], dtype=torch.long)  # row B-1 has no padding
    want = RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=torch.tensor(
        per_row.copy()))(full, torch.tensor(scores))[-1].numpy()
    np.testing.assert_allclose(ours[-1], want, rtol=1e-6)


def test_unset_counts_the_whole_row_and_zero_is_the_same():
    scores, _, _, ctx = batch(2)
    unset = process_logits(GenerationConfig(repetition_penalty=1.3), jnp.asarray(scores), ctx)
    zero = process_logits(GenerationConfig(repetition_penalty=1.3, prompt_ignore_length=0),
                          jnp.asarray(scores), ctx)
    np.testing.assert_array_equal(np.asarray(unset), np.asarray(zero))
    assert not np.array_equal(np.asarray(unset), scores)


@pytest.mark.parametrize("value", [-1, 1.5, "3", [1, -2], True])
def test_bad_values_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="`prompt_ignore_length`"):
        GenerationConfig(repetition_penalty=1.2, prompt_ignore_length=value)


def test_per_row_lengths_are_checked_against_the_batch():
    cfg = GenerationConfig(repetition_penalty=1.2, prompt_ignore_length=[1, 2, 3])
    with pytest.raises(ValueError, match="`prompt_ignore_length` has 3 values"):
        cfg.validate_for_batch(2)


def test_new_values_do_not_recompile_and_change_the_output():
    model = BigramStub(vocab_size=V)
    table = np.zeros((V, V), np.float32)
    table[:, 1], table[:, 5] = 2.0, 1.0  # token 1 wins unless the penalty sees it (2/5 < 1)
    params = {"table": jnp.asarray(table)}
    outputs, before = [], None
    for ignore in (0, 3, 6):  # the prompt is 6 tokens: 6 leaves only generated tokens
        cfg = GenerationConfig(repetition_penalty=5.0, prompt_ignore_length=ignore,
                               max_new_tokens=6)
        state = jaxgen.init_state(model, [[1, 2, 3, 1, 2, 3]], cfg, jax.random.key(0))
        outputs.append(np.asarray(jaxgen.generate(params, state, cfg).sequences)[0].tolist())
        before = jaxgen.trace_count() if before is None else before
    assert jaxgen.trace_count() == before
    new = [o[6:8] for o in outputs]
    assert new == [[5, 1], [5, 1], [1, 5]]  # the prompt's 1 counts unless all 6 are ignored
