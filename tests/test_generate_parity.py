"""jaxgen.generate() against transformers generate(): greedy, token for token, fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from model_fixtures import (
    SHARED_CASES,
    hf_generate_rows,
    make_hf_model,
    save_hf_model,
    smollm2_pair,
)

import jaxgen
from jaxgen.models import load

RANDOM_MODELS = SHARED_CASES
RAGGED = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45], [9]]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=sorted(RANDOM_MODELS))
def random_pair(request, tmp_path_factory):
    arch, overrides = RANDOM_MODELS[request.param]
    hf = make_hf_model(arch, seed=7, **overrides)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    model, params, _ = load(folder)
    return model, params, hf


def likely_eos(hf, prompts, pad):
    """A token that greedy decoding emits mid-way for some row, so EOS stops rows early."""
    rows = hf_generate_rows(hf, prompts, pad, max_new_tokens=8, do_sample=False, eos_token_id=None)
    return rows[0][len(prompts[0]) + 4]


def assert_same_generation(model, params, hf, prompts, eos):
    pad = 0
    expected = hf_generate_rows(hf, prompts, pad, max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=eos, top_k=None, top_p=None, temperature=None)
    got = jaxgen.generate_ids(model, params, prompts, max_new_tokens=NEW_TOKENS,
                              eos_token_id=eos, pad_token_id=pad)
    assert got == expected


@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_matches_transformers_on_random_models(random_pair, batch):
    model, params, hf = random_pair
    prompts = RAGGED[:1] if batch == "single" else RAGGED
    eos = likely_eos(hf, prompts, 0)
    assert_same_generation(model, params, hf, prompts, eos)


@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_matches_transformers_on_smollm2(batch):
    model, params, tokenizer, hf = smollm2_pair()
    questions = ["What is the capital of France?", "Write a haiku about rain.",
                 "List three prime numbers.", "Hi"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    prompts = prompts[:1] if batch == "single" else prompts
    eos = tuple(model.config.eos_token_id)
    expected = hf_generate_rows(hf, prompts, tokenizer.pad_token_id, max_new_tokens=24,
                                do_sample=False, eos_token_id=list(eos), top_k=None,
                                top_p=None, temperature=None)
    got = jaxgen.generate_ids(model, params, prompts, max_new_tokens=24)
    assert got == expected


@pytest.mark.slow
def test_smollm2_batch_invariance_greedy_and_sampled():
    model, params, tokenizer, _ = smollm2_pair()
    target = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a fact."}])
    others = [tokenizer.encode("A completely different and much longer prompt " * 4), [1, 2]]
    for do_sample in (False, True):
        cfg = jaxgen.default_config(model, max_new_tokens=12, do_sample=do_sample,
                                    temperature=0.9, top_p=0.95)
        key = jax.random.key(3)
        alone = jaxgen.generate_ids(model, params, [target], cfg, key=key[None])
        batched = jaxgen.generate_ids(model, params, [others[0], target, others[1]], cfg,
                                      key=jnp.stack([jax.random.key(8), key, jax.random.key(9)]))
        assert batched[1] == alone[0], do_sample


@pytest.mark.slow
def test_generate_text_answers_from_the_chat_template():
    model, params, tokenizer, _ = smollm2_pair()
    [answer] = jaxgen.generate_text(model, params, tokenizer, ["What is the capital of France?"],
                                    chat=True, max_new_tokens=16)
    assert "Paris" in answer
