"""Greedy speculative decoding equals plain greedy, token for token, on SmolLM2-135M-Instruct
(fp32): prompt lookup, a random small draft with the same vocabulary, the target as its
own draft (which accepts everything), and self-speculative early exit at layers 8 and 30. A ragged batch of 4 runs by default; batch 1 is slow."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxgen
from jaxgen import generate, init_state
from jaxgen.api.generate import default_config, outputs_to_lists

TEXTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
         "What is 2+2?",
         "List three colors: red, green, blue. Again: red,",
         "Hi"]


@pytest.fixture(scope="module")
def smollm():
    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    from jaxgen.models.llama import Llama, LlamaConfig
    draft = Llama(LlamaConfig(vocab_size=model.vocab_size, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              tie_word_embeddings=True))
    return model, params, tokenizer, (draft, draft.init_params(jax.random.key(0)))


def _run(model, params, prompts, cfg, **kw):
    out = generate(params, init_state(model, prompts, cfg), cfg, **kw)
    return outputs_to_lists(out), out.speculative


def _check(smollm, prompts):
    model, params, tokenizer, draft = smollm
    cfg = default_config(model, None, max_new_tokens=14)
    ref, _ = _run(model, params, prompts, cfg)
    got, spec = _run(model, params, prompts, cfg.replace(prompt_lookup_num_tokens=6))
    assert got == ref
    got, spec = _run(model, params, prompts, cfg.replace(num_assistant_tokens=3),
                     assistant_model=draft)
    assert got == ref
    got, spec = _run(model, params, prompts,
                     cfg.replace(num_assistant_tokens=4, assistant_confidence_threshold=0.0),
                     assistant_model=(model, params))
    assert got == ref
    assert np.array_equal(np.asarray(spec.accepted), np.asarray(spec.drafted))
    for exit_layer in (8, 30):  # self-speculative early exit, shared cache (30 = every layer)
        got, spec = _run(model, params, prompts,
                         cfg.replace(assistant_early_exit=exit_layer, num_assistant_tokens=3))
        assert got == ref
        if exit_layer == 30:
            assert np.array_equal(np.asarray(spec.accepted), np.asarray(spec.drafted))


@pytest.mark.slow
def test_greedy_speculative_equals_greedy_ragged_batch(smollm):
    _, _, tokenizer, _ = smollm
    _check(smollm, [tokenizer.encode(t) for t in TEXTS])


@pytest.mark.slow
def test_greedy_speculative_equals_greedy_batch_1(smollm):
    _, _, tokenizer, _ = smollm
    _check(smollm, [tokenizer.encode(TEXTS[0])])
